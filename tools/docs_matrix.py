"""The generated tables of the docs: blocks of ``python -m attn_dispatch matrix`` output.

A page holds a block as

    <!-- generated: python -m attn_dispatch matrix --format markdown --fields kinds -->
    ...the command's output...
    <!-- end generated -->

and this module rebuilds every such block from the registered backends' own declarations,
by running that command (the public CLI, so the tables are exactly what a user sees).

    python tools/docs_matrix.py           # rewrite the stale blocks of docs/ and README.md
    python tools/docs_matrix.py --check   # exit 1 and name the stale pages (tests, CI)

It is also the MkDocs hook named in mkdocs.yml: ``on_page_markdown`` renders the blocks of
each page at build time, so the built site shows the declarations even if a page is stale
(``tests/docs/test_docs.py`` keeps the committed pages fresh as well).
"""

from __future__ import annotations

import argparse
import functools
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

#: The opening marker names the command; the body is its output, up to the closing marker.
BLOCK = re.compile(
    r"(?P<open><!-- generated: python -m attn_dispatch matrix(?P<args>[^>]*?) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- end generated -->)",
    re.DOTALL,
)


@functools.cache
def matrix_output(args: tuple[str, ...]) -> str:
    """What ``python -m attn_dispatch matrix ARGS`` prints, run from the repository root (so
    the checkout's package is the one imported)."""
    proc = subprocess.run(
        [sys.executable, "-m", "attn_dispatch", "matrix", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"`python -m attn_dispatch matrix {' '.join(args)}` exited {proc.returncode}: "
            f"{proc.stderr.strip()}"
        )
    return proc.stdout.rstrip("\n")


def render(text: str) -> str:
    """``text`` with every generated block's body rebuilt."""

    def sub(m: re.Match[str]) -> str:
        return m["open"] + matrix_output(tuple(m["args"].split())) + "\n" + m["close"]

    return BLOCK.sub(sub, text)


def pages() -> list[Path]:
    """Every Markdown file that holds a generated block: the docs pages and the README."""
    candidates = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [p for p in candidates if BLOCK.search(p.read_text(encoding="utf-8"))]


def stale_pages() -> list[Path]:
    return [p for p in pages() if render(p.read_text(encoding="utf-8")) != p.read_text("utf-8")]


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    """MkDocs hook: the page as built, its generated blocks rebuilt."""
    return render(markdown)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which pages are stale")
    args = parser.parse_args(argv)
    stale = stale_pages()
    for page in stale:
        rel = page.relative_to(ROOT)
        if args.check:
            print(f"{rel}: stale (run `python tools/docs_matrix.py`)")
        else:
            page.write_text(render(page.read_text(encoding="utf-8")), encoding="utf-8")
            print(f"{rel}: updated")
    if not stale:
        print(f"{len(pages())} pages with generated tables: up to date")
    return 1 if (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
