"""The AMX tile path of the native kernels (csrc/amx_path.h, kern_amx.cpp; issue 42).

- Layout, on any CPU: the tile micro-kernels compiled with the tile instructions emulated in
  plain C++ (``NA_AMX_EMULATE``) match double-precision references for every shape the
  many-row path gives them (a C++ harness, amx_emulated.cpp, in a subprocess).
- Choice: "amx" is offered only where CPUID, XCR0 and Linux's permission request all say the
  tiles are usable, and it is never the default (it has not been measured faster yet);
  ``NATIVE_ATTN_ISA=amx`` elsewhere falls back to the best path.
- Answers, where the CPU has AMX: the contract suite's edge cases, the native reference
  comparisons and every many-row case (default threshold and forced on every item) on the
  amx path. Elsewhere that test is skipped, naming why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
GXX = shutil.which("g++") or ""


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


CPU_HAS_AMX = {"amx_tile", "amx_bf16", "avx512_bf16"} <= _cpu_flags()


@pytest.mark.skipif(not GXX, reason="g++ is not installed")
def test_tile_micro_kernels_on_emulated_tiles(tmp_path: Path) -> None:
    exe = tmp_path / "amx_emulated"
    cmd = [GXX, "-std=c++17", "-O1", "-Wall", "-Wextra", "-DNA_AMX_EMULATE", "-I", str(CSRC)]
    cmd += [str(Path(__file__).with_name("amx_emulated.cpp")), "-o", str(exe)]
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    assert "warning" not in built.stderr, built.stderr[-3000:]
    done = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "ran 176 failed 0", done.stdout[-3000:]


torch = pytest.importorskip("torch")
from attn_dispatch._env import NATIVE_ISA  # noqa: E402
from attn_dispatch._env import NATIVE_ROWS_MIN  # noqa: E402
from attn_dispatch.backends.native._lib import load  # noqa: E402

LIB = load()
needs_lib = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")


def _child(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """A child process with exactly this environment (plus this checkout on its path)."""
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**env, "PYTHONPATH": os.getcwd()},
        timeout=600,
        cwd=ROOT,
    )


_REPORT = (
    "from attn_dispatch.backends.native._lib import load\n"
    "lib = load()\n"
    "print('ISA', lib.isa)\n"
    "print('LIST', ','.join(lib.isa_list))\n"
)


def _report(env: dict[str, str]) -> tuple[str, list[str]]:
    done = _child(_REPORT, env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in done.stdout.splitlines() if " " in line)
    return lines["ISA"], lines["LIST"].split(",")


@needs_lib
def test_amx_is_offered_only_where_the_cpu_has_it_and_never_by_default() -> None:
    env = {k: v for k, v in os.environ.items() if k != NATIVE_ISA}
    default, offered = _report(env)
    assert default != "amx"
    if not CPU_HAS_AMX:
        assert "amx" not in offered, offered
    # Pinned where it cannot run: ignored, the default path runs (no SIGILL, no fault).
    pinned, _ = _report({**env, NATIVE_ISA: "amx"})
    assert pinned == ("amx" if "amx" in offered else default)
    assert not isinstance(LIB, str)
    if "amx" not in LIB.isa_list:
        with pytest.raises(ValueError, match="'amx' is not available"):
            LIB.set_isa("amx")


def _amx_skip_reason() -> str:
    if isinstance(LIB, str):
        return f"native library: {LIB}"
    if not CPU_HAS_AMX:
        return "this CPU has no AMX-BF16 tiles (/proc/cpuinfo: no amx_tile/amx_bf16/avx512_bf16)"
    return (
        "the CPU has AMX but the amx path is not offered: the compiler refused -mamx-tile "
        "(setup.py leaves kern_amx.cpp out) or Linux refused the tile data permission"
    )


needs_amx = pytest.mark.skipif(
    isinstance(LIB, str) or "amx" not in LIB.isa_list, reason=_amx_skip_reason()
)


@needs_amx
@pytest.mark.parametrize("rows_min", [None, "1"], ids=["default-threshold", "rows-forced"])
def test_contract_and_many_row_cases_on_the_amx_path(rows_min: str | None) -> None:
    env = {**os.environ, NATIVE_ISA: "amx"}
    env.pop(NATIVE_ROWS_MIN, None)
    if rows_min is not None:
        env[NATIVE_ROWS_MIN] = rows_min
    pinned, _ = _report(env)
    assert pinned == "amx"
    done = subprocess.run(
        [
            sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
            "tests/contract/test_contract.py::test_edge_cases",
            "tests/contract/test_contract.py::test_variant_edge_cases",
            "tests/backends/native/test_backend.py::test_matches_naive_reference",
            "tests/backends/native/test_backend.py::test_variants_match_naive_reference",
            "tests/backends/native/test_rows_path.py::test_many_row_cases_on_every_isa",
            "-k", "(native or not contract) and (amx or not every_isa)",
        ],
        capture_output=True, text=True, cwd=ROOT, timeout=900,
        env={**env, "PYTHONPATH": os.getcwd()},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
