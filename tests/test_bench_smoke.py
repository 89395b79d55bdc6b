"""The bench/ scripts stay importable and runnable: each imports, and runs with ``--quick``.

A benchmark nobody runs rots quietly (bench/safety_checks.py once imported a function the
library had dropped). Every ``bench/*.py`` is imported in one child process, and each runs
its ``--quick`` size in a child of its own (a few seconds on a quiet machine; the figures of a
quick run are not comparable and no results file is written). A script whose hardware or
package is missing here is skipped with the reason, after its ``--help`` shows ``--quick``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _cuda() -> str | None:
    import torch

    return None if torch.cuda.is_available() else "needs a CUDA device"


def _module(name: str) -> Callable[[], str | None]:
    def check() -> str | None:
        return None if importlib.util.find_spec(name) is not None else f"needs {name} installed"

    return check


def _native() -> str | None:
    from attn_dispatch.backends.native._lib import load

    lib = load()
    return f"needs the native library ({lib})" if isinstance(lib, str) else None


#: Every script, and what its quick run needs beyond the dev install (None: nothing).
NEEDS: dict[str, Callable[[], str | None] | None] = {
    "cascade_cpu.py": _native,
    "compile_overhead.py": None,
    "dispatch.py": None,
    "gpu_flashinfer.py": lambda: _cuda() or _module("flashinfer")(),
    "gpu_graphs.py": None,  # without CUDA it runs the same code on the CPU (no graph)
    "gpu_sdpa.py": None,  # without CUDA its quick run is --dry-run on the CPU
    # Without CUDA its --dry-run runs the kernels under triton's interpreter: minutes, not a
    # smoke run (tests/backends/triton runs that path).
    "gpu_triton.py": lambda: _cuda() or _module("triton")(),
    "kernels_cpu.py": _native,
    "native_concurrency.py": _native,
    "native_probe.py": _native,
    "safety_checks.py": None,
    "sdpa_cpu.py": None,
    "tables.py": None,
    "transformers_cpu.py": lambda: _native() or _module("transformers")(),
    "transformers_out_buffer.py": lambda: _native() or _module("transformers")(),
    "variants_cpu.py": None,
    "vllm_cpu.py": lambda: _native() or _module("vllm")(),
    "vllm_step_cost.py": lambda: _native() or _module("vllm")(),
}
SCRIPTS = sorted(p.name for p in BENCH.glob("*.py"))


def _bench_module(file: str) -> Any:
    """``bench/<file>`` as a module (registered in sys.modules, where dataclasses look their
    module up), the environment it sets as it loads (vllm_cpu.py: vLLM's) undone."""
    name = "bench_" + file.removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, BENCH / file)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    saved = dict(os.environ)
    try:
        spec.loader.exec_module(module)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return module


def _env() -> dict[str, str]:
    # The worktree first (pytest's pythonpath "." does the same for this process).
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }


def test_every_script_is_listed() -> None:
    """A new bench script must say here what its quick run needs."""
    assert SCRIPTS == sorted(NEEDS), f"bench/*.py {SCRIPTS} vs the table {sorted(NEEDS)}"


def test_every_script_imports() -> None:
    """Each script imports as a module (its ``main`` does not run) in one child process."""
    code = (
        "import importlib.util, sys\n"
        "for path in sys.argv[1:]:\n"
        "    name = 'bench_' + path.rsplit('/', 1)[-1][:-3]\n"
        "    spec = importlib.util.spec_from_file_location(name, path)\n"
        "    module = importlib.util.module_from_spec(spec)\n"
        "    sys.modules[name] = module  # dataclasses look their module up there\n"
        "    spec.loader.exec_module(module)\n"
        "    assert callable(getattr(module, 'main', None)), path\n"
        "    print('imported', path)\n"
    )
    paths = [str(BENCH / s) for s in SCRIPTS]
    child = subprocess.run(
        [sys.executable, "-c", code, *paths], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    assert child.stdout.count("imported ") == len(SCRIPTS), child.stdout


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_gpu_script_parses() -> None:
    """bench/gpu.sh (the one prepared CUDA check) is at least valid bash here."""
    child = subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr


@pytest.mark.parametrize("script", SCRIPTS)
def test_quick_run(script: str) -> None:
    need = NEEDS.get(script)
    why = need() if need is not None else None
    path = str(BENCH / script)
    if why is not None:
        helped = subprocess.run(
            [sys.executable, path, "--help"], cwd=ROOT, env=_env(), capture_output=True,
            text=True, timeout=300,
        )  # fmt: skip
        assert helped.returncode == 0 and "--quick" in helped.stdout, helped.stderr[-2000:]
        pytest.skip(f"bench/{script}: {why} (its --help lists --quick)")
    child = subprocess.run(
        [sys.executable, path, "--quick"], cwd=ROOT, env=_env(), capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, (child.stdout[-2000:], child.stderr[-3000:])
    assert child.stdout.strip(), f"bench/{script} --quick printed nothing"


def test_kernels_quick_run_times_the_cached_work() -> None:
    """bench/kernels_cpu.py's quick run includes ``--in-cache`` (its columns are printed),
    and the cached batch describes the same work as the row's: the same lengths, over pages
    0 and 1 only."""
    why = _native()
    if why is not None:
        pytest.skip(f"bench/kernels_cpu.py: {why}")
    module = _bench_module("kernels_cpu.py")
    tree = next(w for w in module.WORKLOADS if w.parents is not None and w.batch == 8)
    small = module.Workload(
        "tree", "mha", tree.phase, 4, 2, 16, 16, 3, 200, 8, parents=tree.parents
    )
    case = module.make_case(small)
    cached = module.cached_batch(case)
    for name in ("qo_indptr", "kv_indptr", "kv_lens", "custom_mask", "mask_indptr"):
        assert getattr(cached, name).tolist() == getattr(case.batch, name).tolist(), name
    assert set(cached.kv_indices.tolist()) == {0, 1}
    assert case.batch.kv_indices.unique().numel() == case.batch.kv_indices.numel() > 2
    child = subprocess.run(
        [sys.executable, str(BENCH / "kernels_cpu.py"), "--quick"], cwd=ROOT, env=_env(),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    header = next(line for line in child.stdout.splitlines() if line.startswith("workload"))
    assert header.split()[-3:] == ["cached", "cached", "roof"], header


def test_cascade_floor_counts_each_part_at_its_roof() -> None:
    """bench/cascade_cpu.py's floor: the shared part's multiply-adds at the GEMM peak plus the
    own part's K/V bytes at the read bandwidth (issue 42's 3x judged against it)."""
    module = _bench_module("cascade_cpu.py")  # it puts bench/ on sys.path for kernels_cpu
    # B16, 3584 shared + 512 own, GQA 32/8 x 128 at 200 GFMA/s and 32 GB/s: the shared
    # part is 16 x 3584 x 32 x 128 x 2 = 469.8 M multiply-adds (2.349 ms), the own part
    # 16 x 512 x 8 x 128 x 2 bytes x 2 (K, V) = 33.55 MB (1.049 ms).
    shared_s, own_s = module.cascade_floor(16, 3584, 512, (32, 8), 128, 32.0, 200.0)
    assert shared_s == pytest.approx(16 * 3584 * 32 * 128 * 2 / 200e9)
    assert own_s == pytest.approx(16 * 512 * 8 * 128 * 4 / 32e9)
    assert (round(shared_s * 1e3, 3), round(own_s * 1e3, 3)) == (2.349, 1.049)


def test_prefill_floor_counts_the_causal_pairs() -> None:
    """bench/vllm_cpu.py's prefill floor: each prompt's L(L+1)/2 query-key pairs, q.K^T and
    p.V over every query head, in every layer the row runs (the long model: 4 x 2048-token
    prompts, GQA 8/2 x 128)."""
    module = _bench_module("vllm_cpu.py")
    pairs = 2048 * 2049 // 2
    assert module.prefill_macs("long", 4) == 4 * pairs * 8 * 128 * 2 * 4
    assert module.prefill_macs("long", 5) == module.prefill_macs("long", 4) * 5 // 4
    assert module.prefill_macs("tiny", 1) == 8 * (128 * 129 // 2) * 4 * 64 * 2


def test_paired_ratios_compare_the_engines_within_each_round() -> None:
    """bench/vllm_cpu.py's per-round column: the reference's time over the contender's in the
    same round, its median and range; a slow round slows both sides and leaves the ratio."""
    module = _bench_module("vllm_cpu.py")
    # Round 2 runs 1.5x slower for both: best-of would give 2.0 / 2.0 = 1.0, per round 1.0, 1.0,
    # 0.8 (the third round's contender slower).
    mid, low, high = module.paired_ratios([2.0, 3.0, 2.4], [2.0, 3.0, 3.0])
    assert (mid, low, high) == pytest.approx((1.0, 0.8, 1.0))
    assert module.paired_ratios([1.0, 4.0], [2.0, 2.0]) == pytest.approx((1.25, 0.5, 2.0))
    with pytest.raises(ValueError):  # rounds that do not pair up are a bug, not a figure
        module.paired_ratios([1.0, 2.0], [1.0])


def test_cascade_refuses_a_target_at_or_below_zero() -> None:
    """bench/cascade_cpu.py's floor line divides by --target: 0 is refused by name, before any
    work."""
    child = subprocess.run(
        [sys.executable, str(BENCH / "cascade_cpu.py"), "--quick", "--target", "0"], cwd=ROOT,
        env=_env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert child.returncode == 1
    assert "--target must be a speed-up above 0, got 0.0" in child.stderr
