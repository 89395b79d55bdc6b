"""The package's layers: the one table (``LAYERS``), and its rendering into the docs.

Each module of attn_dispatch/ imports only modules of its own layer or below;
``tests/core/test_layers.py`` reads ``LAYERS`` from here and fails on an upward import or on a
module missing from the table, so a new module declares its layer before it can import anything.
A name ending in ``.*`` covers a package's submodules; a name that does not exist yet is a
planned module.

The docs show the table where a page holds

    <!-- generated: python tools/layers.py -->
    ...the table...
    <!-- end generated -->

    python tools/layers.py           # rewrite the stale blocks of docs/
    python tools/layers.py --check   # exit 1 and name the stale pages (tests keep them fresh)

It is also a MkDocs hook (mkdocs.yml): ``on_page_markdown`` renders the blocks at build time.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Any
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]


class Layer(NamedTuple):
    number: int
    title: str
    rule: str  # what holds for its modules
    modules: tuple[str, ...]  # relative to attn_dispatch ("" is the package itself)


LAYERS: tuple[Layer, ...] = (
    Layer(
        0,
        "vocabulary, values, errors, phase",
        "no behaviour beyond checks; the standard library only",
        ("_env", "_errors", "_version", "_vocab", "_values", "_dtypes", "_phase", "_table"),
    ),
    Layer(
        1,
        "value types: spec, config, capabilities, forms",
        "frozen, torch-free",
        ("_spec", "_config", "_capabilities", "_forms"),
    ),
    Layer(
        2,
        "the backend contract: protocol, registry, paged-batch contract checks",
        "the author's surface, `attn_dispatch.backend`",
        (
            "_protocol",
            "_plans",
            "_registry",
            "_contract",
            "_snapshot",
            "_tensor_checks",
            "_masks",
            "backend",
        ),
    ),
    Layer(
        3,
        "bind and its checks (shared with explain), per-call rules",
        "start-up: every reason before raising",
        ("_calls", "_route", "_binding", "_matrix"),
    ),
    Layer(
        4,
        "scope, record, threads",
        "the hot path: `attn_scope`, `resolve`, `attention`",
        ("_frame", "_scope", "_record", "_threads"),
    ),
    Layer(
        5,
        "torch-level",
        "import torch when used",
        (
            "_batch",
            "state",
            "mla",
            "compile",
            "_dynamo_hook",
            "cuda_graph",
            "testing",
            "testing.*",
            "_context_parallel",
            "distributed",
            "distributed.*",
            "kv_layout",
        ),
    ),
    Layer(
        6,
        "backends",
        "per backend: a light module (capabilities) and the heavy one; they import the "
        "author's surface `attn_dispatch.backend`, never a private `attn_dispatch._*` module",
        ("backends", "backends.*"),
    ),
    Layer(
        7,
        "integrations, the CLI, the demo, the contract kit, and the package itself",
        "the package's `__init__` wires the built-in backends into the registry",
        (
            "",
            "__main__",
            "cli",
            "cli.*",
            "tune",
            "dispatch_table",
            "integrations",
            "integrations.*",
            "demo",
            "demo.*",
            "testing.contract",
            "testing.contract.*",
        ),
    ),
)


#: The built-in backends (``attn_dispatch.backends.*``) build on the author's surface,
#: ``attn_dispatch.backend``, as a backend of another package must: an import of a private core
#: module (``attn_dispatch._*``) is refused there (``tests/core/test_layers.py``), save these,
#: each with its reason.
BACKENDS_MAY_IMPORT: dict[str, str] = {
    "attn_dispatch._env": (
        "the repository's one list of environment variable names (tests/core/test_env.py); "
        "a backend of another package names its own"
    ),
}


def table() -> dict[str, int]:
    """Full module name (or ``package.*``) -> layer."""
    found: dict[str, int] = {}
    for layer in LAYERS:
        for module in layer.modules:
            name = f"attn_dispatch.{module}" if module else "attn_dispatch"
            if name in found:
                raise ValueError(f"{name!r} is in layers {found[name]} and {layer.number}")
            found[name] = layer.number
    return found


def markdown_table() -> str:
    """The table as Markdown: one row per layer."""
    rows = ["| layer | modules (under `attn_dispatch`) | rule |", "| --- | --- | --- |"]
    for layer in LAYERS:
        mods = ", ".join(f"`{m}`" if m else "the package (`__init__`)" for m in layer.modules)
        rows.append(f"| L{layer.number} {layer.title} | {mods} | {layer.rule} |")
    return "\n".join(rows)


#: A generated block: the opening marker names this script; the body is the table.
BLOCK = re.compile(
    r"(?P<open><!-- generated: python tools/layers\.py -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.DOTALL,
)


def render(text: str) -> str:
    """``text`` with every layers block rebuilt."""
    return BLOCK.sub(lambda m: m["open"] + markdown_table() + "\n" + m["close"], text)


def pages() -> list[Path]:
    """Every docs page that holds a layers block."""
    return [
        p
        for p in sorted((ROOT / "docs").rglob("*.md"))
        if BLOCK.search(p.read_text(encoding="utf-8"))
    ]


def stale_pages() -> list[Path]:
    return [p for p in pages() if render(p.read_text(encoding="utf-8")) != p.read_text("utf-8")]


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs hook: the page as built, its layers blocks rebuilt."""
    return render(markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which pages are stale")
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page in stale:
        rel = page.relative_to(ROOT)
        if args.check:
            print(f"{rel}: stale (run `python tools/layers.py`)")
        else:
            page.write_text(render(page.read_text(encoding="utf-8")), encoding="utf-8")
            print(f"{rel}: updated")
    if not stale:
        print(f"{len(pages())} pages with the layers table: up to date")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
