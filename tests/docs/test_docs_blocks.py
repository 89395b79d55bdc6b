"""Every Python block of every docs page runs (docs/development.md, "Code blocks in the docs").

A page's ``python`` blocks run in order in one fresh interpreter, from the repository root, as
a reader pasting them one after another would: a later block may use the names of an earlier
one. A block that cannot run on its own here (it needs a GPU, a vLLM engine, a model
checkpoint, or it shows only the shape of a larger program) carries a marker on the line just
before its fence, with the reason:

    <!-- sketch: needs a CUDA device -->
    ```python
    ...
    ```

The page's test leaves the block out; the block's own test item checks that it is still valid
Python and skips with that reason. A marker without a reason is an error, so every skip says
why. Other languages (``bash``, ``text``) are not run.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

#: A fence, maybe indented (inside an admonition or a list), with the line before it (where a
#: marker may stand); the closing fence has the opening one's indent.
FENCE = re.compile(
    r"(?:^(?P<before>[^\n]*)\n)?^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[^\n]*\n"
    r"(?P<body>.*?)^(?P=indent)```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
SKETCH = re.compile(r"^<!--\s*sketch:(?P<reason>.*?)-->\s*$")


@dataclass(frozen=True, slots=True)
class Block:
    page: str
    line: int
    code: str
    sketch: str | None  # the reason it does not run, or None


def python_blocks(path: Path, root: Path = ROOT) -> list[Block]:
    """The ``python`` blocks of a Markdown page, in order, each with its sketch reason."""
    text = path.read_text(encoding="utf-8")
    rel = path.relative_to(root).as_posix()
    found = []
    for m in FENCE.finditer(text):
        if m["lang"] != "python":
            continue
        line = text.count("\n", 0, m.start("lang")) + 1
        marker = SKETCH.match((m["before"] or "").strip())
        reason = None
        if marker is not None:
            reason = marker["reason"].strip()
            if not reason:
                raise ValueError(f"{rel}:{line}: a sketch marker must say why the block cannot run")
        body = textwrap.dedent(m["body"]) if m["indent"] else m["body"]
        found.append(Block(rel, line, body, reason))
    return found


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _pages_with_blocks() -> list[Path]:
    return [p for p in pages() if python_blocks(p)]


def program(blocks: list[Block]) -> str:
    """The blocks that run, joined; each starts on its own page line so a traceback's line
    numbers point into the page."""
    lines: list[str] = []
    for block in blocks:
        if block.sketch is not None:
            continue
        lines += [""] * (block.line - len(lines))
        lines += block.code.splitlines()
    return "\n".join(lines) + "\n"


def _native_missing() -> str | None:
    from attn_dispatch import AttnConfig
    from attn_dispatch import IncompatibleBackendError
    from attn_dispatch import bind

    try:
        bind("native", AttnConfig("mha", 2, 2, 8, dtype="float32", page_size=4))
    except IncompatibleBackendError as exc:
        return str(exc)
    return None


def _page_id(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", _pages_with_blocks(), ids=_page_id)
def test_page_python_blocks_run(page: Path) -> None:
    blocks = python_blocks(page)
    code = program(blocks)
    if not code.strip():
        pytest.skip("every block of the page is a sketch (each is its own skipped item)")
    if "torch" in code:
        pytest.importorskip("torch")
    if "native" in code:
        missing = _native_missing()
        if missing:
            pytest.skip(f"the blocks bind the native backend, not built here: {missing}")
    # A fresh interpreter from the repository root: nothing of this test process leaks in, and
    # the checkout's package is the one imported.
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"{page.relative_to(ROOT)}:\n{proc.stderr[-3000:]}"


def _sketches() -> list[Block]:
    return [b for p in pages() for b in python_blocks(p) if b.sketch is not None]


@pytest.mark.parametrize("block", _sketches(), ids=lambda b: f"{b.page}:{b.line}")
def test_sketch_parses_and_is_skipped_with_its_reason(block: Block) -> None:
    # A sketch does not run here, but it is still Python a reader can paste.
    compile(block.code, f"{block.page}:{block.line}", "exec")
    pytest.skip(f"sketch: {block.sketch}")


def test_the_scan_finds_the_blocks_and_every_sketch_says_why() -> None:
    found = [b for p in pages() for b in python_blocks(p)]
    assert len(found) >= 25, len(found)  # an empty scan cannot pass
    assert all(b.sketch for b in found if b.sketch is not None)
    assert sum(b.sketch is None for b in found) >= 10  # most examples run


def test_the_parser_reads_markers_and_refuses_a_bare_one(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "Intro\n\n```python\nx = 1\n```\n\n<!-- sketch: needs a GPU -->\n```python\n"
        "import cuda_thing\n```\n\n```bash\nls\n```\n\n```python\nassert x == 1\n```\n"
        '\n??? example "In an admonition"\n\n    ```python\n    y = x + 1\n    ```\n',
        encoding="utf-8",
    )
    blocks = python_blocks(page, tmp_path)
    assert [(b.line, b.sketch) for b in blocks] == [
        (3, None),
        (8, "needs a GPU"),
        (16, None),
        (22, None),
    ]
    assert blocks[-1].code == "y = x + 1\n"  # dedented
    code = program(blocks)
    assert "cuda_thing" not in code
    # Line numbers of the program are the page's, so a traceback points into the page.
    assert code.splitlines()[3] == "x = 1" and code.splitlines()[16] == "assert x == 1"
    exec(compile(code, "page.md", "exec"), {})
    page.write_text("<!-- sketch: -->\n```python\npass\n```\n", encoding="utf-8")
    with pytest.raises(ValueError, match="must say why"):
        python_blocks(page, tmp_path)
