"""The native kernels' C++ headers each compile alone, and the library's C ABI is checked at load.

Headers: every ``csrc/*.h`` is compiled on its own (``g++ -std=c++17 -fsyntax-only -x c++``)
with the instruction-set flags it needs, so no header depends on what another file happened to
include or define before it (issue 32: kernels_impl.h included bf16_path.h mid-namespace, and
bf16_path.h used names defined above that point).

ABI: ``NA_ABI_VERSION`` is defined once, in csrc/native_attn.h, and Python reads it from the
library; a library whose structs differ in size from the Python mirror is refused with
``BackendUnavailableError`` naming the struct and both sizes (checked in a child process that
edits the mirror before loading, so this process's loaded library is never touched).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CSRC = ROOT / "csrc"
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl"]
AVX512BF16 = [*AVX512, "-mavx512bf16"]
# The flag sets each header must compile under alone: every ISA build compiles the shared
# layers; bf16_path.h is the avx512bf16 unit's alone, amx_path.h the amx unit's (or the
# emulated tiles of its layout test).
ISA_FLAGS = {"generic": [], "avx2": AVX2, "avx512": AVX512, "avx512bf16": AVX512BF16}
OWN_FLAGS = {
    "amx": [*AVX512BF16, "-mamx-tile", "-mamx-bf16"],
    "amx-emulated": ["-DNA_AMX_EMULATE"],
}
NEEDS = {"bf16_path.h": ("avx512bf16",), "amx_path.h": ("amx", "amx-emulated")}
HEADERS = sorted(p.name for p in CSRC.glob("*.h"))
GXX = shutil.which("g++") or ""
X86 = os.uname().machine in ("x86_64", "amd64")


def _cases() -> list[tuple[str, str]]:
    cases = []
    for header in HEADERS:
        for isa in NEEDS.get(header, tuple(ISA_FLAGS)):
            cases.append((header, isa))
    return cases


def test_the_layered_headers_exist() -> None:
    # The split the test below relies on: a SIMD layer and a tile layer of their own.
    assert {"simd.h", "tile.h", "bf16_path.h", "kernels_impl.h"} <= set(HEADERS), HEADERS


@pytest.mark.skipif(not GXX, reason="g++ is not installed")
@pytest.mark.parametrize(("header", "isa"), _cases())
def test_header_compiles_alone(header: str, isa: str) -> None:
    flags = {**ISA_FLAGS, **OWN_FLAGS}[isa]
    if any(f.startswith("-m") for f in flags) and not X86:
        pytest.skip(f"{isa} flags are x86-64 only (this machine: {os.uname().machine})")
    cmd = [GXX, "-std=c++17", "-fsyntax-only", "-Wall", "-Wno-psabi", *flags]
    cmd += ["-I", str(CSRC), "-x", "c++", str(CSRC / header)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{header} ({isa}) does not compile alone:\n{done.stderr[-3000:]}"
    assert "warning" not in done.stderr, done.stderr[-3000:]


@pytest.mark.skipif(not GXX, reason="g++ is not installed")
def test_isa_paths_refuse_a_unit_without_their_flags() -> None:
    # Included where the avx512bf16 intrinsics are missing, it says so instead of failing
    # somewhere inside the intrinsics.
    cmd = [GXX, "-std=c++17", "-fsyntax-only", "-I", str(CSRC), "-x", "c++"]
    done = subprocess.run([*cmd, str(CSRC / "bf16_path.h")], capture_output=True, text=True)
    assert done.returncode != 0
    assert "bf16_path.h needs -mavx512bf16" in done.stderr
    done = subprocess.run([*cmd, str(CSRC / "amx_path.h")], capture_output=True, text=True)
    assert done.returncode != 0
    assert "amx_path.h needs -mamx-tile -mamx-bf16" in done.stderr


def test_abi_version_is_defined_once() -> None:
    header = (CSRC / "native_attn.h").read_text()
    assert len(re.findall(r"#define NA_ABI_VERSION (\d+)", header)) == 1
    # No second literal: the C++ returns the macro, and the Python side has no version number.
    cpp = (CSRC / "api.cpp").read_text()
    assert "return NA_ABI_VERSION;" in cpp
    lib_py = (ROOT / "attn_dispatch" / "backends" / "native" / "_lib.py").read_text()
    assert not re.search(r"ABI_VERSION\s*=\s*\d", lib_py)


torch = pytest.importorskip("torch")
from attn_dispatch.backends.native._lib import load  # noqa: E402

LIB = load()
needs_lib = pytest.mark.skipif(isinstance(LIB, str), reason=f"native library: {LIB}")


@needs_lib
def test_python_reads_the_version_from_the_library() -> None:
    assert not isinstance(LIB, str)
    header = (CSRC / "native_attn.h").read_text()
    (version,) = re.findall(r"#define NA_ABI_VERSION (\d+)", header)
    assert LIB.abi_version == int(version)


@needs_lib
def test_every_mirrored_struct_has_the_library_size() -> None:
    import ctypes

    from attn_dispatch.backends.native._lib import MIRRORED_STRUCTS
    from attn_dispatch.backends.native._lib import layout_mismatch

    assert not isinstance(LIB, str)
    assert layout_mismatch(LIB.cdll) is None
    for struct in MIRRORED_STRUCTS:
        assert LIB.cdll.na_struct_size(struct.__name__.encode()) == ctypes.sizeof(struct)
    assert LIB.cdll.na_struct_size(b"NoSuchStruct") == -1


# A child that edits one mirrored struct (one more field: 4 or 8 bytes longer) before the
# library is loaded, then asks for the backend: the load must be refused, naming the struct.
_MISMATCH = textwrap.dedent(
    """
    import ctypes, sys
    from attn_dispatch.backends.native import _lib
    name = sys.argv[1]
    old = getattr(_lib, name)
    fields = [*old._fields_, ("extra", ctypes.c_int64)]
    bigger = type(name, (ctypes.Structure,), {"_fields_": fields})
    setattr(_lib, name, bigger)
    _lib.MIRRORED_STRUCTS = tuple(bigger if s is old else s for s in _lib.MIRRORED_STRUCTS)
    from attn_dispatch import AttnConfig
    from attn_dispatch._errors import BackendUnavailableError
    from attn_dispatch.backends.native.backend import NativeBackend
    try:
        NativeBackend(AttnConfig("mha", 4, 2, 64, page_size=16))
    except BackendUnavailableError as exc:
        print("REFUSED", exc)
        print("SIZES", ctypes.sizeof(old), ctypes.sizeof(bigger))
    else:
        print("LOADED")
    """
)


@needs_lib
@pytest.mark.parametrize("struct", ["NaConfig", "NaError", "NaPlanInfo"])
def test_a_library_whose_struct_differs_is_refused(struct: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _MISMATCH, struct],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "REFUSED" in done.stdout, done.stdout
    old, new = re.search(r"SIZES (\d+) (\d+)", done.stdout).groups()  # type: ignore[union-attr]
    line = done.stdout.splitlines()[0]
    assert f"struct {struct}" in line, line
    assert f"library: has {old} bytes" in line and f"{new} bytes" in line, line
