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

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from tests.imports import import_lines
from tests.imports import imports_of
from tests.imports import modules as _modules

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


def modules(package: Path = PACKAGE, root: Path = ROOT) -> dict[str, Path]:
    return _modules(package, root)


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


def private_imports(source: str, name: str, is_package: bool) -> list[str]:
    """``"line N: attn_dispatch._x"`` for every import of a private core module in ``source``
    (module ``name``): ``import attn_dispatch._x``, ``from attn_dispatch._x import y``, ``from
    attn_dispatch import _x``, their relative forms (``from ..._x import y``, ``from ... import
    _x``) and a constant ``importlib.import_module("attn_dispatch._x")``, wherever they are
    (``if TYPE_CHECKING:`` blocks included: an author's annotations use public names too)."""
    found: list[str] = []
    for line, target in import_lines(source, name, is_package):
        parts = target.split(".")
        if len(parts) > 1 and parts[0] == "attn_dispatch" and parts[1].startswith("_"):
            module = ".".join(parts[:2])
            entry = f"line {line}: {module}"
            if module not in LAYERS_TOOL.BACKENDS_MAY_IMPORT and entry not in found:
                found.append(entry)
    return found


def backends_private_imports(mods: dict[str, Path]) -> list[str]:
    """``"module line N: attn_dispatch._x"`` for each private import under the backends."""
    bad = []
    for name, path in mods.items():
        if name == "attn_dispatch.backends" or name.startswith("attn_dispatch.backends."):
            source = path.read_text(encoding="utf-8")
            for hit in private_imports(source, name, path.name == "__init__.py"):
                bad.append(f"{name} {hit}")
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


def test_the_built_in_backends_import_only_the_authors_surface() -> None:
    # What a built-in needs from the core is on attn_dispatch.backend, where a backend of
    # another package finds it: the public contract is enough to write every built-in.
    mods = modules()
    bad = backends_private_imports(mods)
    assert bad == [], (
        "built-in backends import private core modules; use (or add to) attn_dispatch.backend:"
        "\n" + "\n".join(bad)
    )
    # The scan read the backends (so an empty scan cannot pass), and the allowed module is
    # imported where expected.
    assert sum(n.startswith("attn_dispatch.backends.") for n in mods) >= 10
    native_lib = mods["attn_dispatch.backends.native._lib"].read_text(encoding="utf-8")
    assert "from attn_dispatch._env import" in native_lib


def test_the_private_import_scan_fails_on_planted_imports(tmp_path: Path) -> None:
    source = (
        "from typing import TYPE_CHECKING\n"
        "import attn_dispatch._snapshot\n"  # 2
        "from attn_dispatch._values import check_scale\n"  # 3
        "from attn_dispatch import _vocab, backend\n"  # 4
        "from ..._errors import InvalidBatchError\n"  # 5: attn_dispatch._errors
        "from ... import _phase\n"  # 6
        "from .. import _cascade\n"  # 7: attn_dispatch.backends._cascade, allowed
        "from attn_dispatch.backend import TensorChecks\n"  # 8: public
        "from attn_dispatch._env import NATIVE_LIB\n"  # 9: allowed, with its reason
        "if TYPE_CHECKING:\n"
        "    from attn_dispatch._config import AttnConfig\n"  # 11
        "def f():\n"
        "    import importlib\n"
        "    return importlib.import_module('attn_dispatch._tensor_checks')\n"  # 14
    )
    name = "attn_dispatch.backends.mine.backend"
    assert private_imports(source, name, False) == [
        "line 2: attn_dispatch._snapshot",
        "line 3: attn_dispatch._values",
        "line 4: attn_dispatch._vocab",
        "line 5: attn_dispatch._errors",
        "line 6: attn_dispatch._phase",
        "line 11: attn_dispatch._config",
        "line 14: attn_dispatch._tensor_checks",
    ]
    # The whole check, on a fake package holding one such file.
    pkg = tmp_path / "attn_dispatch" / "backends" / "mine"
    pkg.mkdir(parents=True)
    for init in (pkg.parents[1], pkg.parents[0], pkg):
        (init / "__init__.py").write_text("")
    (pkg / "backend.py").write_text(source)
    (pkg / "_ok.py").write_text("from attn_dispatch.backend import Phase\n")
    bad = backends_private_imports(modules(tmp_path / "attn_dispatch", tmp_path))
    assert len(bad) == 7 and bad[0] == f"{name} line 2: attn_dispatch._snapshot", bad


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
