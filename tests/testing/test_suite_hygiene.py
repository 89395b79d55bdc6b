"""The test suite's own single sources: the shipped hypothesis strategies (not a copy), one
import scanner, and the tiny transformers models built in one module."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"


def _sources() -> dict[Path, ast.AST]:
    return {p: ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in TESTS.rglob("*.py")}


def test_suite_strategies_are_the_shipped_ones() -> None:
    pytest.importorskip("hypothesis")
    import attn_dispatch.testing.strategies as shipped
    import tests.strategies as suite

    for name in ("phases", "backend_names", "backend_specs"):
        assert getattr(suite, name) is getattr(shipped, name), name
    # No composite strategy of the suite draws what a shipped one of the same name draws.
    tree = ast.parse((TESTS / "strategies.py").read_text(encoding="utf-8"))
    defined = {
        n.name
        for n in tree.body
        if isinstance(n, ast.FunctionDef)
        and any("composite" in ast.unparse(d) for d in n.decorator_list)
    }
    assert not defined & set(shipped.__all__), sorted(defined & set(shipped.__all__))


def test_one_import_scanner() -> None:
    # A scanner is a function named for imports that walks ImportFrom nodes; only
    # tests/imports.py may define them (other AST walks, e.g. of environment reads, are not).
    scanners = sorted(
        f"{p.relative_to(ROOT)}::{f.name}"
        for p, tree in _sources().items()
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        and "import" in f.name
        and any(isinstance(n, ast.Attribute) and n.attr == "ImportFrom" for n in ast.walk(f))
    )
    assert scanners and all(s.startswith("tests/imports.py::") for s in scanners), scanners


def test_tiny_transformers_models_are_built_in_one_module() -> None:
    # A model class of transformers instantiated (``transformers.XForCausalLM(...)``) outside
    # tests/integrations/transformers/tiny.py is a copy of a builder.
    # (The vLLM tests save their own checkpoints for the engine: their fixtures are the vLLM
    # integration's.)
    builders = sorted(
        str(p.relative_to(ROOT))
        for p, tree in _sources().items()
        if "vllm" not in p.parts
        and any(
            isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)
            and n.func.attr.endswith(("ForCausalLM", "Model"))
            and isinstance(n.func.value, ast.Name)
            and n.func.value.id == "transformers"
            for n in ast.walk(tree)
        )
    )
    assert builders == ["tests/integrations/transformers/tiny.py"], builders
    conftest = TESTS / "integrations" / "transformers" / "conftest.py"
    text = conftest.read_text(encoding="utf-8")
    assert "def _quiet_one_thread" in text and "def torch2" in text
    # The fixtures live in the conftest only.
    copies = [
        str(p.relative_to(ROOT))
        for p in (TESTS / "integrations" / "transformers").glob("test_*.py")
        if "def _quiet_one_thread" in p.read_text(encoding="utf-8")
    ]
    assert copies == [], copies
