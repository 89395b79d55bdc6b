"""Every environment variable the project reads is named once, in ``attn_dispatch._env``, and
listed in docs/environment.md.

The package's reads (``os.environ.get(K)``, ``os.environ[K]``, ``os.getenv(K)``, ``K in
os.environ``, ...) are found in the syntax tree; ``K`` must lead, through module-level names,
to a constant imported from ``attn_dispatch._env``: a literal name is refused. The C++ kernels'
``getenv("...")`` and setup.py's reads cannot import the module; their literal names must be
in it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from attn_dispatch import _env

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "attn_dispatch"
PAGE = ROOT / "docs" / "environment.md"
ENV_MODULE = "attn_dispatch._env"

#: ``getenv("NAME")`` in C or C++, ``environ.get("NAME")`` / ``environ["NAME"]`` in setup.py.
LITERAL_READ = re.compile(r"""(?:getenv|environ\.get|environ\[)\(?\s*["']([A-Za-z_][\w]*)["']""")
#: The first column of the page's first table: `` `NAME` ``.
PAGE_ROW = re.compile(r"^\| `([A-Z][A-Z0-9_]*)` \|", re.MULTILINE)


def defined() -> dict[str, str]:
    """Constant -> variable name, as ``attn_dispatch._env`` defines them."""
    return {k: v for k, v in vars(_env).items() if k.isupper() and isinstance(v, str)}


def _is_environ(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ"


def _read_keys(tree: ast.Module) -> list[ast.expr]:
    """The key expression of every environment read in a module."""
    keys: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            func = node.func
            if isinstance(func, ast.Attribute) and (
                (_is_environ(func.value) and func.attr in {"get", "pop", "setdefault"})
                or func.attr == "getenv"
            ):
                keys.append(node.args[0])
        elif isinstance(node, ast.Subscript) and _is_environ(node.value):
            keys.append(node.slice)
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            keys.append(node.left)
    return keys


def env_reads(source: str, where: str) -> tuple[set[str], list[str]]:
    """(variable names read through ``attn_dispatch._env``, problems) for one module."""
    tree = ast.parse(source, where)
    from_env: dict[str, str] = {}  # local name -> constant of _env
    env_modules: set[str] = set()  # local names bound to the module itself
    assigned: dict[str, ast.expr] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == ENV_MODULE:
            from_env.update({a.asname or a.name: a.name for a in stmt.names})
        elif isinstance(stmt, ast.ImportFrom) and stmt.module == "attn_dispatch":
            env_modules.update(a.asname or a.name for a in stmt.names if a.name == "_env")
        elif isinstance(stmt, ast.Import):
            env_modules.update(a.asname for a in stmt.names if a.name == ENV_MODULE and a.asname)
        elif isinstance(stmt, ast.Assign) and len(stmt.targets) == 1:
            target = stmt.targets[0]
            if isinstance(target, ast.Name):
                assigned[target.id] = stmt.value
    constants = defined()

    def resolve(key: ast.expr, seen: frozenset[str] = frozenset()) -> str | None:
        if isinstance(key, ast.Name) and key.id in from_env:
            return constants.get(from_env[key.id])
        if isinstance(key, ast.Name) and key.id in assigned and key.id not in seen:
            return resolve(assigned[key.id], seen | {key.id})
        if (
            isinstance(key, ast.Attribute)
            and isinstance(key.value, ast.Name)
            and key.value.id in env_modules
        ):
            return constants.get(key.attr)
        return None

    names: set[str] = set()
    problems: list[str] = []
    for key in _read_keys(tree):
        name = resolve(key)
        if name is None:
            problems.append(
                f"{where}:{key.lineno}: reads the environment variable {ast.unparse(key)}; "
                f"name it in {ENV_MODULE} and read it through that constant"
            )
        else:
            names.add(name)
    return names, problems


def package_reads() -> tuple[set[str], list[str]]:
    names: set[str] = set()
    problems: list[str] = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "_env.py":
            continue
        found, bad = env_reads(path.read_text(encoding="utf-8"), str(path.relative_to(ROOT)))
        names |= found
        problems += bad
    return names, problems


def literal_reads() -> dict[str, set[str]]:
    """Variable name -> the files outside the Python package that read it (C++, setup.py)."""
    found: dict[str, set[str]] = {}
    sources = [*sorted((ROOT / "csrc").rglob("*.[ch]*")), ROOT / "setup.py"]
    for path in sources:
        for name in LITERAL_READ.findall(path.read_text(encoding="utf-8")):
            found.setdefault(name, set()).add(path.relative_to(ROOT).as_posix())
    return found


def test_the_package_reads_every_variable_through_the_env_module() -> None:
    names, problems = package_reads()
    assert problems == []
    # The scan sees the reads it must (so an empty scan cannot pass).
    assert {_env.NATIVE_LIB, _env.TRITON_INTERPRET} <= names


def test_the_kernels_and_the_build_read_only_names_of_the_env_module() -> None:
    found = literal_reads()
    assert {_env.NATIVE_ISA, _env.NATIVE_OWN_POOL, _env.SKIP_NATIVE} <= set(found), found
    unknown = {n: sorted(f) for n, f in found.items() if n not in defined().values()}
    assert unknown == {}, f"add these to {ENV_MODULE}: {unknown}"


def test_every_name_of_the_env_module_is_read() -> None:
    names, _ = package_reads()
    read = names | set(literal_reads())
    stale = sorted(set(defined().values()) - read)
    assert stale == [], f"{ENV_MODULE} names variables nothing reads: {stale}"


def test_the_env_module_exports_its_names() -> None:
    assert _env.__all__ == sorted(defined())
    assert len(set(defined().values())) == len(defined())  # one constant per variable


def test_the_docs_page_lists_exactly_the_variables_read() -> None:
    text = PAGE.read_text(encoding="utf-8")
    listed = PAGE_ROW.findall(text.split("\n## ")[1])  # the first section's table
    assert sorted(listed) == sorted(defined().values())
    assert "environment.md" in (ROOT / "mkdocs.yml").read_text(encoding="utf-8")


def test_the_scan_refuses_literal_and_unknown_names() -> None:
    source = (
        "import os\n"
        "from attn_dispatch._env import NATIVE_LIB\n"
        "from attn_dispatch import _env as e\n"
        "ALIAS = NATIVE_LIB\n"
        "LITERAL = 'SOMETHING'\n"
        "a = os.environ.get(ALIAS)\n"
        "b = os.getenv(e.TRITON_INTERPRET)\n"
        "c = os.environ['HOME']\n"
        "d = 'X' in os.environ\n"
        "f = os.environ.get(LITERAL, '')\n"
    )
    names, problems = env_reads(source, "planted.py")
    assert names == {_env.NATIVE_LIB, _env.TRITON_INTERPRET}
    assert [p.split(": reads")[0] for p in problems] == [
        "planted.py:8",
        "planted.py:9",
        "planted.py:10",
    ]
    assert LITERAL_READ.findall('std::getenv("NATIVE_ATTN_ISA"); os.environ.get("Y")') == [
        "NATIVE_ATTN_ISA",
        "Y",
    ]
