"""The package's layers point down only: each module imports modules of its own layer or below.

The table is ``LAYERS`` of tools/layers.py, the one copy (the docs render it); every module of
attn_dispatch/ must be in it, so a new module declares its layer before it can import anything.
An entry ending in ``.*`` covers a package's submodules. An import is any ``import``/``from
... import`` statement anywhere in a module (function-level ones included: a lazy import is
still a dependency) and any ``importlib.import_module("attn_dispatch....")`` with a constant
name; ``if TYPE_CHECKING:`` blocks are left out (annotations only). Importing a package's
parents as a side effect of Python's import system does not count.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "attn_dispatch"


def _load_layers() -> ModuleType:
    # tools/ is not a package: load the table's module by its path.
    spec = importlib.util.spec_from_file_location("layers", ROOT / "tools" / "layers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


LAYERS_TOOL = _load_layers()
#: module (or ``package.*``) -> layer, from the one table (tools/layers.py).
LAYERS: dict[str, int] = LAYERS_TOOL.table()


def layer_of(module: str, table: dict[str, int] = LAYERS) -> int | None:
    """The layer of ``module``: its own entry, else the nearest ``package.*`` above it."""
    if module in table:
        return table[module]
    parts = module.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        found = table.get(".".join(parts[:cut]) + ".*")
        if found is not None:
            return found
    return None


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path = PACKAGE, root: Path = ROOT) -> dict[str, Path]:
    return {_module_name(p, root): p for p in sorted(package.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """Our modules that ``source`` (module ``name``) imports (see the module's docstring)."""
    found: set[str] = set()

    def add(target: str, names: list[str]) -> None:
        if target.split(".")[0] != "attn_dispatch":
            return
        if not names:
            found.add(target)
        for alias in names:
            sub = f"{target}.{alias}"
            found.add(sub if sub in known else target)

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for stmt in node.orelse:
                visit(stmt)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, [])
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = name if is_package else name.rpartition(".")[0]
                for _ in range(node.level - 1):
                    pkg = pkg.rpartition(".")[0]
                base = f"{pkg}.{base}" if base else pkg
            add(base, [a.name for a in node.names])
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
            == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            add(node.args[0].value, [])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source, name))
    found.discard(name)
    return found


def upward_imports(mods: dict[str, Path], table: dict[str, int] = LAYERS) -> list[str]:
    """``"a (L5) imports b (L6)"`` for every import that points up."""
    known = set(mods)
    bad = []
    for name, path in mods.items():
        own = layer_of(name, table)
        assert own is not None, name
        for target in sorted(imports_of(path.read_text(), name, path.name == "__init__.py", known)):
            theirs = layer_of(target, table)
            if theirs is not None and theirs > own:
                bad.append(f"{name} (L{own}) imports {target} (L{theirs})")
    return bad


def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in modules() if layer_of(m) is None)
    assert missing == [], f"add these modules to LAYERS (tools/layers.py): {missing}"


def test_no_module_imports_a_layer_above_its_own() -> None:
    bad = upward_imports(modules())
    assert bad == [], "imports that point up:\n" + "\n".join(bad)


def test_the_scan_sees_the_imports_it_must() -> None:
    # Known edges (so an empty scan cannot pass): a top-level, a function-level, a relative-free
    # `from package import module` and a constant import_module() call.
    mods = modules()
    known = set(mods)

    def deps(name: str) -> set[str]:
        path = mods[name]
        return imports_of(path.read_text(), name, path.name == "__init__.py", known)

    assert "attn_dispatch._contract" in deps("attn_dispatch._batch")  # inside __post_init__
    assert "attn_dispatch._registry" in deps("attn_dispatch")  # `from attn_dispatch import x`
    assert "attn_dispatch.integrations.transformers" in deps("attn_dispatch.cli.model")
    assert "attn_dispatch._snapshot" in deps("attn_dispatch.cuda_graph")


def test_the_checker_fails_on_planted_upward_imports(tmp_path: Path) -> None:
    # The checker itself can fail: a fake package with each kind of upward import.
    pkg = tmp_path / "attn_dispatch"
    (pkg / "backends").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "backends" / "__init__.py").write_text("")
    (pkg / "_errors.py").write_text("def f():\n    from attn_dispatch import backends\n")
    (pkg / "_spec.py").write_text(
        "import importlib\nimportlib.import_module('attn_dispatch.cli')\n"
    )
    (pkg / "cli.py").write_text("")
    (pkg / "_phase.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import attn_dispatch.cli\n"
    )
    table = {
        **{"attn_dispatch": 7, "attn_dispatch.cli": 7, "attn_dispatch.backends": 6},
        **{"attn_dispatch._errors": 0, "attn_dispatch._spec": 1, "attn_dispatch._phase": 0},
    }
    bad = upward_imports(modules(pkg, tmp_path), table)
    assert bad == [
        "attn_dispatch._errors (L0) imports attn_dispatch.backends (L6)",
        "attn_dispatch._spec (L1) imports attn_dispatch.cli (L7)",
    ]


@pytest.mark.parametrize(
    ("module", "layer"),
    [
        ("attn_dispatch.backends.sdpa.backend", 6),
        ("attn_dispatch.integrations.transformers.use", 7),
        ("attn_dispatch._spec", 1),
        ("attn_dispatch.somewhere_new", None),
    ],
)
def test_layer_of_reads_packages_and_refuses_strangers(module: str, layer: int | None) -> None:
    assert layer_of(module) == layer


def test_the_docs_show_the_table() -> None:
    # The docs render the one table (the MkDocs hook at build time); the committed pages are
    # kept fresh too, so the Markdown read on its own is right.
    pages = [p.relative_to(ROOT).as_posix() for p in LAYERS_TOOL.pages()]
    assert "docs/layers-and-surfaces.md" in pages, pages
    stale = [p.relative_to(ROOT).as_posix() for p in LAYERS_TOOL.stale_pages()]
    assert not stale, f"{stale}: the layers table is stale; run `python tools/layers.py`"
    table = LAYERS_TOOL.markdown_table()
    assert "| L0 vocabulary" in table and "`backends.*`" in table and "`_scope`" in table


def test_the_table_refuses_a_module_in_two_layers() -> None:
    layer = LAYERS_TOOL.Layer
    twice = (layer(0, "a", "", ("_x",)), layer(1, "b", "", ("_x",)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LAYERS_TOOL, "LAYERS", twice)
        with pytest.raises(ValueError, match="in layers 0 and 1"):
            LAYERS_TOOL.table()
