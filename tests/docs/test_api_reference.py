"""The API reference documents both public surfaces: every name in ``attn_dispatch.__all__``
and ``attn_dispatch.backend.__all__`` has an entry."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import attn_dispatch
import attn_dispatch.backend

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api"

# A `::: module` directive and the options indented under it.
DIRECTIVE = re.compile(r"^::: (?P<target>[\w.]+)\n(?P<options>(?:[ \t]+\S.*\n?)*)", re.MULTILINE)


def directives(page: Path) -> dict[str, str]:
    text = page.read_text(encoding="utf-8")
    return {m["target"]: m["options"] for m in DIRECTIVE.finditer(text)}


def listed_members(options: str) -> list[str]:
    # The `members:` list of a directive's options: `- name` lines indented below it.
    m = re.search(
        r"^(?P<indent>[ \t]+)members:\n(?P<body>(?:(?P=indent)[ \t]+- .*\n?)*)", options, re.M
    )
    return re.findall(r"- (\S+)", m["body"]) if m else []


def _pycon_hook() -> Any:
    # tools/ is not a package: load the hook as a module by its path.
    spec = importlib.util.spec_from_file_location("docs_pycon", ROOT / "tools" / "docs_pycon.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docstring_examples_become_pycon_blocks() -> None:
    pytest.importorskip("markdown")
    fence = _pycon_hook().fence_examples
    text = [
        "Prose.",
        "    >>> x = 1  # doctest: +ELLIPSIS",
        "    >>> for i in range(2):",
        "    ...     x += i",
        "    >>> x",
        "    2",
        "",
        "```python",
        ">>> inside_a_fence()",
        "```",
    ]
    assert fence(text) == [
        "Prose.",
        "",
        "```pycon",
        ">>> x = 1",
        ">>> for i in range(2):",
        "...     x += i",
        ">>> x",
        "2",
        "```",
        "",
        "",
        "```python",
        ">>> inside_a_fence()",
        "```",
    ]


def test_framework_page_lists_every_public_name() -> None:
    found = directives(API / "framework.md")
    assert "attn_dispatch" in found, "docs/api/framework.md lost its `::: attn_dispatch` entry"
    members = listed_members(found["attn_dispatch"])
    # members: is a whitelist, so a name left out of it has no entry on the page.
    assert sorted(set(attn_dispatch.__all__) - set(members)) == []
    assert sorted(set(members) - set(attn_dispatch.__all__)) == []


def test_backend_page_renders_the_whole_module() -> None:
    found = directives(API / "backend.md")
    # The module itself, with no members: whitelist, renders every name of its __all__ (the
    # built-site test below checks that each one got an entry).
    assert list(found) == ["attn_dispatch.backend"], found
    assert "members:" not in found["attn_dispatch.backend"]


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings") is None,
    reason="the docs tools are not installed (pip install -e '.[docs]')",
)
def test_built_site_has_an_entry_per_public_name(tmp_path: Path) -> None:
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for page, module, names in (
        ("framework", "attn_dispatch", attn_dispatch.__all__),
        ("backend", "attn_dispatch.backend", attn_dispatch.backend.__all__),
    ):
        html = (site / "api" / page / "index.html").read_text(encoding="utf-8")
        # mkdocstrings gives each documented object an anchor named by its public path.
        ids = set(re.findall(r'id="([^"]+)"', html))
        missing = [n for n in names if f"{module}.{n}" not in ids]
        assert missing == [], f"docs/api/{page}.md has no entry for {missing}"
        # Docstring examples are code (tools/docs_pycon.py), not ">" block quotes.
        assert "<blockquote>" not in html
        # Every prompt is a highlighted console prompt (Pygments' "gp" token).
        assert html.count("&gt;&gt;&gt;") == html.count('<span class="gp">&gt;&gt;&gt; </span>') > 0
