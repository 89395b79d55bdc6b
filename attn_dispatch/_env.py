"""The environment variables attn_dispatch reads, each named once (docs/environment.md).

Every read in the package goes through these constants: ``tests/core/test_env.py`` fails on a
read whose name is a literal or is missing here, on a name here that nothing reads, and on a
name the docs page does not list. Four names are read by the C++ kernels (``csrc/``) and one by
the build (``setup.py``, which runs before the package can be imported); they are listed here
too, so that one module holds them all, and the test checks those sources against it.
"""

from __future__ import annotations

__all__ = [
    "HYPOTHESIS_PROFILE",
    "NATIVE_ISA",
    "NATIVE_LIB",
    "NATIVE_NO_VBMI",
    "NATIVE_OWN_POOL",
    "NATIVE_ROWS_MIN",
    "PLUGINS",
    "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
    "SGLANG_SPECS",
    "SKIP_NATIVE",
    "TRITON_INTERPRET",
]

#: A path: the native backend loads this shared library instead of the one built next to the
#: package (development, or tests of the "not built" path). Read by ``backends/native/_lib.py``.
NATIVE_LIB = "ATTN_DISPATCH_NATIVE_LIB"

#: Which ``attn_dispatch.backends`` entry points load, as ``VLLM_PLUGINS`` in vLLM: unset, all;
#: ``"a,b"``, only those entry-point names; empty or ``none``, none. Read by ``_registry.py``
#: when a registry first loads its plugins.
PLUGINS = "ATTN_DISPATCH_PLUGINS"

#: Set (to anything non-empty) while building: skip the native kernels; the backend then
#: reports "not built: ..." at bind. Read by ``setup.py``.
SKIP_NATIVE = "ATTN_DISPATCH_SKIP_NATIVE"

#: ``amx``, ``avx512bf16``, ``avx512``, ``avx2`` or ``generic``: pins the native kernels' ISA path
#: (tests, comparisons); a name this CPU cannot run is ignored. ``amx`` is never chosen unless
#: pinned. Read once by the C++ kernels.
NATIVE_ISA = "NATIVE_ATTN_ISA"

#: Set (to anything): the native kernels use their own thread pool even where torch's OpenMP
#: runtime is loaded. Read once by the C++ kernels.
NATIVE_OWN_POOL = "NATIVE_ATTN_OWN_POOL"

#: Set (to anything): the avx512bf16 kernels widen FP8 cache rows without AVX-512 VBMI's byte
#: lookups even where the CPU has them (tests of the fallback, comparisons). Read once by the
#: C++ kernels.
NATIVE_NO_VBMI = "NATIVE_ATTN_NO_VBMI"

#: A positive integer: the rows per kv head from which a native work item takes the many-row
#: tile kernel (``csrc/rows_path.h``) instead of the measured default (tests force it on every
#: item with ``1`` and off with a huge value; comparisons). Read once by the C++ kernels.
NATIVE_ROWS_MIN = "NATIVE_ATTN_ROWS_MIN"

#: ``1``/``true``/``yes``/``on``: triton's CPU interpreter is on, so the triton backend may bind
#: on a CPU (tests). triton's own variable; the triton backend reads it at bind.
TRITON_INTERPRET = "TRITON_INTERPRET"

#: JSON ``{"target": spec, "draft": spec, ...}``: the runners' specs of an SGLang engine whose
#: attention backend is ``"attn_dispatch"`` (SGLang's arguments carry names only); set before
#: the engine starts, its scheduler subprocess inherits it. Read by
#: ``integrations/sglang_engine`` when SGLang builds that backend.
SGLANG_SPECS = "ATTN_DISPATCH_SGLANG"

#: ``thorough``: the contract kit's properties draw ten times as many examples (hypothesis's
#: own profile variable, also read by this repository's tests/conftest.py). Read by
#: ``testing/contract/harness.py``.
HYPOTHESIS_PROFILE = "HYPOTHESIS_PROFILE"

#: pytest's own switch: set, pytest loads no ``pytest11`` plugin by itself, so the contract
#: kit's ``run()`` passes its plugin explicitly. Read by ``testing/contract/__init__.py``.
PYTEST_DISABLE_PLUGIN_AUTOLOAD = "PYTEST_DISABLE_PLUGIN_AUTOLOAD"
