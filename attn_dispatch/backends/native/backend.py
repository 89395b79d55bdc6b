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
from attn_dispatch.backends._torch_base import TorchBackendBase
from attn_dispatch.backends.native import DEFAULT_FORM_POLICY
from attn_dispatch.backends.native import MAX_HEAD_DIM
from attn_dispatch.backends.native._lib import ITEM_INTS
from attn_dispatch.backends.native._lib import MERGE_INTS
from attn_dispatch.backends.native._lib import NaProblem
from attn_dispatch.backends.native._lib import NativeLibrary
from attn_dispatch.backends.native._lib import load

_NA_F32, _NA_BF16 = 0, 1
_NA_MHA, _NA_MLA = 0, 1
_DTYPE_CODES = {torch.float32: _NA_F32, torch.bfloat16: _NA_BF16}
# Split-KV aims for at least this many work items whatever the thread count, so plans (and
# therefore results, bit for bit) are the same for 1..8 threads; more threads raise it.
SPLIT_FLOOR = 32


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class NativePlan:
    """What ``NativeBackend.plan`` computed for one forward (shared by every layer)."""

    batch: AttnBatch
    num_tokens: int
    max_page: int  # largest page index referenced, -1 when none
    num_items: int
    num_merges: int
    template: NaProblem  # batch fields filled in; each call copies it and adds tensors
    # Host tensors whose addresses the template holds: kept alive with the plan.
    keep: tuple[torch.Tensor | None, ...]


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
    # A private copy: the kernels read it for the whole forward, and a caller editing the
    # batch's tensors in place after planning must not move reads outside the checked ranges.
    return tensor.clone(memory_format=torch.contiguous_format)


def _first(flags: torch.Tensor) -> int | None:
    return int(flags.int().argmax()) if bool(flags.any()) else None


class NativeBackend(TorchBackendBase):
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
            raise ValueError(
                f"the native backend serves float32 and bfloat16, got dtype {config.dtype!r} "
                f"and kv_dtype {config.kv_dtype!r}"
            )
        self.mla = config.kind == "mla"
        self._run = lib.cdll.na_run

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
        qo = _host_int(batch, "qo_indptr", batch.qo_indptr_host, torch.int32)
        kv_indptr = _host_int(batch, "kv_indptr", batch.kv_indptr_host, torch.int32)
        kv_lens = _host_int(batch, "kv_lens", batch.kv_lens_host, torch.int32)
        kv_indices = _host_int(batch, "kv_indices", batch.kv_indices, torch.int32)
        b = kv_lens.numel()
        for name, ptr in (("qo_indptr", qo), ("kv_indptr", kv_indptr)):
            if ptr.numel() != b + 1:
                raise InvalidBatchError(name, f"length {ptr.numel()} != len(kv_lens) + 1 = {b + 1}")
            if int(ptr[0]) != 0:
                raise InvalidBatchError(name, f"must start at 0, starts at {int(ptr[0])}")
            bad = _first(ptr[1:] < ptr[:-1])
            if bad is not None:
                raise InvalidBatchError(name, "must be non-decreasing", request=bad)
        if int(kv_indptr[-1]) > kv_indices.numel():
            raise InvalidBatchError(
                "kv_indptr",
                f"last value {int(kv_indptr[-1])} > len(kv_indices) = {kv_indices.numel()}",
            )
        q_lens = (qo[1:] - qo[:-1]).long()
        lens = kv_lens.long()
        bad = _first(lens < q_lens)
        if bad is not None:
            raise InvalidBatchError(
                "kv_lens",
                f"kv_len {int(lens[bad])} < q_len {int(q_lens[bad])}: the cache must hold the "
                "new tokens too",
                request=bad,
            )
        need = (lens + ps - 1) // ps
        bad = _first((kv_indptr[1:] - kv_indptr[:-1]).long() < need)
        if bad is not None:
            have = int(kv_indptr[bad + 1] - kv_indptr[bad])
            raise InvalidBatchError(
                "kv_lens",
                f"kv_len {int(lens[bad])} needs {int(need[bad])} pages of {ps} tokens, "
                f"kv_indptr gives {have}",
                request=bad,
            )
        max_page = -1
        if kv_indices.numel():
            lo = int(kv_indices.min())
            if lo < 0:
                req = (
                    int(
                        torch.searchsorted(
                            kv_indptr, int((kv_indices < 0).int().argmax()), right=True
                        )
                    )
                    - 1
                )
                raise InvalidBatchError(
                    "kv_indices", f"page index {lo} is negative", request=max(req, 0)
                )
            max_page = int(kv_indices.max())
        if batch.phase is Phase.DECODE:
            bad = _first(q_lens != 1)
            if bad is not None:
                raise InvalidBatchError(
                    "qo_indptr",
                    f"DECODE needs exactly one query per request, got {int(q_lens[bad])}",
                    request=bad,
                )
        mask = mask_indptr = None
        if batch.custom_mask is not None:
            mask = batch.custom_mask
            if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.dim() != 1:
                raise InvalidBatchError("custom_mask", "must be a flat 1-D torch.bool tensor")
            if mask.device.type != "cpu":
                raise InvalidBatchError(
                    "custom_mask", f"must be on the CPU, got device {str(mask.device)!r}"
                )
            mask = mask.clone(memory_format=torch.contiguous_format)
            mask_indptr = torch.zeros(b + 1, dtype=torch.int64)
            torch.cumsum(q_lens * lens, 0, out=mask_indptr[1:])
            if int(mask_indptr[-1]) != mask.numel():
                raise InvalidBatchError(
                    "custom_mask",
                    f"length {mask.numel()} != sum(q_len * kv_len) = {int(mask_indptr[-1])}",
                )
            given = getattr(batch, "mask_indptr", None)
            if given is not None and not torch.equal(given.cpu().long(), mask_indptr):
                raise InvalidBatchError(
                    "mask_indptr", "does not match the cumulative sum of q_len * kv_len"
                )
        items, merges, rows = self._make_plan(qo, kv_lens, causal=mask is None)
        scratch = None
        if rows:
            scratch = torch.empty(rows * self.v_head_dim + rows, dtype=torch.float32)
        t = NaProblem()
        t.q_dtype = _DTYPE_CODES[self.q_dtype]
        t.kv_dtype = _DTYPE_CODES[self.kv_dtype]
        t.kind = _NA_MLA if self.mla else _NA_MHA
        t.num_q_heads = cfg.num_q_heads
        t.num_kv_heads = cfg.num_kv_heads
        t.head_dim = cfg.head_dim
        t.v_head_dim = self.v_head_dim
        t.page_size = ps
        t.causal = 1 if mask is None else 0
        t.qo_indptr = qo.data_ptr()
        t.kv_indptr = kv_indptr.data_ptr()
        t.kv_indices = kv_indices.data_ptr() if kv_indices.numel() else None
        t.kv_lens = kv_lens.data_ptr()
        t.mask = mask.data_ptr() if mask is not None and mask.numel() else None
        t.mask_indptr = mask_indptr.data_ptr() if mask_indptr is not None else None
        t.items = items.data_ptr() if items.numel() else None
        t.num_items = items.shape[0]
        t.merges = merges.data_ptr() if merges.numel() else None
        t.num_merges = merges.shape[0]
        t.scratch = scratch.data_ptr() if scratch is not None else None
        t.scratch_rows = rows
        return NativePlan(
            batch=batch,
            num_tokens=int(qo[-1]),
            max_page=max_page,
            num_items=items.shape[0],
            num_merges=merges.shape[0],
            template=t,
            keep=(qo, kv_indptr, kv_lens, kv_indices, mask, mask_indptr, items, merges, scratch),
        )

    def _make_plan(
        self, qo: torch.Tensor, kv_lens: torch.Tensor, *, causal: bool
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        cfg = self.config
        target = max(SPLIT_FLOOR, 4 * self.threads())
        counts = [ctypes.c_int64(0) for _ in range(3)]
        items = torch.empty(0, ITEM_INTS, dtype=torch.int32)
        merges = torch.empty(0, MERGE_INTS, dtype=torch.int32)
        for _ in range(2):  # first pass counts, second fills
            rc = self.library.cdll.na_plan(
                kv_lens.numel(), qo.data_ptr(), kv_lens.data_ptr(), int(self.mla),
                cfg.num_q_heads, cfg.num_kv_heads, 1 if causal else 0, target,
                items.data_ptr() if items.numel() else None, items.shape[0],
                merges.data_ptr() if merges.numel() else None, merges.shape[0],
                *(ctypes.byref(c) for c in counts),
            )  # fmt: skip
            if rc != 0:
                raise InvalidBatchError(
                    "kv_lens", "the native planner rejected the batch (too large)"
                )
            n_items, n_merges, rows = (c.value for c in counts)
            if n_items <= items.shape[0] and n_merges <= merges.shape[0]:
                break
            items = torch.empty(n_items, ITEM_INTS, dtype=torch.int32)
            merges = torch.empty(n_merges, MERGE_INTS, dtype=torch.int32)
        return items, merges, rows

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
        if not isinstance(plan, NativePlan):
            raise InvalidBatchError(
                "plan",
                f"expected the NativePlan from NativeBackend.plan, got {type(plan).__name__}",
            )
        if plan.batch.phase is not phase:
            raise InvalidBatchError(
                "phase",
                f"the plan is for {plan.batch.phase.name}, this handler serves {phase.name}",
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
            pages = k_cache.shape[0]
        else:
            k_cache = self._check_tensor("k_cache", k_cache, self.kv_dtype, (None, ps, hkv, d))
            v_cache = self._check_tensor("v_cache", v_cache, self.kv_dtype, (None, ps, hkv, dv))
            pages = min(k_cache.shape[0], v_cache.shape[0])
        if plan.max_page >= pages:
            raise InvalidBatchError(
                "kv_indices",
                f"page index {plan.max_page} out of range for a cache of {pages} pages",
            )
        scale = float(sm_scale)
        if not math.isfinite(scale):
            raise InvalidBatchError("sm_scale", f"must be finite, got {sm_scale!r}")
        out = torch.empty((plan.num_tokens, hq, dv), dtype=self.q_dtype)
        if plan.num_items == 0:
            return out
        prob = NaProblem.from_buffer_copy(plan.template)
        prob.q = q.data_ptr()
        prob.k = k_cache.data_ptr()
        prob.v = None if self.mla else v_cache.data_ptr()
        prob.out = out.data_ptr()
        prob.sm_scale = scale
        prob.num_threads = self.threads()
        rc = self._run(ctypes.byref(prob))
        if rc != 0:
            if rc == -2:
                raise MemoryError("native attention: a per-thread buffer could not be allocated")
            raise RuntimeError(f"native attention kernel rejected its arguments (code {rc})")
        return out
