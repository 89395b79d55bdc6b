"""The native backend: the shared batch and tensor checks in Python, planning and kernels in
C++ (ctypes).

``plan`` runs the shared batch contract (``attn_dispatch.backend.BatchSnapshot``), then
``na_plan_create``, which re-checks every index it will follow and keeps private copies of
them; the plan is owned by the backend object that made it. Each layer call checks its
tensors against the plan (``TensorChecks``) before one ``na_run``. A bad batch, tensor or plan is an
``InvalidBatchError`` naming the field, never a wild read in C++.

Nothing the kernels trust travels in the plan object. The C++ library keeps its own tables:
each backend object is a runner there (its config, fixed at construction) and each plan an
entry bound to that runner, both named by 64-bit ids it never reuses. The plan's id lives in
this backend's private table keyed by the plan object's identity (a weak reference: the C++
plan is freed with the Python one), never in a field of the plan, and ``na_run`` refuses an
unknown, freed or other runner's id by itself. A plan's fields are informational: editing
them (``object.__setattr__``) changes nothing a kernel reads, and ``out`` is sized from the
library's own row count (``na_run`` refuses any other size, so no row is left unwritten).
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import struct
import threading
import weakref
from typing import TYPE_CHECKING
from typing import Any

import torch

from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import BackendBase
from attn_dispatch.backend import BackendUnavailableError
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import Handler
from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backend import InvalidSpecError
from attn_dispatch.backend import Phase
from attn_dispatch.backend import PlanBase
from attn_dispatch.backend import TensorChecks
from attn_dispatch.backend import check_plan
from attn_dispatch.backend import issue_plan
from attn_dispatch.backends.native import MAX_HEAD_DIM
from attn_dispatch.backends.native._lib import RUN_ARGS
from attn_dispatch.backends.native._lib import NaConfig
from attn_dispatch.backends.native._lib import NaError
from attn_dispatch.backends.native._lib import NaField
from attn_dispatch.backends.native._lib import NaPlanArgs
from attn_dispatch.backends.native._lib import NaPlanInfo
from attn_dispatch.backends.native._lib import NaRunArgs
from attn_dispatch.backends.native._lib import NaStatus
from attn_dispatch.backends.native._lib import NativeLibrary
from attn_dispatch.backends.native._lib import load

if TYPE_CHECKING:
    from attn_dispatch import AttnBatch

_NA_MHA, _NA_MLA = 0, 1
#: ``attn_dispatch.backend.Handler``'s optional attribute: the handler's variant for a call
#: the core checked (scale, keywords, ``out``) just before.
_CORE_CHECKED = "attn_dispatch_core_checked"
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# csrc/native_attn.h NA_E4M3 / NA_E5M2: FP8 is a cache dtype only.
_KV_DTYPE_CODES = {**_DTYPE_CODES, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
# NaField -> the batch field a refusal of na_plan_create names (the others are not the batch's).
_E_FIELDS = {
    NaField.QO_INDPTR: "qo_indptr", NaField.KV_INDPTR: "kv_indptr", NaField.KV_LENS: "kv_lens",
    NaField.KV_INDICES: "kv_indices", NaField.DECODE_QLEN: "qo_indptr",
    NaField.MASK: "custom_mask", NaField.TOO_LARGE: "kv_lens",
}  # fmt: skip
# One message per return code (every NaStatus but OK; a test holds the table complete). The
# error type follows what the caller can do: plan again, build a new backend, fix the spec.
STATUS_MESSAGES: dict[NaStatus, str] = {
    NaStatus.BAD_ARGS: (
        "the native kernel refused the plan for these tensors (its tokens, pages or heads do "
        "not fit q, the cache or the output); plan the batch again with this backend"
    ),
    NaStatus.NO_MEMORY: "the native library could not allocate its memory",
    NaStatus.UNKNOWN_PLAN: (
        "native: the plan's id names no live plan of the native library (freed, or never "
        "issued); plan the batch again with this backend"
    ),
    NaStatus.FOREIGN_PLAN: (
        "native: the plan's id is a live plan of another native runner (another backend "
        "object); plan the batch again with this backend"
    ),
    NaStatus.UNKNOWN_RUNNER: (
        "this backend object's runner is no longer in the native library (freed, or never "
        "created); build a new backend"
    ),
    NaStatus.BAD_CONFIG: "the native library refused the config",
    NaStatus.BAD_THREADS: "the native library refused the thread count (at least 1)",
    NaStatus.SHORT_BUFFER: (
        "the native library was handed a buffer shorter than the size it reports (a caller's "
        "bug: na_step_index's caller allocates that size and calls again)"
    ),
}
# One message per NaField that is not a batch field's own problem (a test holds it complete
# together with _E_FIELDS).
FIELD_MESSAGES: dict[NaField, str] = {
    NaField.NONE: "the native planner refused the batch without naming a field (a bug)",
    NaField.CONFIG: (
        "the native planner refused its arguments (a NULL array or a negative count: a bug "
        "in attn_dispatch's native backend, never the batch)"
    ),
    NaField.NO_MEMORY: "native attention: no memory for the plan",
    NaField.INTERNAL: "native attention: the planner's row coverage check failed (a bug)",
}
# Split-KV aims for at least this many work items whatever the thread count, so plans (and
# therefore results, bit for bit) are the same for 1..8 threads; more threads raise it.
SPLIT_FLOOR = 32
_INT32_MAX = 2**31 - 1


@dataclasses.dataclass(frozen=True, slots=True)
class _Issued:
    """This backend's private record of one plan: what the kernels trust, from the library."""

    ref: weakref.ref[Any]  # the plan object (identity; a copy or a stand-in never matches)
    plan_id: int  # the library's id of the C++ plan
    phase: Phase
    num_tokens: int  # rows of the output, from the library's own count


def status_error(
    rc: int, entry: str, *, config: object = None, threads: object = None
) -> Exception:
    """The error for return code ``rc`` (not OK) of the library's entry point ``entry``."""
    try:
        status = NaStatus(rc)
    except ValueError:
        return RuntimeError(
            f"native attention: {entry} returned {rc!r}, a code this package does not know "
            "(the library and the package are out of step: rebuild the library)"
        )
    message = STATUS_MESSAGES.get(status)
    if message is None:  # NaStatus.OK: nothing failed, so the caller misread the code
        return RuntimeError(f"native attention: {entry} returned {status.name} as a failure")
    if status is NaStatus.NO_MEMORY:
        return MemoryError(f"native attention: {entry}: {message}")
    if status is NaStatus.UNKNOWN_RUNNER:
        return BackendUnavailableError("native", f"{entry}: {message}")
    if status is NaStatus.BAD_CONFIG:
        return InvalidSpecError("config", config, message)
    if status is NaStatus.BAD_THREADS:
        return InvalidSpecError("num_threads", threads, message)
    if status is NaStatus.SHORT_BUFFER:
        return RuntimeError(f"native attention: {entry}: {message}")
    return InvalidBatchError("plan", message)


def _free_plan(free: Any, runner: int, plan_id: int) -> None:
    try:
        free(runner, plan_id)
    except Exception:  # interpreter shutdown: the library may already be gone
        pass


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class NativePlan(PlanBase):
    """What ``NativeBackend.plan`` computed for one forward (shared by every layer).

    Immutable, and informational only: the C++ side holds private copies of every index array
    the kernels read (later edits to the batch's tensors, or to ``snapshot``, never reach
    them), and the C++ plan's id is kept by the backend that made it, keyed by this object's
    identity, never in a field here. Only the backend object that made a plan accepts it.
    """

    owner: NativeBackend
    phase: Phase
    num_tokens: int
    num_requests: int
    max_page: int  # largest page index referenced, -1 when none
    num_items: int
    num_merges: int
    snapshot: BatchSnapshot  # the shared validator's view (per-call tensor checks read it)
    #: Cascade: groups of requests whose page tables start with the same pages (read once per
    #: group), the requests in them, and the shared keys summed over the groups. 0 when off.
    cascade_groups: int = 0
    cascade_requests: int = 0
    cascade_keys: int = 0

    @property
    def dispatch_note(self) -> str | None:
        """What ``record_dispatch`` shows beside the call: the cascade, when it ran."""
        if not self.cascade_groups:
            return None
        return (
            f"cascade: {self.cascade_requests} requests in {self.cascade_groups} "
            f"group{'s' if self.cascade_groups > 1 else ''} share {self.cascade_keys} keys"
        )


class NativeBackend(BackendBase):
    """C++ paged attention on the CPU for MHA/GQA and absorbed MLA, every phase.

    >>> from attn_dispatch import AttnBatch
    >>> backend = NativeBackend(AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16",
    ...                                    page_size=64), num_threads=2)
    >>> batch = AttnBatch.build(Phase.DECODE, q_lens=[1], kv_lens=[70], page_tables=[[1, 0]],
    ...                         page_size=64)
    >>> q = torch.randn(1, 16, 576, dtype=torch.bfloat16)
    >>> k_cache = torch.randn(2, 64, 576, dtype=torch.bfloat16)
    >>> plan = backend.plan(batch)
    >>> backend.handler(Phase.DECODE)(q, k_cache, None, plan, 576 ** -0.5).shape
    torch.Size([1, 16, 512])

    ``num_threads`` defaults to ``torch.get_num_threads()``, read at every call. MLA runs in
    the absorbed form, except prefill without a cached prefix, which runs decompressed (ragged
    MHA through a second instance built for ``config.decompressed()``). Layer variants
    (``window_left``, ``logit_cap``, ``sinks``) and FP8 caches (``k_scale``/``v_scale`` per
    call) are served in every phase.
    ``library`` loads the kernels from another file (development).
    """

    name = "native"
    #: q's rows may lie at any stride (each token's ``[heads, head_dim]`` dense): a column
    #: slice of a fused QKV projection is read in place (integrations skip the copy).
    reads_strided_q_rows = True

    @property
    def abi_version(self) -> int:
        """The C ABI version of the loaded kernel library (``NA_ABI_VERSION``): the build
        ``attn_dispatch.distributed.check_agreement`` compares across ranks."""
        return self.library.abi_version

    def __init__(
        self,
        config: AttnConfig,
        *,
        num_threads: int | None = None,
        cascade: bool = True,
        library: str | None = None,
    ) -> None:
        lib = load(library)
        if isinstance(lib, str):
            raise BackendUnavailableError("native", lib)
        # The library takes an int32: a larger count would wrap (to a negative one) silently.
        if num_threads is not None and (
            not isinstance(num_threads, int)
            or isinstance(num_threads, bool)
            or not 1 <= num_threads <= _INT32_MAX
        ):
            raise InvalidSpecError(
                "num_threads", num_threads, f"must be a positive int (at most {_INT32_MAX}) or None"
            )
        if not isinstance(cascade, bool):
            raise InvalidSpecError("cascade", cascade, "must be True or False")
        if config.device_type != "cpu":
            raise InvalidSpecError("device", config.device, "the native backend runs on the CPU")
        for field in ("head_dim", "v_head_dim"):
            if not 1 <= getattr(config, field) <= MAX_HEAD_DIM:
                raise InvalidSpecError(
                    field, getattr(config, field), f"must be in [1, {MAX_HEAD_DIM}]"
                )
        self.config = config
        # AttnConfig fills v_head_dim in on construction (head_dim when not given).
        self.v_head_dim: int = (
            config.v_head_dim if config.v_head_dim is not None else config.head_dim
        )
        self.library: NativeLibrary = lib
        self.num_threads = num_threads
        self.q_dtype: torch.dtype = getattr(torch, config.dtype)
        self.kv_dtype: torch.dtype = getattr(torch, str(config.kv_dtype))
        if self.q_dtype not in _DTYPE_CODES or self.kv_dtype not in _KV_DTYPE_CODES:
            raise InvalidSpecError(
                "dtype",
                (config.dtype, config.kv_dtype),
                "the native backend serves float32, bfloat16 and float16 (q and cache) and "
                "float8_e4m3fn / float8_e5m2 caches",
            )
        self.fp8 = config.kv_fp8
        self.mla = config.kind == "mla"
        # The kernels hold the window as int32 and the cap as float32. A window that reaches
        # past any int32 position is full attention; a cap that float32 rounds to 0 or inf
        # would silently change the layer, so it is refused.
        window = config.window_left
        window_c = -1 if window is None or window >= _INT32_MAX else window
        # Likewise a chunk wider than any int32 position: every query is in chunk 0 (causal).
        chunk = config.attention_chunk_size
        chunk_c = 0 if chunk is None or chunk >= _INT32_MAX else chunk
        # The core refused caps float32 cannot hold (attn_dispatch/_values.py).
        cap = float(config.logit_cap or 0.0)
        self._cfg = NaConfig(
            _NA_MLA if self.mla else _NA_MHA,
            _DTYPE_CODES[self.q_dtype],
            _KV_DTYPE_CODES[self.kv_dtype],
            config.num_q_heads,
            config.num_kv_heads,
            config.head_dim,
            self.v_head_dim,
            config.page_size,
            window_c,
            cap,
            1 if config.causal else 0,
            chunk_c,
            1 if cascade else 0,
        )
        self.cascade = cascade
        # q's rows may be strided (its heads dense): a column slice of a fused projection.
        self._checks = TensorChecks.of(config, backend="native", layout="q_rows")
        self._sinks = bool(config.sinks)
        self._heads = config.num_q_heads
        self._pack = RUN_ARGS.pack
        self._run = lib.cdll.na_run
        self._create = lib.cdll.na_plan_create
        self._free = lib.cdll.na_plan_free
        # This object's runner in the library: the config is copied there once; plans and
        # calls name the runner, and the library checks that each plan is this runner's.
        runner = ctypes.c_uint64(0)
        rc = lib.cdll.na_runner_create(ctypes.byref(self._cfg), ctypes.byref(runner))
        if rc != NaStatus.OK:
            raise status_error(rc, "na_runner_create", config=config)
        self._runner: int = runner.value
        # Freed with this object, never at interpreter exit: a daemon thread may still be
        # serving with it then (finalize's default would free it under that thread). At exit
        # the runner simply goes with the process.
        weakref.finalize(self, lib.cdll.na_runner_free, self._runner).atexit = False
        # id(plan) -> _Issued, for the plans this object made and that are still alive.
        self._issued: dict[int, _Issued] = {}
        self._issued_lock = threading.Lock()

    def threads(self) -> int:
        if self.num_threads is not None:
            return self.num_threads
        return min(_INT32_MAX, max(1, torch.get_num_threads()))

    # -- planning (once per forward) ----------------------------------------------------------

    def plan(self, batch: AttnBatch) -> NativePlan:
        # The shared contract check (with private copies); the C++ planner then copies the
        # snapshot once more into memory it owns and re-checks every index it will follow.
        snap = BatchSnapshot.of(batch, self.config.page_size)
        if snap.device.type != "cpu":
            raise InvalidBatchError(
                "kv_indices",
                f"must be on the CPU for the native backend, got device {str(snap.device)!r}",
            )
        qo, kv_indptr, kv_lens, kv_indices = (
            snap.qo_indptr, snap.kv_indptr, snap.kv_lens, snap.kv_indices,
        )  # fmt: skip
        mask = snap.custom_mask
        mask_ptr, mask_len = (None, 0) if mask is None else (mask.data_ptr(), mask.numel())
        args = NaPlanArgs(
            num_requests=snap.num_requests,
            decode=1 if snap.phase is Phase.DECODE else 0,
            split_target=min(_INT32_MAX, max(SPLIT_FLOOR, 4 * self.threads())),
            qo_indptr=qo.data_ptr(),
            kv_indptr=kv_indptr.data_ptr(),
            kv_indices=kv_indices.data_ptr(),
            num_indices=kv_indices.numel(),
            kv_lens=kv_lens.data_ptr(),
            mask=mask_ptr,
            mask_len=mask_len,
        )
        err, info, plan_id = NaError(), NaPlanInfo(), ctypes.c_uint64(0)
        rc = self._create(
            self._runner, ctypes.byref(args), ctypes.byref(plan_id), ctypes.byref(info),
            ctypes.byref(err),
        )  # fmt: skip
        if rc == NaStatus.BAD_ARGS:
            raise self._plan_error(err)
        if rc != NaStatus.OK:
            raise status_error(rc, "na_plan_create", config=self.config)
        plan = NativePlan(
            owner=self,
            phase=snap.phase,
            num_tokens=info.num_tokens,
            num_requests=info.num_requests,
            max_page=info.max_page,
            num_items=info.num_items,
            num_merges=info.num_merges,
            snapshot=snap,
            cascade_groups=info.cascade_groups,
            cascade_requests=info.cascade_requests,
            cascade_keys=info.cascade_keys,
        )
        self._remember(plan, plan_id.value, snap.phase, info.num_tokens)
        return issue_plan(self, plan)

    def _remember(self, plan: NativePlan, plan_id: int, phase: Phase, num_tokens: int) -> None:
        key = id(plan)
        issued, lock = self._issued, self._issued_lock
        free, runner = self._free, self._runner
        # Held by the closure: at interpreter shutdown module globals may already be None
        # when the last plans are collected.
        free_plan = _free_plan

        def forget(ref: weakref.ref[Any]) -> None:
            # The plan object is gone: drop the record (if still its own) and the C++ plan.
            with lock:
                entry = issued.get(key)
                if entry is not None and entry.ref is ref:
                    del issued[key]
            free_plan(free, runner, plan_id)

        record = _Issued(weakref.ref(plan, forget), plan_id, phase, num_tokens)
        with lock:
            issued[key] = record

    def _record(self, plan: object) -> _Issued:
        """This object's record of ``plan`` (looked up by identity), or our error."""
        issued = self._issued.get(id(plan))
        if issued is None or issued.ref() is not plan:
            raise InvalidBatchError(
                "plan", "native: this plan was not made by this backend object (or was freed)"
            )
        return issued

    @staticmethod
    def _plan_error(err: NaError) -> Exception:
        """The error for na_plan_create's NA_BAD_ARGS: the refused field's own message."""
        try:
            code = NaField(err.field)
        except ValueError:
            return RuntimeError(
                f"native attention: na_plan_create named error field {err.field!r}, which this "
                "package does not know (the library and the package are out of step)"
            )
        if code is NaField.NO_MEMORY:
            return MemoryError(FIELD_MESSAGES[code])
        if code not in _E_FIELDS:
            return RuntimeError(FIELD_MESSAGES[code])
        field = _E_FIELDS[code]
        req = err.request if err.request >= 0 else None
        a, b = err.a, err.b
        problem = {
            NaField.QO_INDPTR: f"must start at 0 and be non-decreasing (values {a!r}, {b!r})",
            NaField.KV_INDPTR: (
                f"must start at 0, be non-decreasing and stay within kv_indices "
                f"(values {a!r}, {b!r})"
            ),
            NaField.KV_LENS: (
                f"kv_len {a!r} is shorter than q_len or needs more pages than given ({b!r})"
            ),
            NaField.KV_INDICES: f"page index {a!r} (at position {b!r}) is negative",
            NaField.DECODE_QLEN: f"DECODE needs exactly one query per request, got {a!r}",
            NaField.MASK: f"length {a!r} != sum(q_len * kv_len) = {b!r}",
            NaField.TOO_LARGE: (
                "the batch is too large for the native planner (over 2^31 scratch rows)"
            ),
        }[code]
        return InvalidBatchError(field, problem, request=req)

    # -- per layer ----------------------------------------------------------------------------

    def handler(self, phase: Phase) -> Handler:
        # A partial (called in C) of the one signature below: sinks=, k_scale=, v_scale=,
        # return_lse= are keywords, as bind checks against the capabilities. Its variant for
        # calls the core checked (a binding's calls with out=: the scale, the keywords and
        # the buffer checked on these very objects just before; _protocol.Handler) skips
        # those checks only.
        phase = Phase(phase)
        run = functools.partial(self._forward, phase)
        setattr(run, _CORE_CHECKED, functools.partial(self._launch, phase))
        return run

    def _forward(
        self,
        phase: Phase,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        plan: Any,
        sm_scale: float,
        /,
        *,
        sinks: Any = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        return_lse: bool = False,
        out: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        issued = self._issued_for(phase, q, k_cache, v_cache, plan)
        try:
            # The core's rules, which a binding's calls passed already (with out=, they reach
            # _launch instead): this handler may also be called without one.
            self._checks.check_keywords(q, sinks=sinks, return_lse=return_lse)  # every backend's
            sm_scale, k_scale, v_scale = self._checks.check_scales(
                sm_scale, k_scale, v_scale, fp8=self.fp8
            )
            # A caller's buffer: the core's rule (shape, dtype, device, contiguous, no memory
            # shared with q or the caches).
            if out is not None:
                self._checks.check_out(out, q, k_cache, v_cache)
        except Exception:
            # The tensors are checked in na_run; a call wrong in both is named by its tensors
            # first, as when they were checked here before the keywords.
            self._checks.check(plan.snapshot, q, k_cache, v_cache)
            raise
        return self._run_kernel(
            issued, q, k_cache, v_cache, sm_scale, sinks, k_scale, v_scale, return_lse, out,
            phase, plan,
        )  # fmt: skip

    def _launch(
        self,
        phase: Phase,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        plan: Any,
        sm_scale: float,
        /,
        *,
        sinks: Any = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        return_lse: bool = False,
        out: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The handler's ``_CORE_CHECKED`` variant: a call whose scales, keywords and ``out``
        the core checked just before (``_calls.CheckedHandler``); the plan and the tensors
        are checked here, as on every call: the plan in Python (issued by this object, for
        this phase), the tensors against it inside ``na_run``, before any load."""
        issued = self._issued_for(phase, q, k_cache, v_cache, plan)
        return self._run_kernel(
            issued, q, k_cache, v_cache, sm_scale, sinks, k_scale, v_scale, return_lse, out,
            phase, plan,
        )  # fmt: skip

    def _issued_for(self, phase: Phase, q: Any, k_cache: Any, v_cache: Any, plan: Any) -> _Issued:
        """This object's record of ``plan`` for ``phase`` (the tensors are checked against it
        in ``na_run``); our error naming what is wrong otherwise."""
        check_plan(plan, self, "native")
        issued = self._issued.get(id(plan))
        if issued is None or issued.ref() is not plan or issued.phase is not phase:
            issued = self._checked_plan(phase, q, k_cache, v_cache, plan)  # names the problem
        return issued

    def _checked_plan(self, phase: Phase, q: Any, k_cache: Any, v_cache: Any, plan: Any) -> _Issued:
        """This object's record of ``plan`` for ``phase``, once the tensors fit it."""
        check_plan(plan, self, "native")
        # What the kernel trusts comes from this object's own record of the plan, never from
        # the plan's (editable) fields.
        issued = self._record(plan)
        if issued.phase is not phase:
            raise InvalidBatchError(
                "phase",
                f"the plan is for {issued.phase.name}, this handler serves {phase.name}",
            )
        self._checks.check(plan.snapshot, q, k_cache, v_cache)
        return issued

    def _run_kernel(
        self,
        issued: _Issued,
        q: Any,
        k_cache: Any,
        v_cache: Any,
        sm_scale: float,
        sinks: Any,
        k_scale: float,
        v_scale: float,
        return_lse: bool,
        out: Any,
        phase: Phase | None = None,
        plan: Any = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One ``na_run``, which checks every tensor against the config and the plan before
        any load. A refusal of the tensors is explained by the Python checks (the same error
        as before the call reached C: ``_checked_plan``) when ``phase`` and ``plan`` are
        given, else reported as the library's refusal."""
        sinks_ptr, sinks_numel = 0, 0
        if self._sinks:
            sinks = sinks.contiguous()  # kept alive until the kernel returns
            sinks_ptr, sinks_numel = sinks.data_ptr(), sinks.numel()
        # Every row is written by the kernel (na_run refuses an out of any other size).
        if out is None:
            out = torch.empty((issued.num_tokens, self._heads, self.v_head_dim), dtype=self.q_dtype)
        lse, lse_ptr, lse_numel = None, 0, 0
        if return_lse:
            lse = torch.empty((issued.num_tokens, self._heads), dtype=torch.float32)
            lse_ptr, lse_numel = lse.data_ptr(), lse.numel()
        threads = self.num_threads
        if threads is None:
            threads = min(_INT32_MAX, max(1, torch.get_num_threads()))
        codes = _KV_DTYPE_CODES
        try:
            # The tensors as torch holds them; na_run checks each against the config and the
            # plan. A shape of another rank does not pack (struct.error): refused below.
            if self.mla:
                if v_cache is not None:  # MLA reads no V: a cache given for it is refused
                    raise TypeError("v_cache")
                args = self._pack(
                    q.data_ptr(), k_cache.data_ptr(), 0, out.data_ptr(), sinks_ptr, lse_ptr,
                    *q.shape, *q.stride(), *k_cache.shape, 0, *k_cache.stride(), 0,
                    0, 0, 0, 0, 0, 0, 0, 0, out.numel(), sinks_numel, lse_numel,
                    codes.get(q.dtype, -1), codes.get(k_cache.dtype, -1), -1,
                    q.is_cpu and k_cache.is_cpu and out.is_cpu,
                    sm_scale, k_scale, v_scale, threads,
                )  # fmt: skip
            else:
                args = self._pack(
                    q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
                    sinks_ptr, lse_ptr, *q.shape, *q.stride(), *k_cache.shape,
                    *k_cache.stride(), *v_cache.shape, *v_cache.stride(), out.numel(),
                    sinks_numel, lse_numel, codes.get(q.dtype, -1),
                    codes.get(k_cache.dtype, -1), codes.get(v_cache.dtype, -1),
                    q.is_cpu and k_cache.is_cpu and v_cache.is_cpu and out.is_cpu,
                    sm_scale, k_scale, v_scale, threads,
                )  # fmt: skip
        except (struct.error, AttributeError, TypeError):
            rc = NaStatus.BAD_ARGS  # not tensors of the ranks the config needs
        else:
            rc = self._run(self._runner, issued.plan_id, args)
        if rc != NaStatus.OK:
            if rc == NaStatus.BAD_ARGS and phase is not None:
                # The Python checks name what does not fit (the same errors as ever).
                self._checked_plan(phase, q, k_cache, v_cache, plan)
            raise status_error(rc, "na_run", config=self.config, threads=threads)
        return out if lse is None else (out, lse)


def run_args(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    out: torch.Tensor,
    *,
    sm_scale: float,
    num_threads: int,
    sinks: torch.Tensor | None = None,
    sinks_numel: int | None = None,
    lse: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> NaRunArgs:
    """``NaRunArgs`` describing these tensors as torch holds them (a 3-dim MLA cache: its
    fourth dim 0; ``v`` None: no V): what tests hand ``na_run`` straight through the C ABI."""
    args = NaRunArgs(
        q=q.data_ptr(), k=k.data_ptr(), v=None if v is None else v.data_ptr(),
        out=out.data_ptr(), sinks=None if sinks is None else sinks.data_ptr(),
        lse=None if lse is None else lse.data_ptr(), out_numel=out.numel(),
        sinks_numel=(0 if sinks is None else sinks.numel()) if sinks_numel is None else sinks_numel,
        lse_numel=0 if lse is None else lse.numel(), q_dtype=_KV_DTYPE_CODES.get(q.dtype, -1),
        k_dtype=_KV_DTYPE_CODES.get(k.dtype, -1),
        v_dtype=-1 if v is None else _KV_DTYPE_CODES.get(v.dtype, -1),
        host=int(all(t.is_cpu for t in (q, k, out) + (() if v is None else (v,)))),
        sm_scale=sm_scale, k_scale=k_scale, v_scale=v_scale, num_threads=num_threads,
    )  # fmt: skip
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is not None:
            getattr(args, f"{name}_shape")[: t.dim()] = tuple(t.shape)
            getattr(args, f"{name}_stride")[: t.dim()] = tuple(t.stride())
    return args
