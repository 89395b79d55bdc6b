"""The FlashInfer wrapper families the backend plans and runs, one route each: paged prefill
(and verify, and decode with two head dims), paged decode, the two-level cascade, and MLA.

Eager mode keeps one wrapper per route; CUDA-graph mode one per batch size (FlashInfer fixes
the batch size of a graph-mode wrapper). The wrapper classes are looked up on the ``flashinfer``
modules at each construction (tests substitute them).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from collections.abc import Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING
from typing import Any
from typing import cast

import flashinfer
import flashinfer.mla
import torch
from flashinfer.mla import MLAPlanMetadata

from attn_dispatch.backend import AttnConfig
from attn_dispatch.backend import BatchSnapshot
from attn_dispatch.backend import InvalidBatchError
from attn_dispatch.backend import InvalidSpecError
from attn_dispatch.backend import window_flat_mask
from attn_dispatch.backends.flashinfer._keywords import kw as _kw
from attn_dispatch.backends.flashinfer._tables import PageTable

if TYPE_CHECKING:
    from attn_dispatch.backends.flashinfer.backend import FlashInferBackend

__all__ = ["NO_EXTRA", "CascadeRoute", "DecodeRoute", "MLARoute", "PrefillRoute", "Route"]

Tensor = torch.Tensor
Kw = Mapping[str, Any]

#: (DISPATCH_GQA_GROUP_SIZE in data/include/flashinfer/utils.cuh); others need tensor cores.
_CUDA_CORE_GROUP_SIZES = frozenset({1, 2, 3, 4, 6, 8, 16})

#: ln 2: a base-2 log-sum-exp times this is the natural one.
_LN2 = math.log(2.0)


def _i32(n: int, device: torch.device) -> torch.Tensor:
    """A persistent int32 metadata buffer for a graph-mode wrapper."""
    return torch.zeros(n, dtype=torch.int32, device=device)


def _window(config: AttnConfig) -> int:
    # FlashInfer's window_left has our meaning (keys p - window_left ..= p); -1 = full.
    # FlashInfer holds it as int32: a window reaching past any int32 position is full.
    w = config.window_left
    return -1 if w is None or w >= 2**31 - 1 else int(w)


def _soft_cap(config: AttnConfig) -> float:
    # FlashInfer: logits_soft_cap * tanh(q.k * sm_scale / logits_soft_cap); 0 = off.
    cap = config.logit_cap
    return float(cap) if cap else 0.0


class Route(abc.ABC):
    """One FlashInfer wrapper family serving one or more phases. Eager mode keeps one
    wrapper; CUDA-graph mode keeps one per batch size (FlashInfer fixes the batch size
    of a graph-mode wrapper), all sharing the backend's workspace and index buffers.

    ``lse_keywords`` make the wrapper's ``run`` return ``(out, lse)``; ``lse_factor`` turns
    that lse into a natural log (None: it is one already)."""

    name = "route"
    lse_keywords: Kw = MappingProxyType({"return_lse": True})
    lse_factor: float | None = None
    # The wrapper's run writes a caller's ``out=`` buffer (the cascade wrapper's takes none).
    takes_out = True

    def __init__(self, backend: FlashInferBackend) -> None:
        self.backend = backend
        self.config = backend.config
        self._eager: Any = None
        self._graph: dict[int, Any] = {}
        # id(wrapper) -> ticket of the plan it holds now (a wrapper keeps one plan at a time)
        self.tickets: dict[int, object] = {}
        # run() returns (out, lse) on every call (a wrapper planned for one lse mode)
        self.always_lse = False

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

    def _make(self, graph_batch: int | None) -> Any:
        kwargs: dict[str, Any] = {"float_workspace_buffer": self.backend.workspace}
        kwargs.update(self._options())
        if graph_batch is not None:
            kwargs.update(use_cuda_graph=True, **self._graph_buffers(graph_batch))
        return self._wrapper_class()(**_kw(self.name, "__init__", **kwargs))

    @abc.abstractmethod
    def _wrapper_class(self) -> Callable[..., Any]:
        """The FlashInfer class (looked up at each construction: tests substitute it)."""

    @abc.abstractmethod
    def _options(self) -> dict[str, Any]:
        """Constructor keywords besides the workspace, in both modes."""

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        """Constructor keywords of graph mode: persistent metadata buffers."""
        raise AssertionError(f"{self.name} has no CUDA-graph mode here")  # pragma: no cover

    #: The names a paged MHA wrapper's plan gives (kv_indptr, kv_indices, last_page_len).
    table_keywords = ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len")

    def _plan_mha(
        self, wrapper: Any, sm_scale: float, table: PageTable | None, **kwargs: Any
    ) -> None:
        """``wrapper.plan`` with ``kwargs`` and the keywords every MHA wrapper takes alike;
        with ``table``, its pages under ``table_keywords``, copied without blocking."""
        cfg = self.config
        if table is not None:
            pages = (table.kv_indptr, table.kv_indices, table.last_page_len)
            kwargs.update(zip(self.table_keywords, pages, strict=True), non_blocking=True)
        common = {
            "num_qo_heads": cfg.num_q_heads,
            "num_kv_heads": cfg.num_kv_heads,
            "page_size": cfg.page_size,
            "sm_scale": sm_scale,
            "logits_soft_cap": _soft_cap(cfg),
            "q_data_type": self.backend.q_dtype,
            "kv_data_type": self.backend.kv_dtype,
        }
        wrapper.plan(**_kw(self.name, "plan", **common, **kwargs))

    @abc.abstractmethod
    def plan(
        self, wrapper: Any, batch: BatchSnapshot, table: PageTable, sm_scale: float
    ) -> None: ...

    def run(self, wrapper: Any, q: Tensor, k: Tensor, v: Tensor | None, extra: Kw) -> Any:
        """The wrapper's ``run`` with ``extra`` keywords (scales, lse): the output, or
        ``(out, lse)`` when ``extra`` holds ``lse_keywords``. Per layer: one literal call."""
        return wrapper.run(**self.inputs(q, k, v), **extra)

    @abc.abstractmethod
    def inputs(self, q: Tensor, k: Tensor, v: Tensor | None) -> dict[str, Any]:
        """The query and cache keywords of the wrapper's ``run``."""

    def scale_keywords(self, k_scale: float, v_scale: float) -> dict[str, Any]:
        """``run`` keywords for an FP8 cache holding K / k_scale and V / v_scale. FlashInfer
        folds k_scale into sm_scale and multiplies the output by v_scale (python floats: no
        host sync)."""
        return {"k_scale": k_scale, "v_scale": v_scale}


NO_EXTRA: Kw = MappingProxyType({})


class MHARoute(Route):
    """The paged MHA wrappers take the same inputs."""

    def inputs(self, q: Tensor, k: Tensor, v: Tensor | None) -> dict[str, Any]:
        assert v is not None
        return {"q": q, "paged_kv_cache": (k, v)}


class PrefillRoute(MHARoute):
    name = "BatchPrefillWithPagedKVCacheWrapper"
    # FlashInfer converts its base-2 lse itself (prefill.py: _finish_lse).
    lse_keywords = MappingProxyType({"return_lse": True, "lse_base": "ln"})

    def _wrapper_class(self) -> Callable[..., Any]:
        return cast("Callable[..., Any]", flashinfer.BatchPrefillWithPagedKVCacheWrapper)

    def _options(self) -> dict[str, Any]:
        return {"kv_layout": "NHD", "backend": self.backend.prefill_backend}

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        be, dev, tree = self.backend, self.backend.device, self.config.tree_verify
        return {
            "qo_indptr_buf": _i32(graph_batch + 1, dev),
            "paged_kv_indptr_buf": _i32(graph_batch + 1, dev),
            "paged_kv_indices_buf": be.graph_indices,
            "paged_kv_last_page_len_buf": _i32(graph_batch, dev),
            "custom_mask_buf": be.graph_mask if tree else None,
            "mask_indptr_buf": _i32(graph_batch + 1, dev) if tree else None,
        }

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: PageTable, sm_scale: float) -> None:
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
        self._plan_mha(
            wrapper,
            sm_scale,
            table,
            qo_indptr=table.qo_indptr,
            head_dim_qk=cfg.head_dim,
            head_dim_vo=cfg.v_head_dim,
            custom_mask=None if mask is None else mask.reshape(-1),
            # causal=False (encoder layers): every key of the request, FlashInfer's own
            # non-causal prefill.
            causal=mask is None and cfg.causal,
            window_left=window,
        )


class DecodeRoute(MHARoute):
    name = "BatchDecodeWithPagedKVCacheWrapper"
    table_keywords = ("indptr", "indices", "last_page_len")
    # Its run() has no lse_base: every backend it runs returns base 2 (cudnn/decode.py converts
    # cuDNN's natural-log stats to base 2 "like every other FlashInfer backend").
    lse_factor = _LN2

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

    def _wrapper_class(self) -> Callable[..., Any]:
        return cast("Callable[..., Any]", flashinfer.BatchDecodeWithPagedKVCacheWrapper)

    def _options(self) -> dict[str, Any]:
        return {
            "kv_layout": "NHD",
            "use_tensor_cores": self.use_tensor_cores,
            "backend": self.backend.decode_backend,
        }

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        dev = self.backend.device
        return {
            "paged_kv_indptr_buffer": _i32(graph_batch + 1, dev),
            "paged_kv_indices_buffer": self.backend.graph_indices,
            "paged_kv_last_page_len_buffer": _i32(graph_batch, dev),
        }

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: PageTable, sm_scale: float) -> None:
        cfg = self.config
        self._plan_mha(wrapper, sm_scale, table, head_dim=cfg.head_dim, window_left=_window(cfg))


class CascadeRoute(MHARoute):
    """Two levels through ``MultiLevelCascadeAttentionWrapper``: level 0 the shared pages of
    each group (non-causal: every query of the group lies after them), level 1 each request's
    own pages (causal as configured). Eager mode only; its ``run`` takes no scales and returns
    no lse, so FP8 and ``return_lse`` configs never cascade (``FlashInferBackend._cascade``)."""

    name = "MultiLevelCascadeAttentionWrapper"
    takes_out = False

    def _wrapper_class(self) -> Callable[..., Any]:
        return cast("Callable[..., Any]", flashinfer.MultiLevelCascadeAttentionWrapper)

    def _options(self) -> dict[str, Any]:
        return {"num_levels": 2, "kv_layout": "NHD"}

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: PageTable, sm_scale: float) -> None:
        levels = table.levels
        assert levels is not None
        self._plan_mha(
            wrapper,
            sm_scale,
            None,
            qo_indptr_arr=list(levels.qo_indptr),
            paged_kv_indptr_arr=list(levels.kv_indptr),
            paged_kv_indices_arr=list(levels.kv_indices),
            paged_kv_last_page_len=list(levels.last_page_len),
            head_dim=self.config.head_dim,
            causal=self.config.causal,
        )


class MLARoute(Route):
    name = "BatchMLAPagedAttentionWrapper"
    lse_keywords = MappingProxyType({"return_lse": True, "return_lse_base_on_e": True})

    def __init__(self, backend: FlashInferBackend, *, causal: bool) -> None:
        super().__init__(backend)
        self.causal = causal
        assert self.config.v_head_dim is not None  # filled by AttnConfig
        self.ckv = self.config.v_head_dim
        # FlashInfer fixes the lse mode at plan and refuses a run asking another
        # (_contracts.py: validate_run_options), so a config that may ask plans for it and
        # every run returns it.
        self.always_lse = backend.lse

    def _wrapper_class(self) -> Callable[..., Any]:
        return cast("Callable[..., Any]", flashinfer.mla.BatchMLAPagedAttentionWrapper)

    def _options(self) -> dict[str, Any]:
        return {"backend": self.backend.mla_backend}

    def _graph_buffers(self, graph_batch: int) -> dict[str, Any]:
        dev = self.backend.device
        return {
            "qo_indptr": _i32(graph_batch + 1, dev),
            "kv_indptr": _i32(graph_batch + 1, dev),
            "kv_indices": self.backend.graph_indices,
            "kv_len_arr": _i32(graph_batch, dev),
        }

    def plan(self, wrapper: Any, batch: BatchSnapshot, table: PageTable, sm_scale: float) -> None:
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
        extra: dict[str, Any] = {"scale_mode": "kv-per-tensor"} if self.backend.kv_fp8 else {}
        if self.always_lse:
            extra["lse_mode"] = "basee"
        wrapper.plan(
            **_kw(
                self.name,
                "plan",
                **extra,
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

    def inputs(self, q: Tensor, k: Tensor, v: Tensor | None) -> dict[str, Any]:
        # Our absorbed layout is FlashInfer's packed layout: q [T, H, ckv+kpe] and cache
        # [P, page_size, ckv+kpe]; V is the first ckv columns of the same cache.
        return {"query": q, "kv_cache": k}

    def scale_keywords(self, k_scale: float, v_scale: float) -> dict[str, Any]:
        # Our k_scale covers the whole latent row: both the ckv part (which is V too) and
        # the rope part.
        return {"ckv_scale": k_scale, "kpe_scale": k_scale}
