"""The vLLM classes behind ``attn_dispatch.integrations.vllm`` (imports vLLM and torch).

``AttnDispatchCPUBackend`` is what vLLM's CPU platform loads for CPU_ATTN once the plugin ran.
Its impl and metadata builder subclass vLLM's CPU ones and hand every call to them unless the
engine's ``additional_config`` has ``"attn_dispatch"``; when it has, they:

- bind at construction (model load, i.e. engine start-up): each attention layer's
  ``AttnConfig`` (heads, head size, dtype, KV dtype, block size, scale, window, soft-cap, sinks)
  against its runner's spec, through one ``Binding`` per runner and config, labelled
  ``"target"`` or ``"draft"``. What the integration cannot serve (ALiBi, encoder attention,
  other KV formats, ...) and what the spec's backends cannot serve fail there, with every reason.
- build one ``AttnBatch`` per phase (or one for the step, ``"mixed": "extend"``) when vLLM
  builds the step's metadata; each binding plans it once per forward, at its first layer.
- run every layer's attention inside ``attn_scope(binding, batch, prepared=plan)``: the
  runner's own backend for the phase, whatever other runners chose.

KV cache: vLLM hands each layer a tensor of ``[blocks, kv_heads, block_size, 2 * head_size]``
whose inner layout its own kernels define per ISA. Each block's bytes are used here as two
pages of the attn_dispatch contract, ``[block_size, kv_heads, head_size]`` K then V: over the
layer's memory seen as ``2 * blocks`` pages, K of block b is page ``2b`` and V of block b is
page ``2b + 1``, so ``k_cache`` (pages ``0 ..``) and ``v_cache`` (the same memory shifted by one
page) are contiguous tensors read with page indices ``2 * block_id``. No copy, and a block's
bytes stay its own (vLLM zeroes whole blocks when it hands them out).

The module holds the three vLLM subclasses; what they use lives beside it: ``_runners`` (which
runner builds a layer), ``_layers`` (a layer's config and binding, the engine's state),
``_metadata`` and ``_steps`` (a step's batches and plans), ``_dcp`` (decode context parallel)
and ``_ranks`` (agreement across ranks, the workers' tables).
"""

from __future__ import annotations

from typing import Any

import torch
from vllm import forward_context as _forward_context
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import UnsupportedModelError
from attn_dispatch._scope import attention
from attn_dispatch.backends.native.kv_write import KvCaches
from attn_dispatch.backends.native.kv_write import KvWrite
from attn_dispatch.backends.native.kv_write import kv_writer
from attn_dispatch.integrations.vllm._dcp import forward_dcp
from attn_dispatch.integrations.vllm._layers import FP8_MAX
from attn_dispatch.integrations.vllm._layers import EngineState
from attn_dispatch.integrations.vllm._layers import LayerDispatch
from attn_dispatch.integrations.vllm._layers import engine_state
from attn_dispatch.integrations.vllm._layers import layer_config
from attn_dispatch.integrations.vllm._layers import make_dispatch
from attn_dispatch.integrations.vllm._metadata import DispatchMetadata
from attn_dispatch.integrations.vllm._metadata import kv_rows
from attn_dispatch.integrations.vllm._ranks import agree_across_ranks
from attn_dispatch.integrations.vllm._ranks import bindings_of_layers
from attn_dispatch.integrations.vllm._runners import check_draft_key
from attn_dispatch.integrations.vllm._runners import check_draft_layer_names
from attn_dispatch.integrations.vllm._runners import runner_of
from attn_dispatch.integrations.vllm._settings import DRAFT
from attn_dispatch.integrations.vllm._settings import TARGET
from attn_dispatch.integrations.vllm._settings import Settings
from attn_dispatch.integrations.vllm._settings import settings_of

#: The native KV write (``kv_writer``), once looked up: empty until the first write.
_KV_WRITE: list[KvWrite | None] = []


def _kv_write() -> KvWrite | None:
    """The native library's KV write, or None when it is not built (the torch path then)."""
    if not _KV_WRITE:
        _KV_WRITE.append(kv_writer())
    return _KV_WRITE[0]


#: The keywords of a layer without sinks or FP8 scales (never written).
_NO_EXTRAS: dict[str, Any] = {}


def _step_metadata(layer: Any) -> DispatchMetadata | None:
    """The forward's ``DispatchMetadata`` of ``layer`` (vLLM's forward context), if any."""
    context = _forward_context._forward_context
    if context is None:
        return None
    found: Any = context.attn_metadata
    if isinstance(found, list):  # per micro-batch: each has its own slot mapping
        found = found[0] if found else None
    if isinstance(found, dict):
        found = found.get(getattr(layer, "layer_name", ""))
    return found if isinstance(found, DispatchMetadata) else None


# ---------------------------------------------------------------------------------------------
# The backend, the impl (per layer) and the metadata builder (per KV group)


class AttnDispatchCPUBackend(CPUAttentionBackend):  # type: ignore[misc]
    """vLLM's CPU_ATTN, with per-runner dispatch when the engine asks for attn_dispatch.

    Class-level answers (dtypes, head sizes, block sizes, layouts) stay vLLM's own: they are
    read before any engine config is known. ``get_name`` stays ``"CPU_ATTN"`` (vLLM maps the
    name back to its enum).
    """

    @staticmethod
    def get_impl_cls() -> type[AttnDispatchCPUImpl]:
        return AttnDispatchCPUImpl

    @staticmethod
    def get_builder_cls() -> type[AttnDispatchCPUBuilder]:
        return AttnDispatchCPUBuilder


class AttnDispatchCPUImpl(CPUAttentionBackendImpl):  # type: ignore[misc]
    """One attention layer. Inactive (``dispatch is None``): vLLM's own CPU attention.

    Decode context parallel (vLLM's ``decode_context_parallel_size``): an active layer
    returns the decode softmax LSE, natural log (``can_return_lse_for_decode``,
    ``lse_base_on_e``, ``attn_dispatch.distributed.LSE_BASE``), so vLLM starts it; an
    inactive one keeps vLLM's answer (no LSE), so vLLM refuses DCP for it as before.
    """

    # Read by vLLM's backend selector before any engine config is known (the class answer);
    # each instance then says what it does (``__init__``).
    supports_dcp: bool = True
    lse_base_on_e: bool = True

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        alibi_slopes: list[float] | None,
        sliding_window: int | None,
        kv_cache_dtype: str,
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
    ) -> None:
        super().__init__(
            num_heads,
            head_size,
            scale,
            num_kv_heads,
            alibi_slopes,
            sliding_window,
            kv_cache_dtype,
            logits_soft_cap,
            attn_type,
            kv_sharing_target_layer_name,
            sinks,
        )
        self.dispatch: LayerDispatch | None = None
        #: Decode context parallel's decode binding (``_bind_dcp``); None without DCP.
        self.dcp_dispatch: LayerDispatch | None = None
        #: (the cache's data pointer, shape, strides and dtype; k pages, v pages, k rows,
        #: v rows, the pages as the native KV write's ``KvCaches``): ``_pages``.
        self._views: (
            tuple[
                tuple[int, torch.Size, tuple[int, ...], torch.dtype],
                torch.Tensor,
                torch.Tensor,
                torch.Tensor,
                torch.Tensor,
                KvCaches,
            ]
            | None
        ) = None
        #: (vLLM's sinks tensor, its version, its float32 copy): ``_sinks_f32``.
        self._sinks: tuple[torch.Tensor, int, torch.Tensor] | None = None
        #: (id(binding), phase) -> whether its backend reads q's rows at a stride.
        self._strided_q: dict[tuple[int, Any], bool] = {}
        # Inactive: vLLM's own CPU attention returns no LSE; DCP is refused for it by vLLM.
        self.can_return_lse_for_decode = False
        self.need_to_return_lse_for_decode = False
        self.supports_dcp = False
        vllm_config = get_current_vllm_config()
        settings = settings_of(vllm_config)
        if settings is None:
            return
        label = runner_of(vllm_config)
        if label == TARGET:
            check_draft_key(vllm_config, settings)
        config = layer_config(
            vllm_config,
            num_heads=num_heads,
            head_size=head_size,
            scale=scale,
            num_kv_heads=num_kv_heads,
            alibi_slopes=alibi_slopes,
            sliding_window=sliding_window,
            kv_cache_dtype=kv_cache_dtype,
            logits_soft_cap=logits_soft_cap,
            attn_type=attn_type,
            sinks=sinks,
        )
        self._settings: Settings = settings
        self._state: EngineState = engine_state(vllm_config.compilation_config)
        self.dispatch = make_dispatch(label, settings, config, self._state)
        self.can_return_lse_for_decode = True
        self.supports_dcp = True
        self.need_to_return_lse_for_decode = self.dcp_world_size > 1
        if self.dcp_world_size > 1:
            self._bind_dcp()

    def _bind_dcp(self) -> None:
        """Decode context parallel: decode runs the query heads of every DCP rank over this
        rank's share of the KV tokens and returns the LSE (a second binding: ``num_q_heads``
        times the DCP size, ``return_lse=True``)."""
        d = self.dispatch
        assert d is not None
        if d.fp8:
            raise UnsupportedModelError(
                "decode_context_parallel_size > 1 with an FP8 KV cache is not served by "
                "attn_dispatch yet. Choices: kv_cache_dtype='auto', or no decode context parallel"
            )
        self.dcp_dispatch = make_dispatch(
            d.label,
            self._settings,
            d.config.replace(
                num_q_heads=d.config.num_q_heads * self.dcp_world_size, return_lse=True
            ),
            self._state,
        )

    def rebind_page_size(self, page_size: int) -> None:
        """Bind again for the kernel block size vLLM settled on (still at start-up)."""
        d = self.dispatch
        if d is not None and d.config.page_size != page_size:
            self.dispatch = make_dispatch(
                d.label, self._settings, d.config.replace(page_size=page_size), self._state
            )
            if self.dcp_dispatch is not None:
                self._bind_dcp()

    # -- per step ------------------------------------------------------------------------

    def _pages(self, kv_cache: torch.Tensor, d: LayerDispatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)``: this layer's memory as contract pages (see the module doc)."""
        views = self._views
        # The views (and the native write's page description) are reused only for the same
        # memory with the same shape, strides and dtype: a tensor over the same storage with
        # fewer blocks must not be written or read through the old, larger views.
        key = (kv_cache.data_ptr(), kv_cache.shape, kv_cache.stride(), kv_cache.dtype)
        if views is not None and views[0] == key:
            return views[1], views[2]
        cfg = d.config
        blocks, heads, block, width = kv_cache.shape
        if (heads, block, width) != (cfg.num_kv_heads, cfg.page_size, 2 * cfg.head_dim) or not (
            kv_cache.is_contiguous()
        ):
            raise UnsupportedModelError(
                f"vLLM handed this layer a KV cache of shape {tuple(kv_cache.shape)} (contiguous: "
                f"{kv_cache.is_contiguous()}); attn_dispatch stores its own pages in a contiguous "
                f"[blocks, {cfg.num_kv_heads}, {cfg.page_size}, {2 * cfg.head_dim}] tensor per "
                "layer (vLLM's LBHNC layout). Choices: the default KV cache layout, no KV connector"
            )
        flat = kv_cache.view(-1).view(d.kv_torch_dtype)
        page = block * heads * cfg.head_dim
        count = 2 * blocks - 1
        k = flat[: count * page].view(count, block, heads, cfg.head_dim)
        v = flat[page : page + count * page].view(count, block, heads, cfg.head_dim)
        # The same memory as token rows, what the KV writes index.
        rows_k = k.view(-1, heads, cfg.head_dim)
        rows_v = v.view(-1, heads, cfg.head_dim)
        # The native KV write's description of the pages: K of block b at page 2b.
        self._views = (key, k, v, rows_k, rows_v, KvCaches.of(k, v, 2))
        return k, v

    def do_kv_cache_update(
        self,
        layer: Any,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        d = self.dispatch
        if d is None:
            return super().do_kv_cache_update(layer, key, value, kv_cache, slot_mapping)  # type: ignore[no-any-return]
        self._pages(kv_cache, d)
        views = self._views
        assert views is not None
        if not d.fp8:
            write = _kv_write()
            if write is not None:
                # One C call: every slot checked against the cache, then the rows written
                # (padding slots skipped), K at page 2b and V at page 2b + 1 of block b.
                kv_dtype = d.kv_torch_dtype
                if key.dtype != kv_dtype:
                    key, value = key.to(kv_dtype), value.to(kv_dtype)
                write(key, value, slot_mapping, views[5])
                return
        rows_k, rows_v = views[3], views[4]
        md = _step_metadata(layer)
        bs = d.config.page_size
        # Once per forward (the first layer's write), not per layer.
        where = md.kv_rows(slot_mapping, bs) if md is not None else kv_rows(slot_mapping, bs)
        rows, n, keep = where.rows, where.count, where.keep
        if where.end > rows_k.shape[0]:
            # The native write's refusal, before index_copy_ writes any row.
            flat = slot_mapping.reshape(-1).to(torch.int64)
            i = int((flat // bs >= kv_cache.shape[0]).nonzero()[0])
            raise InvalidBatchError(
                "slot_mapping",
                f"token {i}'s slot {int(flat[i])} is past the KV cache's "
                f"{kv_cache.shape[0]} blocks of {bs} slots; nothing was written",
            )
        if key.shape[0] != n:
            key, value = key[:n], value[:n]
        if keep is not None:
            key, value = key[keep], value[keep]
        if d.fp8:
            limit = FP8_MAX[str(d.config.kv_dtype)]
            key = (key.float() / float(layer._k_scale_float)).clamp_(-limit, limit)
            value = (value.float() / float(layer._v_scale_float)).clamp_(-limit, limit)
            # index_copy_ has no float8 kernel on CPU: copy the bytes.
            rows_k.view(torch.uint8).index_copy_(
                0, rows, key.to(d.kv_torch_dtype).view(torch.uint8)
            )
            rows_v.view(torch.uint8).index_copy_(
                0, rows, value.to(d.kv_torch_dtype).view(torch.uint8)
            )
        else:
            kv_dtype = d.kv_torch_dtype
            if key.dtype != kv_dtype:
                key, value = key.to(kv_dtype), value.to(kv_dtype)
            rows_k.index_copy_(0, rows, key)
            rows_v.index_copy_(0, rows, value)

    def forward(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        d = self.dispatch
        if d is None:
            return super().forward(  # type: ignore[no-any-return]
                layer,
                query,
                key,
                value,
                kv_cache,
                attn_metadata,
                output,
                output_scale,
                output_block_scale,
            )
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedModelError("fused output quantization is not served by attn_dispatch")
        if attn_metadata is None:  # vLLM's dummy runs
            return output
        if not isinstance(attn_metadata, DispatchMetadata):
            raise InvalidBatchError(
                "attn_metadata",
                f"layer {getattr(layer, 'layer_name', '?')!r} got {type(attn_metadata).__name__}; "
                "its metadata builder is not attn_dispatch's (a KV group mixing backends)",
            )
        k_cache, v_cache = self._pages(kv_cache, d)
        extras = self._extras(layer, d) if d.extras else _NO_EXTRAS
        binding = d.binding
        # vLLM hands the buffer as [tokens, heads, head_dim] already (its attention layer's
        # view); the core's out= rule checks its shape.
        out = (
            output
            if output.dim() == 3
            else output.view(output.shape[0], d.config.num_q_heads, d.config.head_dim)
        )
        if self.dcp_dispatch is not None:
            forward_dcp(
                attn_metadata.dcp_step(self.dcp_world_size, self.dcp_rank),
                attn_metadata,
                d,
                self.dcp_dispatch,
                query,
                key,
                value,
                k_cache,
                v_cache,
                out,
                extras,
                rank=self.dcp_rank,
            )
            return output
        draft = d.draft
        # vLLM's buffer takes the result in place (``out=``) where a part's rows are one slice
        # (a contiguous view); scattered rows, or a buffer vLLM made in another dtype, get a
        # result that is then copied in.
        direct = out.dtype == query.dtype
        tokens = query.shape[0]
        for part in attn_metadata.parts_for(draft):
            rows = part.rows
            # A part of every row (a step of one phase): q and out as they are, no views.
            whole = (
                type(rows) is slice
                and rows.start == 0
                and rows.stop == tokens
                and out.shape[0] == tokens
            )
            q = query if whole else query[rows]
            # vLLM's q is a column slice of the fused QKV projection: a backend that reads
            # q's rows at a stride takes it as it is, any other a contiguous copy.
            if not q.is_contiguous() and not self._reads_strided_q(binding, part.batch.phase):
                q = q.contiguous()
            # One scope per runner and part per step, entered by each of the runner's layers.
            with attn_metadata.scope(binding, draft, part):
                if direct and isinstance(rows, slice):
                    attention(q, k_cache, v_cache, out=out if whole else out[rows], **extras)
                else:
                    out[rows] = attention(q, k_cache, v_cache, **extras)
        return output

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        super().process_weights_after_loading(act_dtype)
        if self.dispatch is not None and self.sinks is not None:
            self._sinks_f32()  # converted once, now that vLLM loaded the weights

    def _reads_strided_q(self, binding: Any, phase: Any) -> bool:
        """Whether the backend serving ``phase`` reads a q whose rows are strided (its heads
        dense) in place: it declares ``reads_strided_q_rows`` (native). Asked once per
        binding and phase."""
        key = (id(binding), phase)
        found = self._strided_q.get(key)
        if found is None:
            try:
                backend = binding.backend(phase)
            except Exception:  # a bucketed phase: several backends, copy for all
                backend = None
            found = self._strided_q[key] = getattr(backend, "reads_strided_q_rows", False) is True
        return found

    def _sinks_f32(self) -> torch.Tensor:
        """The layer's sinks as float32, converted once per load: kept with the version of
        vLLM's tensor it was made from, made again only if vLLM wrote that tensor since."""
        sinks = self.sinks
        assert sinks is not None
        cached = self._sinks
        if cached is None or cached[0] is not sinks or cached[1] != sinks._version:
            cached = self._sinks = (sinks, sinks._version, sinks.detach().to(torch.float32))
        return cached[2]

    def _extras(self, layer: Any, d: LayerDispatch) -> dict[str, Any]:
        """The per-call keywords of a layer whose config takes them (sinks, FP8 scales)."""
        extras: dict[str, Any] = {}
        if d.config.sinks and self.sinks is not None:  # sinks=True: vLLM passed the tensor
            extras["sinks"] = self._sinks_f32()
        if d.fp8:
            # Python floats on vLLM's layer, read per call: vLLM sets them after loading.
            extras["k_scale"] = float(layer._k_scale_float)
            extras["v_scale"] = float(layer._v_scale_float)
        return extras


class AttnDispatchCPUBuilder(CPUAttentionMetadataBuilder):  # type: ignore[misc]
    """Builds a step's ``DispatchMetadata`` (inactive: vLLM's own CPU metadata)."""

    def __init__(
        self,
        kv_cache_spec: Any,
        layer_names: list[str],
        vllm_config: Any,
        device: torch.device,
    ) -> None:
        settings = settings_of(vllm_config)
        self._settings = settings
        if settings is None:
            super().__init__(kv_cache_spec, layer_names, vllm_config, device)
            return
        # vLLM's own builder picks its kernel ISA here (and refuses FP8 caches on AVX2): none
        # of that applies to our kernels.
        AttentionMetadataBuilder.__init__(self, kv_cache_spec, layer_names, vllm_config, device)
        self.block_size = int(kv_cache_spec.block_size)
        spec = vllm_config.speculative_config
        self.num_speculative_tokens = int(getattr(spec, "num_speculative_tokens", None) or 0)
        self.mixed = settings.mixed
        # No reorder_batch_threshold (None, as vLLM's own CPU builder): vLLM would then sort
        # the batch decodes-first before every step, about 100 us of NumPy per step on the
        # tiny model (1 thread), paid by every step for the few that mix phases. A part whose
        # requests are not consecutive gets its rows gathered instead (``StepPart.rows``).
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        labels: dict[str, str] = {}
        for name, layer in get_layers_from_vllm_config(vllm_config, Attention, layer_names).items():
            impl = layer.impl
            if not isinstance(impl, AttnDispatchCPUImpl) or impl.dispatch is None:
                raise UnsupportedModelError(
                    f"layer {name!r} runs {type(impl).__name__} in a KV group served by "
                    "attn_dispatch; every layer of the group must be attn_dispatch's"
                )
            impl.rebind_page_size(self.block_size)
            labels[name] = impl.dispatch.label
        check_draft_layer_names(labels)
        agree_across_ranks(
            bindings_of_layers(vllm_config, layer_names),
            engine_state(vllm_config.compilation_config),
        )
        # The builders vLLM's proposer makes for its passes hold only draft layers; a group of
        # the target's may also hold the draft's layers (same KV spec), which never run in the
        # target's forward. Each layer reads the parts of its own runner's phase rule
        # (DispatchMetadata.parts_for); this is the rule built eagerly.
        self.draft = bool(labels) and set(labels.values()) == {DRAFT}
        from vllm.distributed.parallel_state import get_dcp_world_size_and_rank

        self.dcp_world, self.dcp_rank = get_dcp_world_size_and_rank(
            bool(getattr(kv_cache_spec, "dcp_sharded", False))
        )
        self.interleave = int(vllm_config.parallel_config.cp_kv_cache_interleave_size)

    def build(
        self,
        common_prefix_len: int,
        common_attn_metadata: Any,
        fast_build: bool = False,
    ) -> Any:
        if self._settings is None:
            return super().build(common_prefix_len, common_attn_metadata, fast_build)
        cm = common_attn_metadata
        if isinstance(cm.causal, torch.Tensor) or not cm.causal:
            raise UnsupportedModelError("non-causal attention is not served by attn_dispatch")
        n = int(cm.num_reqs)
        # Copies: vLLM edits its step tensors in place between draft passes (seq_lens).
        qsl = cm.query_start_loc[: n + 1].clone()
        seq_lens = cm.seq_lens[:n].clone()
        md = DispatchMetadata(
            num_actual_tokens=int(cm.num_actual_tokens),
            max_query_len=int(cm.max_query_len),
            max_seq_len=int(cm.max_seq_len),
            query_start_loc=qsl,
            seq_lens=seq_lens,
            block_table=cm.block_table_tensor,
            slot_mapping=cm.slot_mapping,
            block_size=self.block_size,
            num_speculative_tokens=self.num_speculative_tokens,
            mixed=self.mixed,
        )
        if self.dcp_world > 1:
            md.interleave = self.interleave
            md.dcp_step(self.dcp_world, self.dcp_rank)  # checks the step now
            return md
        md.parts_for(self.draft)  # checks the step now, where vLLM built it
        return md


__all__ = ["AttnDispatchCPUBackend", "AttnDispatchCPUBuilder", "AttnDispatchCPUImpl"]
