"""FlashInfer backend: adapters from attn_dispatch's paged-KV contract to FlashInfer.

Heavy module: imports torch and flashinfer. The registry imports it only at ``bind``,
after the capability checks in ``attn_dispatch.backends.flashinfer`` have passed.

Routes (one FlashInfer wrapper family each):

- MHA PREFILL, VERIFY: ``BatchPrefillWithPagedKVCacheWrapper``; causal (bottom-right)
  without a mask, ``custom_mask`` for a verify tree (its flat per-request
  ``[q_len, kv_len]`` row-major layout is exactly ours). Also MHA DECODE when
  ``head_dim != v_head_dim`` (the decode wrapper has a single head dim).
- MHA DECODE: ``BatchDecodeWithPagedKVCacheWrapper``, tensor cores for grouped-query
  attention with a group of 4 or more (or a group size its CUDA-core kernel lacks).
- MLA PREFILL, DECODE, VERIFY (causal chain): ``BatchMLAPagedAttentionWrapper`` planned
  with ``metadata=MLAPlanMetadata.csr(...)``; packed query ``[T, H, ckv+kpe]`` and packed
  latent cache ``[P, page_size, ckv+kpe]`` (our absorbed layout as is).

Variants: ``window_left`` and ``logit_cap`` go to the MHA plans as ``window_left`` (-1 = full)
and ``logits_soft_cap`` (0 = off); an FP8 cache plans with ``kv_data_type`` and runs with
``k_scale``/``v_scale`` (MHA) or, MLA e4m3fn on SM90, ``scale_mode="kv-per-tensor"`` and
``ckv_scale = kpe_scale = k_scale``. Sinks, and window / cap for MLA, are refused at bind (see
the light module's ``_check_variants``). ``causal=False`` plans prefill and verify with
``causal=False`` (MHA and MLA); ``attention_chunk_size`` is refused at bind.

Example (needs a CUDA GPU)::

    from attn_dispatch import AttnConfig, BackendSpec, bind
    cfg = AttnConfig(kind="mla", num_q_heads=16, num_kv_heads=1, head_dim=576,
                     v_head_dim=512, dtype="bfloat16", page_size=64, device="cuda")
    binding = bind(BackendSpec.uniform("flashinfer"), cfg)
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import flashinfer
import torch
from flashinfer.mla import BatchMLAPagedAttentionWrapper
from flashinfer.mla import MLAPlanMetadata

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import BackendUnavailableError
from attn_dispatch import IncompatibleBackendError
from attn_dispatch import InvalidBatchError
from attn_dispatch import InvalidSpecError
from attn_dispatch import Phase
from attn_dispatch._protocol import PlanBase
from attn_dispatch._protocol import check_plan
from attn_dispatch._protocol import issue_plan
from attn_dispatch.backends._common import BatchSnapshot
from attn_dispatch.backends._common import TensorChecks
from attn_dispatch.backends._common import window_flat_mask
from attn_dispatch.backends._torch_base import TorchBackendBase
from attn_dispatch.backends.flashinfer import CAPABILITIES

__all__ = ["WRAPPER_KEYWORDS", "FlashInferBackend", "FlashInferPlan"]

Handler = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", object, float], torch.Tensor]

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {
    **_DTYPES,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}

#: Group sizes FlashInfer's CUDA-core decode kernel is instantiated for
#: (DISPATCH_GQA_GROUP_SIZE in data/include/flashinfer/utils.cuh); others need tensor cores.
_CUDA_CORE_GROUP_SIZES = frozenset({1, 2, 3, 4, 6, 8, 16})

# Every keyword this module passes to a FlashInfer wrapper, per (wrapper, method). The
# adapter builds its calls from these sets (see _kw) and tests/test_flashinfer.py checks
# each against the installed signatures, so a renamed keyword fails a CPU test, not a
# GPU run.
WRAPPER_KEYWORDS: dict[tuple[str, str], frozenset[str]] = {
    ("BatchPrefillWithPagedKVCacheWrapper", "__init__"): frozenset(
        {
            "float_workspace_buffer",
            "kv_layout",
            "use_cuda_graph",
            "qo_indptr_buf",
            "paged_kv_indptr_buf",
            "paged_kv_indices_buf",
            "paged_kv_last_page_len_buf",
            "custom_mask_buf",
            "mask_indptr_buf",
            "backend",
        }
    ),
    ("BatchPrefillWithPagedKVCacheWrapper", "plan"): frozenset(
        {
            "qo_indptr",
            "paged_kv_indptr",
            "paged_kv_indices",
            "paged_kv_last_page_len",
            "num_qo_heads",
            "num_kv_heads",
            "head_dim_qk",
            "page_size",
            "head_dim_vo",
            "custom_mask",
            "causal",
            "sm_scale",
            "window_left",
            "logits_soft_cap",
            "q_data_type",
            "kv_data_type",
            "non_blocking",
        }
    ),
    ("BatchPrefillWithPagedKVCacheWrapper", "run"): frozenset(
        {"q", "paged_kv_cache", "k_scale", "v_scale"}
    ),
    ("BatchDecodeWithPagedKVCacheWrapper", "__init__"): frozenset(
        {
            "float_workspace_buffer",
            "kv_layout",
            "use_cuda_graph",
            "use_tensor_cores",
            "paged_kv_indptr_buffer",
            "paged_kv_indices_buffer",
            "paged_kv_last_page_len_buffer",
            "backend",
        }
    ),
    ("BatchDecodeWithPagedKVCacheWrapper", "plan"): frozenset(
        {
            "indptr",
            "indices",
            "last_page_len",
            "num_qo_heads",
            "num_kv_heads",
            "head_dim",
            "page_size",
            "q_data_type",
            "kv_data_type",
            "sm_scale",
            "window_left",
            "logits_soft_cap",
            "non_blocking",
        }
    ),
    ("BatchDecodeWithPagedKVCacheWrapper", "run"): frozenset(
        {"q", "paged_kv_cache", "k_scale", "v_scale"}
    ),
    ("BatchMLAPagedAttentionWrapper", "__init__"): frozenset(
        {
            "float_workspace_buffer",
            "use_cuda_graph",
            "qo_indptr",
            "kv_indptr",
            "kv_indices",
            "kv_len_arr",
            "backend",
        }
    ),
    ("BatchMLAPagedAttentionWrapper", "plan"): frozenset(
        {
            "metadata",
            "num_heads",
            "head_dim_ckv",
            "head_dim_kpe",
            "page_size",
            "causal",
            "sm_scale",
            "q_data_type",
            "kv_data_type",
            "query_layout",
            "kv_cache_layout",
            "scale_mode",
        }
    ),
    ("BatchMLAPagedAttentionWrapper", "run"): frozenset(
        {"query", "kv_cache", "ckv_scale", "kpe_scale"}
    ),
    ("MLAPlanMetadata", "csr"): frozenset({"qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"}),
}


def _kw(wrapper: str, method: str, **kwargs: Any) -> dict[str, Any]:
    """The keywords for one call, checked against WRAPPER_KEYWORDS (a typo here would
    otherwise only show on a GPU)."""
    allowed = WRAPPER_KEYWORDS[(wrapper, method)]
    unknown = set(kwargs) - allowed
    if unknown:  # pragma: no cover - programming error in this module
        raise AssertionError(f"{wrapper}.{method}: keywords {sorted(unknown)} not declared")
    return kwargs


@dataclass(frozen=True, slots=True, eq=False)
class FlashInferPlan(PlanBase):
    """What ``FlashInferBackend.plan`` returns: accepted only by the backend object in
    ``owner``, and only while its wrapper still holds this plan (a later ``plan`` of the
    same wrapper supersedes it). ``sm_scale`` is the scale FlashInfer baked in; a call with
    another scale is refused (FlashInfer cannot change it without re-planning)."""

    owner: FlashInferBackend
    snap: BatchSnapshot
    route: _Route
    wrapper: Any
    sm_scale: float
    ticket: object


@dataclass(frozen=True, slots=True)
class _PageTable:
    """FlashInfer's view of our page table: exactly ceil(kv_len / page_size) pages per
    request (FlashInfer derives kv_len from the page count and the last page's fill)."""

    qo_indptr: torch.Tensor  # host int32 [B+1]
    kv_indptr: torch.Tensor  # host int32 [B+1]
    kv_indices: torch.Tensor  # device int32
    kv_lens: torch.Tensor  # host int32 [B]
    last_page_len: torch.Tensor  # host int32 [B]


def _page_table(snap: BatchSnapshot, page_size: int, num_pages: int | None) -> _PageTable:
    """Build FlashInfer's page metadata on the host from the snapshot's host copies; never
    copies device to host. When a request holds more pages than its length needs (spare
    pages reserved ahead), the index list is compacted with one gather on the device.

    FlashInfer's kernels do not bound page indices: unless the snapshot checked them on the
    host, they are clamped on the device into ``[0, num_pages)`` (``[0, inf)`` when the pool
    size is unknown), so a bad index reads a wrong page of the cache, never outside it."""
    kv_lens = snap.kv_lens_host
    kv_indptr = snap.kv_indptr_host
    need = torch.div(kv_lens + (page_size - 1), page_size, rounding_mode="floor")
    have = kv_indptr[1:] - kv_indptr[:-1]
    indices = snap.kv_indices
    if snap.max_page is None:
        indices = indices.clamp(0, None if num_pages is None else num_pages - 1)
    if torch.equal(have, need):
        compact_indptr = kv_indptr
    else:
        compact_indptr = torch.zeros_like(kv_indptr)
        torch.cumsum(need, 0, out=compact_indptr[1:])
        total = int(compact_indptr[-1])
        starts = torch.repeat_interleave(kv_indptr[:-1].to(torch.int64), need.to(torch.int64))
        offsets = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(
            compact_indptr[:-1].to(torch.int64), need.to(torch.int64)
        )
        positions = starts + offsets
        if indices.is_cuda:
            positions = positions.pin_memory().to(indices.device, non_blocking=True)
        indices = indices.index_select(0, positions)
    last = torch.where(need > 0, kv_lens - (need - 1) * page_size, torch.zeros_like(kv_lens))
    return _PageTable(
        qo_indptr=snap.qo_indptr_host,
        kv_indptr=compact_indptr.contiguous(),
        kv_indices=indices.contiguous(),
        kv_lens=kv_lens,
        last_page_len=last.to(torch.int32).contiguous(),
    )


def _i32(n: int, device: torch.device) -> torch.Tensor:
    """A persistent int32 metadata buffer for a graph-mode wrapper."""
    return torch.zeros(n, dtype=torch.int32, device=device)


class _Route(abc.ABC):
    """One FlashInfer wrapper family serving one or more phases. Eager mode keeps one
    wrapper; CUDA-graph mode keeps one per batch size (FlashInfer fixes the batch size
    of a graph-mode wrapper), all sharing the backend's workspace and index buffers."""

    name = "route"

    def __init__(self, backend: FlashInferBackend) -> None:
        self.backend = backend
        self.config = backend.config
        self._eager: Any = None
        self._graph: dict[int, Any] = {}
        # id(wrapper) -> ticket of the plan it holds now (a wrapper keeps one plan at a time)
        self.tickets: dict[int, object] = {}

    def wrapper_for(self, batch: BatchSnapshot) -> Any:
        if not self.backend.use_cuda_graph:
            if self._eager is None:
                self._eager = self._make(None)
            return self._eager
        b = batch.num_requests
        if b > self.backend.max_batch_size:
            raise InvalidBatchError(
                "num_requests",
                f"flashinfer: {b} requests exceed max_batch_size="
                f"{self.backend.max_batch_size} of CUDA-graph mode; bind with a larger "
                "max_batch_size option",
            )
        if b not in self._graph:
            self._graph[b] = self._make(b)
        return self._graph[b]

    @abc.abstractmethod
    def _make(self, graph_batch: int | None) -> Any: ...

    @abc.abstractmethod
    def plan(
        self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float
    ) -> None: ...

    @abc.abstractmethod
    def run(
        self, wrapper: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None
    ) -> torch.Tensor: ...

    @abc.abstractmethod
    def run_scaled(
        self,
        wrapper: Any,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        """``run`` over an FP8 cache holding K / k_scale and V / v_scale."""


def _window(config: AttnConfig) -> int:
    # FlashInfer's window_left has our meaning (keys p - window_left ..= p); -1 = full.
    # FlashInfer holds it as int32: a window reaching past any int32 position is full.
    w = config.window_left
    return -1 if w is None or w >= 2**31 - 1 else int(w)


def _soft_cap(config: AttnConfig) -> float:
    # FlashInfer: logits_soft_cap * tanh(q.k * sm_scale / logits_soft_cap); 0 = off.
    cap = config.logit_cap
    return float(cap) if cap else 0.0


class _MHARoute(_Route):
    """The paged MHA wrappers (prefill and decode) run the same way per layer."""

    def run(
        self, wrapper: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None
    ) -> torch.Tensor:
        assert v_cache is not None
        # Per layer: a literal call, no keyword bookkeeping (names in WRAPPER_KEYWORDS).
        out: torch.Tensor = wrapper.run(q=q, paged_kv_cache=(k_cache, v_cache))
        return out

    def run_scaled(
        self,
        wrapper: Any,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        assert v_cache is not None
        # FlashInfer folds k_scale into sm_scale and multiplies the output by v_scale
        # (python floats: no host sync).
        out: torch.Tensor = wrapper.run(
            q=q, paged_kv_cache=(k_cache, v_cache), k_scale=k_scale, v_scale=v_scale
        )
        return out


class _PrefillRoute(_MHARoute):
    name = "BatchPrefillWithPagedKVCacheWrapper"

    def _make(self, graph_batch: int | None) -> Any:
        be = self.backend
        if graph_batch is None:
            kwargs = _kw(
                self.name,
                "__init__",
                float_workspace_buffer=be.workspace,
                kv_layout="NHD",
                backend=be.prefill_backend,
            )
        else:
            dev = be.device
            kwargs = _kw(
                self.name,
                "__init__",
                float_workspace_buffer=be.workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                qo_indptr_buf=_i32(graph_batch + 1, dev),
                paged_kv_indptr_buf=_i32(graph_batch + 1, dev),
                paged_kv_indices_buf=be.graph_indices,
                paged_kv_last_page_len_buf=_i32(graph_batch, dev),
                custom_mask_buf=be.graph_mask if self.config.tree_verify else None,
                mask_indptr_buf=_i32(graph_batch + 1, dev) if self.config.tree_verify else None,
                backend=be.prefill_backend,
            )
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(**kwargs)

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float) -> None:
        cfg = self.config
        mask = batch.custom_mask
        window = _window(cfg)
        if mask is not None and window >= 0:
            # FlashInfer windows a masked row by position; our contract windows a draft node's
            # own sequence (the last window_left + 1 keys its mask allows): fold that into the
            # mask (device ops, once per plan) and plan no positional window.
            q_lens = (batch.qo_indptr_host[1:] - batch.qo_indptr_host[:-1]).tolist()
            mask = window_flat_mask(mask, q_lens, batch.kv_lens_host.tolist(), window)
            window = -1
        wrapper.plan(
            **_kw(
                self.name,
                "plan",
                qo_indptr=table.qo_indptr,
                paged_kv_indptr=table.kv_indptr,
                paged_kv_indices=table.kv_indices,
                paged_kv_last_page_len=table.last_page_len,
                num_qo_heads=cfg.num_q_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim_qk=cfg.head_dim,
                head_dim_vo=cfg.v_head_dim,
                page_size=cfg.page_size,
                custom_mask=None if mask is None else mask.reshape(-1),
                # causal=False (encoder layers): every key of the request, FlashInfer's own
                # non-causal prefill.
                causal=mask is None and cfg.causal,
                sm_scale=sm_scale,
                window_left=window,
                logits_soft_cap=_soft_cap(cfg),
                q_data_type=self.backend.q_dtype,
                kv_data_type=self.backend.kv_dtype,
                non_blocking=True,
            )
        )


class _DecodeRoute(_MHARoute):
    name = "BatchDecodeWithPagedKVCacheWrapper"

    def __init__(self, backend: FlashInferBackend) -> None:
        super().__init__(backend)
        group = self.config.num_q_heads // self.config.num_kv_heads
        chosen = backend.decode_tensor_cores
        # Tensor cores pay off once several query heads share a KV head (SGLang and
        # FlashInfer's own guidance), and are required for group sizes the CUDA-core
        # kernel is not built for.
        self.use_tensor_cores = (
            chosen if chosen is not None else (group >= 4 or group not in _CUDA_CORE_GROUP_SIZES)
        )
        if not self.use_tensor_cores and group not in _CUDA_CORE_GROUP_SIZES:
            raise InvalidSpecError(
                "decode_tensor_cores",
                chosen,
                f"flashinfer's CUDA-core decode kernel is built for GQA groups "
                f"{sorted(_CUDA_CORE_GROUP_SIZES)}, this config has {group}; leave the "
                "option unset (tensor cores are chosen) or choose another backend",
            )

    def _make(self, graph_batch: int | None) -> Any:
        be = self.backend
        if graph_batch is None:
            kwargs = _kw(
                self.name,
                "__init__",
                float_workspace_buffer=be.workspace,
                kv_layout="NHD",
                use_tensor_cores=self.use_tensor_cores,
                backend=be.decode_backend,
            )
        else:
            dev = be.device
            kwargs = _kw(
                self.name,
                "__init__",
                float_workspace_buffer=be.workspace,
                kv_layout="NHD",
                use_cuda_graph=True,
                use_tensor_cores=self.use_tensor_cores,
                paged_kv_indptr_buffer=_i32(graph_batch + 1, dev),
                paged_kv_indices_buffer=be.graph_indices,
                paged_kv_last_page_len_buffer=_i32(graph_batch, dev),
                backend=be.decode_backend,
            )
        return flashinfer.BatchDecodeWithPagedKVCacheWrapper(**kwargs)

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float) -> None:
        cfg = self.config
        wrapper.plan(
            **_kw(
                self.name,
                "plan",
                indptr=table.kv_indptr,
                indices=table.kv_indices,
                last_page_len=table.last_page_len,
                num_qo_heads=cfg.num_q_heads,
                num_kv_heads=cfg.num_kv_heads,
                head_dim=cfg.head_dim,
                page_size=cfg.page_size,
                q_data_type=self.backend.q_dtype,
                kv_data_type=self.backend.kv_dtype,
                sm_scale=sm_scale,
                window_left=_window(cfg),
                logits_soft_cap=_soft_cap(cfg),
                non_blocking=True,
            )
        )


class _MLARoute(_Route):
    name = "BatchMLAPagedAttentionWrapper"

    def __init__(self, backend: FlashInferBackend, *, causal: bool) -> None:
        super().__init__(backend)
        self.causal = causal
        assert self.config.v_head_dim is not None  # filled by AttnConfig
        self.ckv = self.config.v_head_dim

    def _make(self, graph_batch: int | None) -> Any:
        be = self.backend
        if graph_batch is None:
            kwargs = _kw(
                self.name,
                "__init__",
                float_workspace_buffer=be.workspace,
                backend=be.mla_backend,
            )
        else:
            dev = be.device
            kwargs = _kw(
                self.name,
                "__init__",
                float_workspace_buffer=be.workspace,
                use_cuda_graph=True,
                qo_indptr=_i32(graph_batch + 1, dev),
                kv_indptr=_i32(graph_batch + 1, dev),
                kv_indices=be.graph_indices,
                kv_len_arr=_i32(graph_batch, dev),
                backend=be.mla_backend,
            )
        return BatchMLAPagedAttentionWrapper(**kwargs)

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: _PageTable, sm_scale: float) -> None:
        cfg = self.config
        metadata = MLAPlanMetadata.csr(
            **_kw(
                "MLAPlanMetadata",
                "csr",
                qo_indptr=table.qo_indptr,
                kv_indptr=table.kv_indptr,
                kv_indices=table.kv_indices,
                kv_len_arr=table.kv_lens,
            )
        )
        # An FP8 latent cache is dequantised per tensor (ckv_scale / kpe_scale at run).
        fp8 = {"scale_mode": "kv-per-tensor"} if self.backend.kv_fp8 else {}
        wrapper.plan(
            **_kw(
                self.name,
                "plan",
                **fp8,
                metadata=metadata,
                num_heads=cfg.num_q_heads,
                head_dim_ckv=self.ckv,
                head_dim_kpe=cfg.head_dim - self.ckv,
                page_size=cfg.page_size,
                # A single query token sees every key: planning it non-causal keeps it
                # clear of the causal tile-boundary rule (see the light module).
                causal=self.causal and batch.max_q_len > 1,
                sm_scale=sm_scale,
                q_data_type=self.backend.q_dtype,
                kv_data_type=self.backend.kv_dtype,
                query_layout="packed",
                kv_cache_layout="packed",
            )
        )

    def run(
        self, wrapper: Any, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None
    ) -> torch.Tensor:
        # Our absorbed layout is FlashInfer's packed layout: q [T, H, ckv+kpe] and cache
        # [P, page_size, ckv+kpe]; V is the first ckv columns of the same cache.
        out: torch.Tensor = wrapper.run(query=q, kv_cache=k_cache)
        return out

    def run_scaled(
        self,
        wrapper: Any,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        k_scale: float,
        v_scale: float,
    ) -> torch.Tensor:
        # Our k_scale covers the whole latent row: both the ckv part (which is V too) and
        # the rope part.
        out: torch.Tensor = wrapper.run(
            query=q, kv_cache=k_cache, ckv_scale=k_scale, kpe_scale=k_scale
        )
        return out


def _check_config(config: AttnConfig) -> None:
    """Refuse a config FlashInfer cannot serve in any phase (machine, install, dtype,
    dims). ``bind`` has checked the bound phases already; this guards direct
    construction. Phase-specific reasons are checked when a phase's handler is built."""
    per_phase = [CAPABILITIES.reasons(config, p) for p in Phase]
    common = [r for r in per_phase[0] if all(r in other for other in per_phase[1:])]
    if common:
        raise BackendUnavailableError("flashinfer", f"cannot run {config!r}: " + "; ".join(common))


def _check_phase(config: AttnConfig, phase: Phase) -> None:
    reasons = CAPABILITIES.reasons(config, phase)
    if reasons:
        raise IncompatibleBackendError(None, {phase: ("flashinfer", reasons)}, config=config)


def _device_for(config: AttnConfig) -> torch.device:
    return torch.device(config.device)


class FlashInferBackend(TorchBackendBase):
    """Attention through FlashInfer's paged wrappers, for one model runner.

    Owns its workspace (one per runner, never shared: two runners planning into one
    workspace would overwrite each other's schedule) and its wrappers.

    Options:
      use_cuda_graph: keep persistent index buffers and one graph-mode wrapper per batch
        size, so ``run`` can be captured and replayed; ``plan`` is never captured.
      max_batch_size, max_num_pages: sizes of those persistent buffers (graph mode).
      max_mask_bytes: bytes of the packed verify-tree mask buffer (graph mode, MHA).
      workspace_bytes: float workspace size (default 128 MiB, FlashInfer's advice).
      sm_scale: the softmax scale to plan with (default: the config's ``sm_scale``, else
        1/sqrt(head_dim)). FlashInfer fixes the scale at ``plan``, so a call passing another
        scale is refused with ``InvalidBatchError`` (field ``sm_scale``), never re-planned
        inside the layer loop.
      validate: read the batch's device index tensors back at plan time and check them on
        the host (a device sync per forward; for debugging). Without it, page indices are
        clamped into the cache on the device (FlashInfer's kernels do not bound them).
      prefill_backend, decode_backend, mla_backend: FlashInfer's own backend names
        (default "auto": FlashInfer picks among the kernels that serve the plan).
      decode_tensor_cores: force tensor-core decode on or off (default: GQA group >= 4).

    >>> import torch; torch.cuda.is_available() or print("needs CUDA")  # doctest: +SKIP
    """

    name = "flashinfer"

    def __init__(
        self,
        config: AttnConfig,
        *,
        use_cuda_graph: bool = False,
        max_batch_size: int = 256,
        max_num_pages: int | None = None,
        max_mask_bytes: int = 16 << 20,
        workspace_bytes: int = 128 << 20,
        sm_scale: float | None = None,
        prefill_backend: str = "auto",
        decode_backend: str = "auto",
        mla_backend: str = "auto",
        decode_tensor_cores: bool | None = None,
        validate: bool = False,
    ) -> None:
        _check_config(config)
        self.config = config
        self.device = _device_for(config)
        self.q_dtype = _DTYPES[config.dtype]
        self.kv_dtype = _KV_DTYPES[config.kv_dtype or config.dtype]
        self.kv_fp8 = self.kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.use_cuda_graph = use_cuda_graph
        self.max_batch_size = max_batch_size
        self.prefill_backend = prefill_backend
        self.decode_backend = decode_backend
        self.mla_backend = mla_backend
        self.decode_tensor_cores = decode_tensor_cores
        # zeros, not empty: FlashInfer asks for a zeroed float workspace on first use.
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=self.device)
        # Graph mode: plan() refills the persistent buffers of one wrapper per batch size,
        # so a captured graph follows each new plan (cuda_graph reads this flag).
        self.plans_in_place = use_cuda_graph
        self.graph_indices: torch.Tensor | None = None
        self.graph_mask: torch.Tensor | None = None
        if use_cuda_graph:
            if max_num_pages is None:
                raise InvalidSpecError(
                    "max_num_pages",
                    None,
                    "flashinfer with use_cuda_graph=True needs the capacity of its persistent "
                    "kv_indices buffer, e.g. the KV pool's page count",
                )
            # One index buffer shared by every graph-mode wrapper of this runner: only
            # one forward plans at a time, and each captured graph reads the buffer its
            # plan refilled.
            self.graph_indices = torch.zeros(max_num_pages, dtype=torch.int32, device=self.device)
            if config.tree_verify:
                self.graph_mask = torch.zeros(max_mask_bytes, dtype=torch.uint8, device=self.device)
        planned = config.sm_scale
        if sm_scale is not None and planned is not None and sm_scale != planned:
            raise InvalidSpecError(
                "sm_scale",
                sm_scale,
                f"differs from the config's sm_scale={planned!r}; give the scale once, in "
                "AttnConfig(sm_scale=...)",
            )
        chosen = sm_scale if sm_scale is not None else planned
        self.sm_scale: float = (
            float(chosen) if chosen is not None else 1.0 / math.sqrt(config.head_dim)
        )
        self.validate = bool(validate)
        self.max_num_pages = max_num_pages
        self._checks = TensorChecks.of(
            config,
            backend="flashinfer",
            layout="rows",
            q_dtype=self.q_dtype,
            kv_dtype=self.kv_dtype,
            device_type=self.device.type,
        )
        self._routes: dict[Phase, _Route] = {}

    # -- routes ------------------------------------------------------------------------

    def _route(self, phase: Phase) -> _Route:
        route = self._routes.get(phase)
        if route is None:
            route = self._make_route(phase)
            self._routes[phase] = route
        return route

    def _make_route(self, phase: Phase) -> _Route:
        cfg = self.config
        if cfg.kind == "mla":
            # Prefill and verify share one causal wrapper (one plan per forward anyway).
            if phase is not Phase.DECODE:
                for other, r in self._routes.items():
                    if other is not Phase.DECODE:
                        return r
            return _MLARoute(self, causal=phase is not Phase.DECODE and cfg.causal)
        if phase is Phase.DECODE and cfg.head_dim == cfg.v_head_dim:
            return _DecodeRoute(self)
        for r in self._routes.values():
            if isinstance(r, _PrefillRoute):
                return r
        return _PrefillRoute(self)

    # -- protocol ----------------------------------------------------------------------

    def plan(self, batch: AttnBatch) -> FlashInferPlan:
        """Plan the wrapper serving ``batch.phase``: once per forward, host metadata only.

        FlashInfer bakes the softmax scale into its plan: ``self.sm_scale`` (the config's).
        The batch is copied and checked first (``_common.BatchSnapshot``); a later edit of
        its tensors never reaches FlashInfer.
        """
        if batch.phase is Phase.VERIFY and batch.custom_mask is not None:
            if self.config.kind == "mla":
                raise InvalidBatchError(
                    "custom_mask",
                    "flashinfer MLA has no custom mask (bind verify to 'triton' or 'torch' "
                    "for tree verify)",
                )
        snap = BatchSnapshot.of(batch, self.config.page_size, check_device=self.validate)
        route = self._route(snap.phase)
        wrapper = route.wrapper_for(snap)
        table = _page_table(snap, self.config.page_size, self.max_num_pages)
        scale = self.sm_scale
        try:
            route.plan(wrapper, snap, table, scale)
        except ValueError as exc:
            if isinstance(exc, InvalidBatchError):
                raise
            raise InvalidBatchError(
                "batch",
                f"flashinfer {route.name}.plan refused this {snap.phase.name} batch "
                f"({snap.num_requests} requests, {snap.num_tokens} tokens, max kv "
                f"{snap.max_kv_len}): {exc}",
            ) from exc
        ticket = object()
        route.tickets[id(wrapper)] = ticket
        plan = FlashInferPlan(
            owner=self, snap=snap, route=route, wrapper=wrapper, sm_scale=scale, ticket=ticket
        )
        return issue_plan(self, plan)

    def handler(self, phase: Phase) -> Handler:
        """The per-layer callable for ``phase``; builds its route now (bind time)."""
        _check_phase(self.config, phase)
        self._route(phase)
        return self._run

    def _run(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor | None,
        plan: object,
        sm_scale: float,
        *,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ) -> torch.Tensor:
        check_plan(plan, self, "flashinfer")
        assert isinstance(plan, FlashInferPlan)
        if plan.route.tickets.get(id(plan.wrapper)) is not plan.ticket:
            raise InvalidBatchError(
                "plan",
                "flashinfer: this plan was superseded: a later plan() re-planned the same "
                "FlashInfer wrapper (one plan per forward; use the scope's current plan)",
            )
        self._checks.check(plan.snap, q, k_cache, v_cache)
        if sm_scale != plan.sm_scale and not math.isclose(sm_scale, plan.sm_scale, rel_tol=1e-6):
            raise InvalidBatchError(
                "sm_scale",
                f"flashinfer: {sm_scale!r} differs from the planned {plan.sm_scale!r}; FlashInfer "
                "bakes the scale in at plan time: bind with AttnConfig(sm_scale=...) equal to "
                "the scale the model passes",
            )
        if (k_scale is not None or v_scale is not None) and not self.kv_fp8:
            raise InvalidBatchError(
                "k_scale" if k_scale is not None else "v_scale",
                f"flashinfer: a scale was passed but the bound config's kv_dtype is "
                f"{self.config.kv_dtype!r}, not FP8",
            )
        if plan.snap.num_requests == 0:  # SGLang's IDLE forward: nothing to launch
            return q.new_empty((0, self.config.num_q_heads, self.config.out_head_dim))
        if self.kv_fp8:
            ks = 1.0 if k_scale is None else float(k_scale)
            vs = 1.0 if v_scale is None else float(v_scale)
            return plan.route.run_scaled(plan.wrapper, q, k_cache, v_cache, ks, vs)
        return plan.route.run(plan.wrapper, q, k_cache, v_cache)
