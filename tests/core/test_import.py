"""`import attn_dispatch` stays light, and the package has no import cycle.

Light: no heavy framework and nothing outside the standard library is imported by
``import attn_dispatch`` (and the registry's first use), and no backend's heavy module. The
import time is measured and printed (run with -s), never asserted: timing depends on the
machine; what is asserted is what is imported, which does not.

No cycle: a static graph of every ``import`` statement in the package (function-level ones
included, since a lazy import inside a function is how the old bind() -> compile -> _scope ->
_binding cycle hid; ``if TYPE_CHECKING:`` blocks excluded) must be acyclic, and every
torch-free module must import on its own in a fresh interpreter.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.imports import imports_of
from tests.imports import modules
from tests.imports import path_imports

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "attn_dispatch"
HEAVY = ("torch", "triton", "flashinfer", "transformers", "numpy")

PROBE = """
import json, sys, time
before = set(sys.modules)
t0 = time.perf_counter()
import attn_dispatch
import attn_dispatch.backend
t1 = time.perf_counter()
attn_dispatch.backend.list_backends()  # loads built-ins' light modules and plugins
t2 = time.perf_counter()
print(json.dumps({"import_ms": (t1 - t0) * 1e3, "registry_ms": (t2 - t1) * 1e3,
                  "modules": sorted(sys.modules), "new": sorted(set(sys.modules) - before),
                  "stdlib": sorted(sys.stdlib_module_names)}))
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )


def _probe() -> dict[str, object]:
    out = _run(PROBE)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def test_import_pulls_no_heavy_module() -> None:
    data = _probe()
    modules = set(data["modules"])  # type: ignore[arg-type]
    assert "attn_dispatch" in modules and "attn_dispatch._scope" in modules
    leaked = sorted(m for m in modules if m.split(".")[0] in HEAVY)
    assert leaked == [], f"import attn_dispatch (and list_backends) imported {leaked}"
    # No backend's heavy implementation module is imported before bind.
    assert not [
        m for m in modules if m.startswith("attn_dispatch.backends.") and m.endswith(".backend")
    ]


def test_import_loads_only_the_standard_library() -> None:
    # What `import attn_dispatch` (and the registry's first use) adds to sys.modules: only
    # standard-library modules and our own. A third-party import creeping into the core (a
    # cost no timing test catches reliably) fails here. The import time is printed.
    runs = [_probe() for _ in range(3)]
    stdlib = set(runs[0]["stdlib"])  # type: ignore[arg-type]
    new = runs[0]["new"]
    foreign = sorted(
        m
        for m in new  # type: ignore[attr-defined]
        if m.split(".")[0] not in stdlib and m.split(".")[0] != "attn_dispatch"
    )
    assert foreign == [], f"import attn_dispatch loaded non-stdlib modules: {foreign}"
    ours = [m for m in new if m.startswith("attn_dispatch")]  # type: ignore[attr-defined]
    assert "attn_dispatch.compile" not in ours and "attn_dispatch.cuda_graph" not in ours
    imp = sorted(float(r["import_ms"]) for r in runs)  # type: ignore[arg-type]
    reg = sorted(float(r["registry_ms"]) for r in runs)  # type: ignore[arg-type]
    print(
        f"\nimport attn_dispatch: median {imp[1]:.1f} ms (min {imp[0]:.1f}); "
        f"first list_backends(): median {reg[1]:.1f} ms; {len(new)} modules "  # type: ignore[arg-type]
        f"({len(ours)} of ours)"
    )


# -- the import graph ---------------------------------------------------------------------------


def _all_modules() -> dict[str, Path]:
    return modules(PACKAGE, ROOT)


def _imports(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """Our modules that ``path`` imports, anywhere in its body except TYPE_CHECKING blocks."""
    return {m for m in path_imports(path, name, set(known)) if m in known}


def _imports_with_annotations(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """``_imports`` with the ``if TYPE_CHECKING:`` blocks counted too (annotation edges)."""
    source = re.sub(r"^if TYPE_CHECKING:", "if True:", path.read_text(), flags=re.M)
    found = imports_of(source, name, path.name == "__init__.py", set(known))
    return {m for m in found if m in known}


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt) :], nxt]
            if nxt not in state:
                found = dfs(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = dfs(node)
            if found:
                return found
    return None


def test_the_cycle_finder_finds_cycles() -> None:
    # The checker itself can fail: a planted cycle is found, a DAG is not.
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_import_graph_has_no_cycle() -> None:
    modules = _all_modules()
    graph = {name: _imports(path, name, modules) for name, path in modules.items()}
    # Sanity: the graph sees the edges we know of (so an empty graph cannot pass).
    assert "attn_dispatch._route" in graph["attn_dispatch._scope"]
    assert "attn_dispatch._scope" in graph["attn_dispatch.compile"]
    assert "attn_dispatch._snapshot" in graph["attn_dispatch.cuda_graph"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_annotation_imports_have_no_cycle_either() -> None:
    # In the core (below the backends): the last one was _protocol naming Binding (in _route,
    # which imports _protocol) for the Runner protocol; Runner now lives beside Binding.
    outer = ("attn_dispatch.backends", "attn_dispatch.integrations", "attn_dispatch.cli",
             "attn_dispatch.demo")  # fmt: skip
    modules = {n: p for n, p in _all_modules().items() if not n.startswith(outer)}
    graph = {name: _imports_with_annotations(path, name, modules) for name, path in modules.items()}
    assert "attn_dispatch._config" in graph["attn_dispatch._capabilities"]  # a typing-only edge
    assert "attn_dispatch._route" not in graph["attn_dispatch._protocol"]
    cycle = _find_cycle(graph)
    assert cycle is None, "import cycle (annotations included): " + " -> ".join(cycle or [])


def test_bind_imports_neither_compile_nor_torch() -> None:
    # The old side effect: bind() imported attn_dispatch.compile when torch was loaded.
    out = _run(
        "import sys\n"
        "from attn_dispatch import AttnConfig, bind\n"
        "from attn_dispatch.backend import BackendBase, Capabilities, Registry\n"
        "class B(BackendBase):\n"
        "    name = 'b'\n"
        "    def __init__(self, config, **o): pass\n"
        "    def plan(self, batch): return None\n"
        "    def handler(self, phase): return lambda *a: None\n"
        "reg = Registry(builtins=False, plugins=False)\n"
        "reg.register('b', capabilities=Capabilities(kinds={'mha'}), factory=B)\n"
        "bind('b', AttnConfig('mha', 2, 2, 8, dtype='float32'), registry=reg)\n"
        "print(sorted(m for m in sys.modules if m in ('torch', 'attn_dispatch.compile')))\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"


TORCH_FREE = [
    name
    for name in _all_modules()
    if not any(
        part in name
        for part in (
            "compile",
            "cuda_graph",
            "_batch",
            "_contract",
            "_snapshot",
            "_tensor_checks",
            "mla",
            "demo",
            "integrations",
            ".backend",
            "triton._",
            "native._lib",
            "__main__",
        )
    )
]


def test_the_backend_surface_is_torch_free_until_a_torch_name_is_used() -> None:
    # attn_dispatch.backend is imported by every backend module and plugin: its torch-level
    # names (BatchSnapshot, TensorChecks, refill) load on first use, like AttnBatch.
    out = _run(
        "import sys\n"
        "import attn_dispatch.backend as b\n"
        "from attn_dispatch.backend import Capabilities, PlanBase, register_backend\n"
        "print('torch' in sys.modules)\n"
        "b.BatchSnapshot\n"
        "print('torch' in sys.modules)\n"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "True"]


@pytest.mark.parametrize("module", TORCH_FREE)
def test_each_core_module_imports_alone(module: str) -> None:
    # A fresh interpreter per module: an import-order dependency (a cycle that works only when
    # entered from the package) fails here.
    out = _run(f"import importlib; importlib.import_module({module!r}); print('ok')")
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
