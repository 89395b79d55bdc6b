"""What the README and the docs promise: the README's example runs, its test command is the one
CI runs, and every generated table is what the backends declare."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"

FENCE = re.compile(r"^```(?P<lang>\w*)\n(?P<body>.*?)^```$", re.MULTILINE | re.DOTALL)
TEST_COMMAND = re.compile(
    r"<!-- test-command -->\n```bash\n(?P<cmd>[^\n]+)\n```\n<!-- end test-command -->"
)


def blocks(path: Path, lang: str) -> list[str]:
    return [
        m["body"] for m in FENCE.finditer(path.read_text(encoding="utf-8")) if m["lang"] == lang
    ]


def _native_missing() -> str | None:
    # The example binds `native`; on a machine where it could not be built (no compiler) bind
    # says why, and the example cannot run there.
    from attn_dispatch import AttnConfig
    from attn_dispatch import IncompatibleBackendError
    from attn_dispatch import bind

    try:
        bind("native", AttnConfig("mha", 2, 2, 8, dtype="float32", page_size=4))
    except IncompatibleBackendError as exc:
        return str(exc)
    return None


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= 250, f"README.md has {lines} lines; the front door stays at most 250"


def test_readme_python_blocks_run() -> None:
    pytest.importorskip("torch")
    missing = _native_missing()
    if missing:
        pytest.skip(f"the example binds the native backend, not built here: {missing}")
    code = "\n\n".join(blocks(README, "python"))
    assert "attn_scope" in code and "bind(" in code
    # A fresh interpreter from the repository root: nothing of this test process leaks in.
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The output shown under the example is what it prints (the table of its two runners).
    shown = next(b for b in blocks(README, "text") if "runner" in b)
    assert proc.stdout.split() == shown.split()


def test_quickstart_example_is_the_readme_example() -> None:
    readme = blocks(README, "python")[0]
    assert readme in blocks(ROOT / "docs" / "quickstart.md", "python")


def test_readme_test_command_is_what_ci_runs() -> None:
    m = TEST_COMMAND.search(README.read_text(encoding="utf-8"))
    assert m, "README.md lost its <!-- test-command --> block"
    assert m["cmd"].count("pytest") == 2  # the main suite, then the vLLM engine tests
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    # CI reads the command from the README rather than holding a copy that could drift.
    assert m["cmd"] not in ci
    assert "test-command" in ci


def test_generated_tables_are_the_declarations() -> None:
    # tools/ is not a package: load the script as a module by its path.
    spec = importlib.util.spec_from_file_location("docs_matrix", ROOT / "tools" / "docs_matrix.py")
    assert spec is not None and spec.loader is not None
    docs_matrix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(docs_matrix)
    pages = docs_matrix.pages()
    names = {p.relative_to(ROOT).as_posix() for p in pages}
    assert {"README.md", "docs/backends/matrix.md"} <= names, names
    stale = [p.relative_to(ROOT).as_posix() for p in docs_matrix.stale_pages()]
    assert not stale, f"{stale}: generated tables are stale; run `python tools/docs_matrix.py`"


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert pages
    assert [p for p in pages if p not in nav] == []


def test_registry_metadata() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    meta = project["project"]
    assert meta["license"] == "Apache-2.0" and meta["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text(encoding="utf-8")[:200]
    assert "Typing :: Typed" in meta["classifiers"] and meta["keywords"]
    # The typed marker is shipped in the wheel.
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["attn_dispatch"]
    assert (ROOT / "attn_dispatch" / "py.typed").exists()
    # The tools CI trusts are pinned, so a tool's release cannot change CI's verdict.
    extras = meta["optional-dependencies"]
    pins = {r.split("==")[0]: r for r in extras["dev"] + extras["docs"] if "==" in r}
    assert {"mypy", "ruff", "mkdocs", "mkdocs-material", "mkdocstrings"} <= set(pins), pins
