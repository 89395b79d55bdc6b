"""Build of the native CPU kernels (csrc/) for the ``native`` backend.

The metadata lives in pyproject.toml; this file only adds the C++ library. It is a plain C ABI
shared object loaded with ctypes, so the build needs a C++17 compiler and nothing else: no
torch headers, no download. Each ``csrc/kern_<isa>.cpp`` is compiled with its own
instruction-set flags and the library picks the fastest at run time, so one build runs on any
x86-64 (and builds on aarch64 with the portable path only).

A missing or failing compiler does not fail the install: the error is printed as a warning and
saved to ``_native_attn.build-error.txt``, and the backend then reports "not built: <why>".

    pip install .                       # or pip install -e .
    python setup.py build_ext --inplace # development build next to the sources
"""

from __future__ import annotations

import os
import platform
import sys
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from setuptools import Extension
from setuptools import setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = "csrc"
PACKAGE_DIR = Path("attn_dispatch", "backends", "native")
ERROR_FILE = "_native_attn.build-error.txt"

COMMON_FLAGS = [
    "-std=c++17",
    "-O3",
    "-fPIC",
    "-fvisibility=hidden",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-Wall",
    "-Wno-psabi",  # vector-extension types in static inline helpers; no ABI crosses files
]
AVX2 = ["-mavx2", "-mfma", "-mf16c"]
AVX512 = [*AVX2, "-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-Wno-maybe-uninitialized"]
AVX512BF16 = [*AVX512, "-mavx512bf16"]
AMX = [*AVX512BF16, "-mamx-tile", "-mamx-bf16"]
# Units a compiler may refuse (too old for their flags): built when it takes them, with the
# define the rest of the library then compiles with; left out otherwise (that path is then
# not offered at run time). The AMX unit needs GCC >= 11 or Clang >= 12.
OPTIONAL_UNITS = {f"{CSRC}/kern_amx.cpp": "NA_HAVE_AMX_UNIT"}


def _sources() -> list[tuple[str, list[str]]]:
    """(source, extra flags) per translation unit for this machine's architecture."""
    units = [(f"{CSRC}/{name}.cpp", []) for name in ("api", "plan", "pool", "isa", "kern_generic")]
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        units += [
            (f"{CSRC}/kern_avx2.cpp", AVX2),
            (f"{CSRC}/kern_avx512.cpp", AVX512),
            # GCC 12 warns about its own _mm512_undefined_* helpers: a known false positive.
            (f"{CSRC}/kern_avx512bf16.cpp", [*AVX512BF16, "-Wno-maybe-uninitialized"]),
            (f"{CSRC}/kern_amx.cpp", [*AMX, "-Wno-maybe-uninitialized"]),
        ]
    return units


class BuildNative(build_ext):
    """Compiles each unit with its own flags; turns every build failure into a warning."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, unusable toolchain, ...
            self._record_failure(exc)

    def build_extension(self, ext: Extension) -> None:
        try:
            self._build_native(ext)
        except Exception as exc:
            self._record_failure(exc, ext)
        else:
            error_file = Path(self.get_ext_fullpath(ext.name)).parent / ERROR_FILE
            if error_file.exists():
                error_file.unlink()

    def _build_native(self, ext: Extension) -> None:
        if os.environ.get("ATTN_DISPATCH_SKIP_NATIVE"):
            raise RuntimeError("ATTN_DISPATCH_SKIP_NATIVE is set")
        if sys.platform == "win32":
            raise RuntimeError("the native kernels build with GCC or Clang only")
        output = Path(self.get_ext_fullpath(ext.name))
        output.parent.mkdir(parents=True, exist_ok=True)
        objects: list[str] = []
        units = _sources()
        defines: list[str] = []
        for source, flags in units:  # the optional units first: the others need their defines
            if source not in OPTIONAL_UNITS:
                continue
            try:
                objects += self._compile(source, flags)
            except Exception as exc:
                self.warn(f"attn_dispatch: {source} not built (that path is left out): {exc}")
            else:
                defines.append(f"-D{OPTIONAL_UNITS[source]}=1")
        # The other units in parallel (one compiler process per core): the build is most of a
        # fresh install's time, and each unit compiles on its own.
        rest = [
            (source, [*flags, *defines]) for source, flags in units if source not in OPTIONAL_UNITS
        ]
        Path(self.build_temp, CSRC).mkdir(parents=True, exist_ok=True)
        workers = max(1, min(len(rest), os.cpu_count() or 1))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for unit_objects in pool.map(lambda unit: self._compile(*unit), rest):
                objects += unit_objects
        self.compiler.link_shared_object(
            objects,
            str(output),
            extra_postargs=["-pthread", "-ldl"],  # dlopen: finding torch's OpenMP runtime
            target_lang="c++",
        )

    def _compile(self, source: str, flags: list[str]) -> list[str]:
        objects: list[str] = self.compiler.compile(
            [source],
            output_dir=self.build_temp,
            include_dirs=[CSRC],
            extra_postargs=[*COMMON_FLAGS, *flags],
            depends=[str(p) for p in Path(CSRC).glob("*.h")],
        )
        return objects

    def _record_failure(self, exc: BaseException, ext: Extension | None = None) -> None:
        reason = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
        self.warn(
            "attn_dispatch: the native CPU kernels were not built; the 'native' backend will "
            f"report 'not built'. Reason: {reason}"
        )
        if ext is not None:
            target = Path(self.get_ext_fullpath(ext.name)).parent
        else:
            target = Path(self.build_lib if not self.inplace else ".") / PACKAGE_DIR
        try:
            target.mkdir(parents=True, exist_ok=True)
            (target / ERROR_FILE).write_text(reason + "\n\n" + traceback.format_exc())
        except OSError:
            pass


setup(
    ext_modules=[
        # Not a Python module: a shared library with a C ABI, named like an extension so
        # build_ext places it in the package (and --inplace next to the sources).
        Extension("attn_dispatch.backends.native._native_attn", sources=[], language="c++")
    ],
    cmdclass={"build_ext": BuildNative},
)
