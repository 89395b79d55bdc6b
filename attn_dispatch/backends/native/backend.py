"""The native backend: host-side checks and planning in Python, kernels in C++ (ctypes).

Every pointer handed to the library comes from a tensor whose device, dtype, shape,
contiguity and index ranges were checked here first, so a bad batch or tensor is an
``InvalidBatchError`` naming the field, never a wild read in C++.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
from typing import Any

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import BackendUnavailableError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._forms import FormPolicy
from attn_dispatch._phase import Phase
from attn_dispatch._protocol import Handler
from attn_dispatch.backends.native import DEFAULT_FORM_POLICY
from attn_dispatch.backends.native import MAX_HEAD_DIM
from attn_dispatch.backends.native._lib import NaConfig
from attn_dispatch.backends.native._lib import NaError
from attn_dispatch.backends.native._lib import NaPlanInfo
from attn_dispatch.backends.native._lib import NativeLibrary
from attn_dispatch.backends.native._lib import load

_NA_MHA, _NA_MLA = 0, 1
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
# csrc/native_attn.h NA_E_*: the batch field each refusal of na_plan_create names.
_E_FIELDS = {
    2: "qo_indptr", 3: "kv_indptr", 4: "kv_lens", 5: "kv_indices", 6: "qo_indptr",
    7: "custom_mask", 8: "kv_lens",
}  # fmt: skip
# Split-KV aims for at least this many work items whatever the thread count, so plans (and
# therefore results, bit for bit) are the same for 1..8 threads; more threads raise it.
SPLIT_FLOOR = 32


class _PlanHandle:
    """Owns one C++ plan (private copies of the batch's index arrays and the work items)."""

    __slots__ = ("_free", "ptr")

    def __init__(self, ptr: int, free: Any) -> None:
        self.ptr = ptr
        self._free = free

    def __del__(self) -> None:
        free, self._free = self._free, None
        if free is not None:
            free(self.ptr)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class NativePlan:
    """What ``NativeBackend.plan`` computed for one forward (shared by every layer).

    Immutable: the C++ side holds private copies of every index array the kernels read, so
    later edits to the batch's tensors never reach them. Only the backend object that made a
    plan accepts it (``owner``).
    """

    owner: NativeBackend
    phase: Phase
    num_tokens: int
    num_requests: int
    max_page: int  # largest page index referenced, -1 when none
    num_items: int
    num_merges: int
    handle: _PlanHandle


def _host_int(batch: AttnBatch, name: str, tensor: Any, dtype: torch.dtype) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor):
        raise InvalidBatchError(name, f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type != "cpu":
        raise InvalidBatchError(
            name, f"must be on the CPU for the native backend, got device {str(tensor.device)!r}"
        )
    if tensor.dtype != dtype or tensor.dim() != 1:
        raise InvalidBatchError(
            name, f"must be a 1-D {dtype} tensor, got {tensor.dtype} of shape {tuple(tensor.shape)}"
        )
    # na_plan_create copies what it reads; it only needs a dense view for that one pass.
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class NativeBackend:
    """C++ paged attention on the CPU for MHA/GQA and absorbed MLA, every phase.

    >>> backend = NativeBackend(AttnConfig("mla", 16, 1, 576, 512, dtype="bfloat16",
    ...                                    page_size=64), num_threads=2)
    >>> plan = backend.plan(batch)
    >>> out = backend.handler(Phase.DECODE)(q, k_cache, None, plan, 576 ** -0.5)

    ``num_threads`` defaults to ``torch.get_num_threads()``, read at every call. MLA runs in
    the absorbed form, except prefill without a cached prefix, which runs decompressed (ragged
    MHA through a second instance built for ``config.decompressed()``); ``form_policy``
    changes that.
    ``library`` loads the kernels from another file (development).
    """

    name = "native"

    def __init__(
        self,
        config: AttnConfig,
        *,
        num_threads: int | None = None,
        form_policy: FormPolicy | None = None,
        library: str | None = None,
    ) -> None:
        lib = load(library)
        if isinstance(lib, str):
            raise BackendUnavailableError("native", lib)
        if num_threads is not None and (not isinstance(num_threads, int) or num_threads < 1):
            raise InvalidSpecError("num_threads", num_threads, "must be a positive int or None")
        if config.device_type != "cpu":
            raise InvalidSpecError("device", config.device, "the native backend runs on the CPU")
        for field in ("head_dim", "v_head_dim"):
            if not 1 <= getattr(config, field) <= MAX_HEAD_DIM:
                raise InvalidSpecError(
                    field, getattr(config, field), f"must be in [1, {MAX_HEAD_DIM}]"
                )
        self.config = config
        self.form_policy = DEFAULT_FORM_POLICY if form_policy is None else form_policy
        # AttnConfig fills v_head_dim in on construction (head_dim when not given).
        self.v_head_dim: int = (
            config.v_head_dim if config.v_head_dim is not None else config.head_dim
        )
        self.library: NativeLibrary = lib
        self.num_threads = num_threads
        self.q_dtype: torch.dtype = getattr(torch, config.dtype)
        self.kv_dtype: torch.dtype = getattr(torch, str(config.kv_dtype))
        if self.q_dtype not in _DTYPE_CODES or self.kv_dtype not in _DTYPE_CODES:
            raise InvalidSpecError(
                "dtype",
                (config.dtype, config.kv_dtype),
                "the native backend serves float32, bfloat16 and float16 (q and cache)",
            )
        self.mla = config.kind == "mla"
        self._cfg = NaConfig(
            _NA_MLA if self.mla else _NA_MHA,
            _DTYPE_CODES[self.q_dtype],
            _DTYPE_CODES[self.kv_dtype],
            config.num_q_heads,
            config.num_kv_heads,
            config.head_dim,
            self.v_head_dim,
            config.page_size,
            0,
        )
        self._cfg_ref = ctypes.byref(self._cfg)
        self._run = lib.cdll.na_run
        self._create = lib.cdll.na_plan_create
        self._free = lib.cdll.na_plan_free
        self._info = lib.cdll.na_plan_info

    def threads(self) -> int:
        return self.num_threads if self.num_threads is not None else max(1, torch.get_num_threads())

    # -- planning (once per forward) ----------------------------------------------------------

    def plan(self, batch: AttnBatch) -> NativePlan:
        cfg = self.config
        ps = cfg.page_size
        if getattr(batch, "page_size", None) not in (None, ps):
            raise InvalidBatchError(
                "page_size", f"batch page_size {batch.page_size!r} != bound config page_size {ps!r}"
            )
        phase = batch.phase
        if not isinstance(phase, Phase):
            raise InvalidBatchError("phase", f"expected a Phase, got {phase!r}")
        qo = _host_int(batch, "qo_indptr", batch.qo_indptr_host, torch.int32)
        kv_indptr = _host_int(batch, "kv_indptr", batch.kv_indptr_host, torch.int32)
        kv_lens = _host_int(batch, "kv_lens", batch.kv_lens_host, torch.int32)
        kv_indices = _host_int(batch, "kv_indices", batch.kv_indices, torch.int32)
        b = kv_lens.numel()
        for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv_indptr)):
            if ptr.numel() != b + 1:
                raise InvalidBatchError(name, f"length {ptr.numel()} != len(kv_lens) + 1 = {b + 1}")
        mask = batch.custom_mask
        mask_ptr, mask_len = None, 0
        if mask is not None:
            mask = self._check_mask(batch, mask, qo, kv_lens)
            mask_ptr, mask_len = mask.data_ptr(), mask.numel()
        self._cfg.split_target = max(SPLIT_FLOOR, 4 * self.threads())
        err = NaError()
        ptr = self._create(
            self._cfg_ref, b, qo.data_ptr(), kv_indptr.data_ptr(), kv_indices.data_ptr(),
            kv_indices.numel(), kv_lens.data_ptr(), mask_ptr, mask_len,
            1 if phase is Phase.DECODE else 0, ctypes.byref(err),
        )  # fmt: skip
        if not ptr:
            raise self._plan_error(err)
        handle = _PlanHandle(ptr, self._free)
        info = NaPlanInfo()
        self._info(ptr, ctypes.byref(info))
        return NativePlan(
            owner=self,
            phase=phase,
            num_tokens=info.num_tokens,
            num_requests=info.num_requests,
            max_page=info.max_page,
            num_items=info.num_items,
            num_merges=info.num_merges,
            handle=handle,
        )

    def _check_mask(
        self, batch: AttnBatch, mask: Any, qo: torch.Tensor, kv_lens: torch.Tensor
    ) -> torch.Tensor:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
            raise InvalidBatchError("custom_mask", "must be a flat 1-D torch.bool tensor")
        if mask.device.type != "cpu":
            raise InvalidBatchError(
                "custom_mask", f"must be on the CPU, got device {str(mask.device)!r}"
            )
        given = getattr(batch, "mask_indptr", None)
        if given is not None:
            want = torch.zeros(kv_lens.numel() + 1, dtype=torch.int64)
            torch.cumsum((qo[1:] - qo[:-1]).long() * kv_lens.long(), 0, out=want[1:])
            if not torch.equal(given.cpu().long(), want):
                raise InvalidBatchError(
                    "mask_indptr", "does not match the cumulative sum of q_len * kv_len"
                )
        return mask if mask.is_contiguous() else mask.contiguous()

    @staticmethod
    def _plan_error(err: NaError) -> InvalidBatchError:
        field = _E_FIELDS.get(err.field)
        req = err.request if err.request >= 0 else None
        a, b = err.a, err.b
        problem = {
            "qo_indptr": f"must start at 0 and be non-decreasing (values {a!r}, {b!r})",
            "kv_indptr": (
                f"must start at 0, be non-decreasing and stay within kv_indices "
                f"(values {a!r}, {b!r})"
            ),
            "kv_lens": f"kv_len {a!r} is shorter than q_len or needs more pages than given ({b!r})",
            "kv_indices": f"page index {a!r} (at position {b!r}) is negative",
            "custom_mask": f"length {a!r} != sum(q_len * kv_len) = {b!r}",
        }.get(field or "", "")
        if err.field == 6:
            problem = f"DECODE needs exactly one query per request, got {a!r}"
        elif err.field == 8:
            problem = "the batch is too large for the native planner (over 2^31 scratch rows)"
        elif err.field == 9:
            raise MemoryError("native attention: no memory for the plan")
        elif field is None:
            raise InvalidSpecError("config", err.field, "the native planner refused the config")
        return InvalidBatchError(field or "batch", problem, request=req)

    # -- per layer ----------------------------------------------------------------------------

    def handler(self, phase: Phase) -> Handler:
        phase = Phase(phase)

        def native_attention(
            q: Any, k_cache: Any, v_cache: Any, plan: Any, sm_scale: float, /
        ) -> torch.Tensor:
            return self._forward(phase, q, k_cache, v_cache, plan, sm_scale)

        return native_attention

    def _check_tensor(
        self, name: str, t: Any, dtype: torch.dtype, shape: tuple[int | None, ...]
    ) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise InvalidBatchError(name, f"expected a torch.Tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise InvalidBatchError(name, f"must be on the CPU, got device {str(t.device)!r}")
        if t.dtype != dtype:
            raise InvalidBatchError(name, f"dtype must be {dtype} (bound config), got {t.dtype}")
        if t.dim() != len(shape) or any(
            want is not None and got != want for got, want in zip(t.shape, shape, strict=True)
        ):
            want_s = ", ".join("*" if s is None else str(s) for s in shape)
            raise InvalidBatchError(name, f"shape must be [{want_s}], got {list(t.shape)}")
        if not t.is_contiguous():
            raise InvalidBatchError(name, "must be contiguous (call .contiguous())")
        return t

    def _forward(
        self, phase: Phase, q: Any, k_cache: Any, v_cache: Any, plan: Any, sm_scale: float
    ) -> torch.Tensor:
        cfg = self.config
        if type(plan) is not NativePlan:
            raise InvalidBatchError(
                "plan",
                f"expected the NativePlan from NativeBackend.plan, got {type(plan).__name__}",
            )
        if plan.owner is not self:
            raise InvalidBatchError(
                "plan",
                f"this plan was made by another backend object ({plan.owner.config!r}); a "
                "handler accepts only plans from its own backend (plan with the binding that "
                "runs it: binding.plan(batch))",
            )
        if plan.phase is not phase:
            raise InvalidBatchError(
                "phase",
                f"the plan is for {plan.phase.name}, this handler serves {phase.name}",
            )
        hq, hkv, d, dv, ps = (
            cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, self.v_head_dim, cfg.page_size,
        )  # fmt: skip
        q = self._check_tensor("q", q, self.q_dtype, (plan.num_tokens, hq, d))
        if self.mla:
            k_cache = self._check_tensor("k_cache", k_cache, self.kv_dtype, (None, ps, d))
            if v_cache is not None:
                raise InvalidBatchError(
                    "v_cache", "must be None for MLA (V is the first v_head_dim columns of k_cache)"
                )
            k_pages = v_pages = k_cache.shape[0]
            v_ptr = None
        else:
            k_cache = self._check_tensor("k_cache", k_cache, self.kv_dtype, (None, ps, hkv, d))
            v_cache = self._check_tensor("v_cache", v_cache, self.kv_dtype, (None, ps, hkv, dv))
            k_pages, v_pages = k_cache.shape[0], v_cache.shape[0]
            if k_pages != v_pages:
                raise InvalidBatchError(
                    "v_cache", f"has {v_pages} pages, k_cache has {k_pages}: they must match"
                )
            v_ptr = v_cache.data_ptr()
        if plan.max_page >= k_pages:
            raise InvalidBatchError(
                "kv_indices",
                f"page index {plan.max_page} out of range for a cache of {k_pages} pages",
            )
        scale = float(sm_scale)
        if not math.isfinite(scale):
            raise InvalidBatchError("sm_scale", f"must be finite, got {sm_scale!r}")
        out = torch.empty((plan.num_tokens, hq, dv), dtype=self.q_dtype)
        if plan.num_items == 0:
            return out
        rc = self._run(
            plan.handle.ptr, self._cfg_ref, q.data_ptr(), k_cache.data_ptr(), v_ptr,
            out.data_ptr(), k_pages, v_pages, scale, self.threads(),
        )  # fmt: skip
        if rc != 0:
            if rc == -2:
                raise MemoryError("native attention: a per-thread buffer could not be allocated")
            raise RuntimeError(f"native attention kernel rejected its arguments (code {rc})")
        return out
