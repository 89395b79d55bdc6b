"""Finding and loading the compiled kernel library with ctypes (stdlib only, no torch).

The library is a plain C ABI shared object built by ``setup.py`` next to this file
(``_native_attn<EXT_SUFFIX>``). When the build failed, ``setup.py`` leaves the reason in
``_native_attn.build-error.txt`` and the backend reports "not built: <why>".

The ABI version is defined once, ``NA_ABI_VERSION`` in ``csrc/native_attn.h``; Python reads it
from the library (``NativeLibrary.abi_version``). What keeps the mirror honest is the layout
check at load: each struct mirrored here is compared by size with the library's own
``sizeof`` (``na_struct_size``), and a library that differs, or predates the check, is refused
with the struct named and both sizes, never called. The return codes and error fields are
mirrored as enums (``NaStatus``, ``NaField``) and compared with the library's own list
(``na_codes``) at load the same way.
"""

from __future__ import annotations

import ctypes
import dataclasses
import enum
import importlib.machinery
import os
import struct as _struct
import threading
from pathlib import Path
from typing import Any

from attn_dispatch._env import NATIVE_LIB

HERE = Path(__file__).resolve().parent
LIB_STEM = "_native_attn"
BUILD_ERROR_FILE = HERE / f"{LIB_STEM}.build-error.txt"
# Points the loader at another library file (development, or tests of the "not built" path).
ENV_LIBRARY = NATIVE_LIB


class NaConfig(ctypes.Structure):
    _fields_ = [
        *(
            (n, ctypes.c_int32)
            for n in (
                "kind", "q_dtype", "kv_dtype", "num_q_heads", "num_kv_heads", "head_dim",
                "v_head_dim", "page_size", "window_left",
            )
        ),
        ("logit_cap", ctypes.c_float),
        ("causal", ctypes.c_int32),
        ("chunk_size", ctypes.c_int32),
        ("cascade", ctypes.c_int32),
    ]  # fmt: skip


class NaError(ctypes.Structure):
    _fields_ = [
        ("field", ctypes.c_int32),
        ("request", ctypes.c_int32),
        ("a", ctypes.c_int64),
        ("b", ctypes.c_int64),
    ]


class NaPlanInfo(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_int64)
        for n in (
            "num_tokens", "num_requests", "max_page", "num_items", "num_merges", "scratch_rows",
            "cascade_groups", "cascade_requests", "cascade_keys",
        )
    ]  # fmt: skip


class NaPlanArgs(ctypes.Structure):
    _fields_ = [
        ("num_requests", ctypes.c_int32),
        ("decode", ctypes.c_int32),
        ("split_target", ctypes.c_int32),
        ("reserved", ctypes.c_int32),
        ("qo_indptr", ctypes.c_void_p),
        ("kv_indptr", ctypes.c_void_p),
        ("kv_indices", ctypes.c_void_p),
        ("num_indices", ctypes.c_int64),
        ("kv_lens", ctypes.c_void_p),
        ("mask", ctypes.c_void_p),
        ("mask_len", ctypes.c_int64),
    ]


def _described(name: str, rank: int) -> list[tuple[str, Any]]:
    """The ``<name>_shape`` and ``<name>_stride`` fields of a tensor of ``rank`` dims, as the
    C argument structs describe every tensor (torch's sizes and strides, in elements)."""
    return [(f"{name}_shape", ctypes.c_int64 * rank), (f"{name}_stride", ctypes.c_int64 * rank)]


class NaRunArgs(ctypes.Structure):
    """One layer call: each tensor described as torch holds it (data, shape, strides, dtype
    code), checked against the config and the plan inside ``na_run`` (csrc/native_attn.h)."""

    _fields_ = [
        *((n, ctypes.c_void_p) for n in ("q", "k", "v", "out", "sinks", "lse")),
        *_described("q", 3),
        *_described("k", 4),
        *_described("v", 4),
        *((n, ctypes.c_int64) for n in ("out_numel", "sinks_numel", "lse_numel")),
        *((n, ctypes.c_int32) for n in ("q_dtype", "k_dtype", "v_dtype", "host")),
        *((n, ctypes.c_float) for n in ("sm_scale", "k_scale", "v_scale")),
        ("num_threads", ctypes.c_int32),
    ]


class NaKvWriteArgs(ctypes.Structure):
    """One KV cache write (``na_kv_write``): key and value rows at their slots, each tensor
    described as torch holds it, checked inside the call before any write
    (csrc/native_attn.h)."""

    _fields_ = [
        # Per call: the tokens' rows and their slots.
        *((n, ctypes.c_void_p) for n in ("key", "value", "slots")),
        *_described("key", 3),
        *_described("value", 3),
        *((n, ctypes.c_int64) for n in ("num_slots", "slots_stride")),
        *((n, ctypes.c_int32) for n in ("key_dtype", "value_dtype", "host", "reserved")),
        # The caches (packed once per cache by ``kv_write.KvCaches``).
        *((n, ctypes.c_void_p) for n in ("k_cache", "v_cache")),
        *_described("k", 4),
        *_described("v", 4),
        ("page_step", ctypes.c_int64),
        *((n, ctypes.c_int32) for n in ("k_dtype", "v_dtype", "cache_host", "reserved2")),
    ]


class NaStepArgs(ctypes.Structure):
    """One serving step's tensors for ``na_step_index`` (csrc/native_attn.h): vLLM's query
    offsets, sequence lengths and block table, each described as torch holds it."""

    _fields_ = [
        *((n, ctypes.c_void_p) for n in ("query_start_loc", "seq_lens", "block_table", "out")),
        *((n, ctypes.c_int64) for n in ("qsl_numel", "qsl_stride", "seq_numel", "seq_stride")),
        *_described("bt", 2),
        *((n, ctypes.c_int64) for n in ("block_size", "out_capacity")),
        *((n, ctypes.c_int32) for n in ("qsl_dtype", "seq_dtype", "bt_dtype", "host")),
    ]


class NaStepInfo(ctypes.Structure):
    """What ``na_step_index`` found in a step (csrc/native_attn.h)."""

    _fields_ = [
        (n, ctypes.c_int64)
        for n in (
            "num_requests", "first_token", "num_tokens", "min_q", "max_q", "max_kv",
            "min_cached", "num_pages", "out_used",
        )
    ]  # fmt: skip


def _packed(struct_type: type[ctypes.Structure]) -> _struct.Struct:
    """A ``struct.Struct`` with ``struct_type``'s C layout (native alignment), one value per
    scalar field and per array element, in field order: packing the values of one call is a
    single C call, and ``na_run`` reads the packed bytes as the struct."""
    codes: dict[Any, str] = {
        ctypes.c_void_p: "P", ctypes.c_int64: "q", ctypes.c_int32: "i", ctypes.c_float: "f",
    }  # fmt: skip
    fmt = "@"
    for field in struct_type._fields_:
        ctype: Any = field[1]
        if issubclass(ctype, ctypes.Array):
            fmt += f"{ctype._length_}{codes[ctype._type_]}"
        else:
            fmt += codes[ctype]
    packed = _struct.Struct(fmt)
    if packed.size != ctypes.sizeof(struct_type):  # a field type the table above lacks
        raise AssertionError(f"{struct_type.__name__}: packed {packed.size} bytes, C layout "
                             f"{ctypes.sizeof(struct_type)}")  # fmt: skip
    return packed


#: ``NaRunArgs`` as packed bytes (``RUN_ARGS.pack(...)``): what the backend passes per call
#: (pointers as ints, 0 for NULL). A test holds it equal to the ctypes struct, field by field.
RUN_ARGS = _packed(NaRunArgs)
#: ``NaKvWriteArgs`` as packed bytes (``KV_WRITE_ARGS.pack(...)``), what ``na_kv_write`` reads.
KV_WRITE_ARGS = _packed(NaKvWriteArgs)
#: ``NaStepArgs`` as packed bytes (``STEP_ARGS.pack(...)``), what ``na_step_index`` reads.
STEP_ARGS = _packed(NaStepArgs)


class NaStatus(enum.IntEnum):
    """The entry points' return codes: csrc/native_attn.h ``NA_RETURN_CODES`` (``NA_<name>``).

    Compared with the library's own list (``na_codes``) at load, both ways: a library with a
    code this mirror lacks, or a different value, is refused like a struct of another size.
    """

    OK = 0
    BAD_ARGS = -1  # a tensor that does not fit the config or the plan
    NO_MEMORY = -2  # a per-thread buffer or the plan could not be allocated
    UNKNOWN_PLAN = -3  # never issued, or freed
    FOREIGN_PLAN = -4  # a live plan of another runner
    UNKNOWN_RUNNER = -5  # never created, or freed
    BAD_CONFIG = -6  # na_runner_create refused the config
    BAD_THREADS = -7  # na_run: num_threads < 1
    SHORT_BUFFER = -8  # na_step_index: the out buffer holds fewer than info.out_used


class NaField(enum.IntEnum):
    """Why ``na_plan_create`` refused a batch: csrc/native_attn.h ``NA_ERROR_FIELDS``
    (``NA_E_<name>``), checked against the library at load like ``NaStatus``."""

    NONE = 0
    CONFIG = 1  # the NaPlanArgs themselves (a NULL array, a negative count)
    QO_INDPTR = 2
    KV_INDPTR = 3
    KV_LENS = 4
    KV_INDICES = 5
    DECODE_QLEN = 6
    MASK = 7
    TOO_LARGE = 8
    NO_MEMORY = 9
    INTERNAL = 10  # the planner's own invariant failed (a bug, never the input)


def mirrored_codes() -> dict[str, int]:
    """``{"NA_OK": 0, ..., "NA_E_NONE": 0, ...}``: what this mirror expects ``na_codes`` to list."""
    codes = {f"NA_{m.name}": int(m) for m in NaStatus}
    codes.update({f"NA_E_{m.name}": int(m) for m in NaField})
    return codes


#: The structs mirrored from csrc/native_attn.h, checked by size against the library at load.
MIRRORED_STRUCTS: tuple[type[ctypes.Structure], ...] = (
    NaConfig, NaError, NaPlanInfo, NaPlanArgs, NaRunArgs, NaKvWriteArgs, NaStepArgs,
    NaStepInfo,
)  # fmt: skip


@dataclasses.dataclass(frozen=True, slots=True)
class NativeLibrary:
    """The loaded library with typed entry points."""

    path: Path
    cdll: ctypes.CDLL
    #: NA_ABI_VERSION of the header the library was built from (read from the library).
    abi_version: int

    @property
    def isa(self) -> str:
        """The instruction-set path in use ("amx", "avx512bf16", "avx512", "avx2", "generic")."""
        return bytes(self.cdll.na_isa()).decode()

    @property
    def isa_list(self) -> tuple[str, ...]:
        """Every path this CPU and build can run, fastest first."""
        return tuple(bytes(self.cdll.na_isa_list()).decode().split(","))

    def set_isa(self, name: str) -> None:
        """Pin an instruction-set path for the whole process (tests and comparisons)."""
        if self.cdll.na_set_isa(name.encode()) != 0:
            raise ValueError(
                f"instruction-set path {name!r} is not available here "
                f"(available: {', '.join(repr(n) for n in self.isa_list)})"
            )


def library_candidates(directory: Path = HERE) -> list[Path]:
    """Library files this package may hold, the running interpreter's own suffix first."""
    found = []
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"{LIB_STEM}{suffix}"
        if path.is_file():
            found.append(path)
    return found


_lock = threading.Lock()
# The process that imported this module: a library first loaded in another one (a forked
# child) is told to keep off OpenMP teams (see _load).
_IMPORT_PID = os.getpid()
_cache: dict[str, NativeLibrary | str] = {}


def _declare(cdll: ctypes.CDLL) -> None:
    c_i32, c_i64 = ctypes.c_int32, ctypes.c_int64
    cdll.na_abi_version.restype = c_i32
    cdll.na_abi_version.argtypes = []
    cdll.na_struct_size.restype = c_i64
    cdll.na_struct_size.argtypes = [ctypes.c_char_p]
    cdll.na_isa.restype = ctypes.c_char_p
    cdll.na_isa.argtypes = []
    cdll.na_isa_list.restype = ctypes.c_char_p
    cdll.na_isa_list.argtypes = []
    cdll.na_set_isa.restype = ctypes.c_int
    cdll.na_set_isa.argtypes = [ctypes.c_char_p]
    u64, u64p = ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint64)
    cdll.na_runner_create.restype = ctypes.c_int
    cdll.na_runner_create.argtypes = [ctypes.POINTER(NaConfig), u64p]
    cdll.na_runner_free.restype = None
    cdll.na_runner_free.argtypes = [u64]
    cdll.na_plan_create.restype = ctypes.c_int
    cdll.na_plan_create.argtypes = [
        u64, ctypes.POINTER(NaPlanArgs), u64p, ctypes.POINTER(NaPlanInfo), ctypes.POINTER(NaError),
    ]  # fmt: skip
    cdll.na_plan_free.restype = ctypes.c_int
    cdll.na_plan_free.argtypes = [u64, u64]
    cdll.na_run.restype = ctypes.c_int
    # The arguments: a NaRunArgs (ctypes.byref) or its packed bytes (RUN_ARGS), read only.
    cdll.na_run.argtypes = [u64, u64, ctypes.c_void_p]
    cdll.na_kv_write.restype = ctypes.c_int
    # The arguments: a NaKvWriteArgs (ctypes.byref) or its packed bytes (KV_WRITE_ARGS), read
    # only; then NULL or an int64 that receives the first slot outside the caches.
    cdll.na_kv_write.argtypes = [ctypes.c_void_p, ctypes.POINTER(c_i64)]
    cdll.na_step_index.restype = ctypes.c_int
    # The arguments: a NaStepArgs (ctypes.byref) or its packed bytes (STEP_ARGS), read only;
    # then the NaStepInfo it fills.
    cdll.na_step_index.argtypes = [ctypes.c_void_p, ctypes.POINTER(NaStepInfo)]
    cdll.na_codes.restype = ctypes.c_char_p
    cdll.na_codes.argtypes = []
    cdll.na_use_own_pool.restype = None
    cdll.na_use_own_pool.argtypes = []


def _load(path: Path | None) -> NativeLibrary | str:
    if path is None:
        found = library_candidates()
        if not found:
            why = "no compiled library _native_attn*.so next to the package"
            if BUILD_ERROR_FILE.is_file():
                detail = BUILD_ERROR_FILE.read_text(errors="replace").strip().splitlines()
                why = f"the build failed: {detail[0] if detail else 'unknown error'}"
            return (
                f"not built: {why} (reinstall with a C++17 compiler, or run "
                "`python setup.py build_ext --inplace` in a source checkout)"
            )
        path = found[0]
    if not path.is_file():
        return f"not built: library file {str(path)!r} does not exist"
    try:
        cdll = ctypes.CDLL(str(path))
        version = int(_version(cdll))
    except (OSError, AttributeError) as exc:
        return f"not built: cannot load {str(path)!r}: {exc}"
    try:
        _declare(cdll)
    except AttributeError as exc:  # an older library: an entry point this package calls is gone
        return (
            f"not built: {str(path)!r} (ABI version {version}) lacks an entry point this package "
            f"calls ({exc}); rebuild it (`python setup.py build_ext --inplace`)"
        )
    mismatch = layout_mismatch(cdll) or codes_mismatch(cdll)
    if mismatch is not None:
        return f"not built: {str(path)!r} (ABI version {version}): {mismatch}; rebuild it"
    if os.getpid() != _IMPORT_PID:
        # A forked child loading the library for the first time: the parent may have run an
        # OpenMP team (torch's), whose threads the child does not have, and the library's own
        # fork handler was not there to see the fork. Waiting on that team would hang.
        cdll.na_use_own_pool()
    return NativeLibrary(path=path, cdll=cdll, abi_version=version)


def _version(cdll: ctypes.CDLL) -> int:
    fn = cdll.na_abi_version
    fn.restype, fn.argtypes = ctypes.c_int32, []
    return int(fn())


def layout_mismatch(
    cdll: ctypes.CDLL, structs: tuple[type[ctypes.Structure], ...] | None = None
) -> str | None:
    """None when every mirrored struct has the library's size, else which differs and how."""
    for struct in MIRRORED_STRUCTS if structs is None else structs:
        name = struct.__name__
        theirs = int(cdll.na_struct_size(name.encode()))
        ours = ctypes.sizeof(struct)
        if theirs != ours:
            have = "has no such struct" if theirs < 0 else f"has {theirs} bytes"
            return (
                f"struct {name} differs between the library and the Python mirror "
                f"(library: {have}, mirror in {__name__}: {ours} bytes)"
            )
    return None


def codes_mismatch(cdll: ctypes.CDLL, expected: dict[str, int] | None = None) -> str | None:
    """None when the library's return codes and error fields (``na_codes``) are exactly the
    mirror's (``NaStatus``, ``NaField``), else the first difference."""
    ours = mirrored_codes() if expected is None else expected
    listed = bytes(cdll.na_codes()).decode()
    theirs: dict[str, int] = {}
    for pair in filter(None, listed.split(",")):
        name, _, value = pair.partition("=")
        theirs[name] = int(value)
    for name in sorted({*ours, *theirs}):
        if ours.get(name) != theirs.get(name):
            mine = "missing" if name not in ours else ours[name]
            lib = "missing" if name not in theirs else theirs[name]
            return (
                f"code {name} differs between the library and the Python mirror "
                f"(library: {lib}, mirror in {__name__}: {mine})"
            )
    return None


def load(path: str | os.PathLike[str] | None = None) -> NativeLibrary | str:
    """The library, or the reason it cannot be used ("not built: ..."); cached per path.

    ``path`` (or the ``ATTN_DISPATCH_NATIVE_LIB`` environment variable) overrides the search.
    """
    if path is None and os.environ.get(ENV_LIBRARY):
        path = os.environ[ENV_LIBRARY]
    key = "" if path is None else str(path)
    with _lock:
        if key not in _cache:
            _cache[key] = _load(None if path is None else Path(path))
        return _cache[key]


def unavailable_reason(path: str | os.PathLike[str] | None = None) -> str | None:
    """None when the library loads, else the "not built: ..." reason."""
    lib = load(path)
    return lib if isinstance(lib, str) else None
