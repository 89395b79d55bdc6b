"""The suite's one import scanner: which of our modules a source file imports.

Used by the layer table (tests/core/test_layers.py), the import graph (tests/core/
test_import.py), the transformers package order and the demo's cycle check. An import counts
wherever it is (module level or inside a function), except under ``if TYPE_CHECKING:`` (its
``else`` branch counts); relative imports are resolved; ``from pkg import sub`` names the
submodule when ``sub`` is one; a constant ``importlib.import_module("...")`` counts too.
"""

from __future__ import annotations

import ast
from collections.abc import Collection
from pathlib import Path

__all__ = ["import_lines", "imports_of", "module_name", "modules", "path_imports"]


def module_name(path: Path, root: Path) -> str:
    """``attn_dispatch.cli.model`` for ``root/attn_dispatch/cli/model.py`` (a package's
    ``__init__.py`` is the package)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(package: Path, root: Path) -> dict[str, Path]:
    """Every module under ``package`` by dotted name."""
    return {module_name(p, root): p for p in sorted(package.rglob("*.py"))}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _from_base(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    """The absolute module a ``from ... import`` in module ``name`` reads from."""
    base = node.module or ""
    if node.level:
        pkg = name if is_package else name.rpartition(".")[0]
        for _ in range(node.level - 1):
            pkg = pkg.rpartition(".")[0]
        base = f"{pkg}.{base}" if base else pkg
    return base


def _import_module_name(node: ast.AST) -> str | None:
    """``"a.b"`` for a call ``importlib.import_module("a.b")`` (or a bare ``import_module``)
    with a constant name, else None."""
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute | ast.Name)
        and (node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id)
        == "import_module"
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
    ):
        return node.args[0].value
    return None


def imports_of(
    source: str,
    name: str,
    is_package: bool,
    known: Collection[str],
    prefix: str = "attn_dispatch",
) -> set[str]:
    """The modules under ``prefix`` that ``source`` (module ``name``) imports; ``known`` are
    the module names that exist (so ``from pkg import sub`` resolves to ``pkg.sub``)."""
    found: set[str] = set()

    def ours(target: str) -> bool:
        return target == prefix or target.startswith(prefix + ".")

    def add(target: str, names: list[str]) -> None:
        if not ours(target):
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
            base = _from_base(node, name, is_package)
            add(base, [a.name for a in node.names])
        elif _import_module_name(node) is not None:
            add(_import_module_name(node) or "", [])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(source, name))
    found.discard(name)
    return found


def path_imports(
    path: Path, name: str, known: Collection[str], prefix: str = "attn_dispatch"
) -> set[str]:
    """``imports_of`` the file at ``path`` (module ``name``)."""
    return imports_of(
        path.read_text(encoding="utf-8"), name, path.name == "__init__.py", known, prefix
    )


def import_lines(source: str, name: str, is_package: bool) -> list[tuple[int, str]]:
    """``(line, target)`` for every import in ``source`` (module ``name``), wherever it is
    (``if TYPE_CHECKING:`` blocks included): ``import a.b`` gives ``a.b``; ``from a import b``
    gives ``a`` and ``a.b`` (relative forms resolved); a constant
    ``importlib.import_module("a.b")`` gives ``a.b``. For rules on what may be imported at all
    (the backends' public-surface rule), where ``imports_of``'s module graph is not enough."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(node, name, is_package)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif _import_module_name(node) is not None:
            found.append((node.lineno, _import_module_name(node) or ""))
    return found
