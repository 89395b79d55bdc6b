"""Texts the docs would otherwise hold twice live once: the "why" is the README's (docs/index.md
includes it), and no page or metadata file carries an invented address for the project."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
INDEX = ROOT / "docs" / "index.md"

WHY = re.compile(
    r"^<!-- --8<-- \[start:why\] -->\n(?P<body>.*?)^<!-- --8<-- \[end:why\] -->$",
    re.MULTILINE | re.DOTALL,
)
URL = re.compile(r"https?://[^\s)>\"'`]+")


def why() -> str:
    found = WHY.findall(README.read_text(encoding="utf-8"))
    assert len(found) == 1, "README.md holds one why section, between its snippet markers"
    return str(found[0])


def test_the_docs_home_includes_the_readme_why() -> None:
    body = why()
    assert "## Why" in body and "SGLang issue 28528" in body
    index = INDEX.read_text(encoding="utf-8")
    assert '--8<-- "README.md:why"' in index.splitlines()
    # The include needs the snippets extension, reading paths from the repository root.
    mkdocs = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    assert "pymdownx.snippets" in mkdocs and 'base_path: ["."]' in mkdocs


def test_no_page_holds_a_copy_of_the_why() -> None:
    # A sentence of the why in another page is a second copy that would drift.
    sentences = [s for s in re.split(r"(?<=[.;:])\s+", " ".join(why().split())) if len(s) > 60]
    assert len(sentences) >= 4
    copies = [
        f"{page.relative_to(ROOT)}: {s[:50]}..."
        for page in sorted((ROOT / "docs").rglob("*.md"))
        for s in sentences
        if s in " ".join(page.read_text(encoding="utf-8").split())
    ]
    assert copies == []


def test_the_why_links_nowhere_relative() -> None:
    # Included into docs/index.md, a link relative to the README would point elsewhere.
    links = re.findall(r"\]\(([^)]+)\)", why())
    assert [link for link in links if not link.startswith(("https://", "http://"))] == []


def _metadata_and_pages() -> list[Path]:
    return [
        ROOT / "pyproject.toml",
        ROOT / "mkdocs.yml",
        README,
        ROOT / "CHANGELOG.md",
        *sorted((ROOT / "docs").rglob("*.md")),
    ]


def test_no_placeholder_or_invented_project_address() -> None:
    # The project has no public address yet: none is invented (no OWNER placeholders, no guessed
    # organisation), and the registry metadata lists no project URLs until there is one.
    own = re.compile(r"github\.com/[^/\s]+/attn[_-]dispatch|OWNER|example\.(com|org)", re.I)
    found = [
        f"{path.relative_to(ROOT)}: {url}"
        for path in _metadata_and_pages()
        for url in URL.findall(path.read_text(encoding="utf-8"))
        if own.search(url)
    ]
    assert found == []
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert "urls" not in meta
    assert "repo_url" not in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


#: A module named in backticks: `attn_dispatch.x.y`, `attn_dispatch/x/y.py`, or a private one
#: given relative to the package (`_scope`, `backends/_cascade`).
MODULE_REF = re.compile(r"`(attn_dispatch[./][\w./]*|(?:[a-z]\w*/)*_[a-z]\w*)`")


def _exists(ref: str) -> bool:
    path = ref.removesuffix(".py").replace(".", "/")
    if not path.startswith("attn_dispatch"):
        path = f"attn_dispatch/{path}"
    return (ROOT / f"{path}.py").exists() or (ROOT / path / "__init__.py").exists()


def test_the_development_page_names_only_modules_that_exist() -> None:
    # Its module map once described 0.1.0; the page now points at the layer table, and every
    # module it still names must be there.
    text = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    refs = MODULE_REF.findall(text)
    assert "attn_dispatch/_env.py" in refs
    assert [r for r in refs if not _exists(r)] == []
    assert _exists("backends/_cascade") and not _exists("backends/_common")
