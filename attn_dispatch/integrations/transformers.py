"""Run a Hugging Face transformers model's attention through an attn_dispatch binding.

    >>> from attn_dispatch.integrations.transformers import use
    >>> use(model, "torch", label="target")          # model.generate(...) now dispatches per call

``use`` binds ``spec`` to an ``AttnConfig`` derived from the model config and:

- registers one attention function AND its mask function under the implementation name
  ``"attn_dispatch"`` (``AttentionInterface`` / ``AttentionMaskInterface``). A custom attention
  name without a mask function makes transformers skip mask creation (``attention_mask=None``),
  which silently drops causal masking of multi-token steps; ours receives the mask request,
  accepts transformers' causal and sliding-window causal masks, refuses patterns it does not
  represent (chunked, bidirectional, packed sequences, custom or/and masks) and lets the
  attention function apply causality and the window itself.
- switches the model to that implementation (``set_attn_implementation``) and wraps its
  ``forward`` so that every forward of this model runs inside its own ``attn_scope`` with an
  ``AttnBatch`` made for that forward. Two models (a target and its assistant) therefore use
  their own bindings even though they share the registered function.

How transformers' dense tensors map onto the paged contract: keys/values of one layer arrive
as ``[B, Hkv, S, D]`` (the whole ``DynamicCache`` plus the new tokens). They are laid out as
pages of ONE token (``page_size=1``): token ``t`` of row ``b`` is page ``b * S + t``. The page
table of request ``b`` lists only the positions its 2-D ``attention_mask`` marks as real, so
left (or any) padding is never attended, and the queries are the row's real tokens among the
new ones, which are always its last real tokens: the contract's causal, bottom-right aligned
rule is then exactly transformers' causal + padding mask. Padding query rows return zeros.

Phase from the shapes: no cached tokens -> PREFILL; one new token on a cache -> DECODE;
several new tokens on a cache (assisted generation's candidate check) -> VERIFY.

Layer variants: a sliding layer (``config.layer_types`` or, without it, ``sliding_window``)
gets ``window_left = sliding_window - 1``; ``attn_logit_softcapping`` is every layer's
``logit_cap``; attention modules holding ``sinks`` (gpt-oss, passed as ``s_aux``) make
``sinks=True``. A model with both kinds of layer gets one grouped binding (``"sliding"``,
``"full"``), each layer passing ``group=``. A sliding layer's ``DynamicSlidingWindowLayer``
returns only the window's keys (a suffix of the sequence): they are placed at their
positions in the same one-token pages, so every group shares the forward's ``AttnBatch``.

Supported: decoder-only models with full and sliding-window attention layers and a
``DynamicCache`` (or no cache): Llama, Qwen2 (with or without sliding layers), Mistral,
Gemma 2, Gemma 3 (text), Cohere 2, gpt-oss, DeepSeek-V3 (the non-absorbed 192/128 q/k vs v
form). The KV layout change costs one copy of each layer's K/V per forward; the 2-D mask is
read on the host once per forward.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable
from collections.abc import Mapping
from typing import Any

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import InvalidBatchError
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import NoActiveScopeError
from attn_dispatch._phase import Phase
from attn_dispatch._scope import attention
from attn_dispatch._scope import attn_scope
from attn_dispatch._spec import BackendSpec

IMPLEMENTATION = "attn_dispatch"


class UnsupportedModelError(AttnDispatchError, ValueError):
    """A model (or a mask it asks for) that this integration cannot serve faithfully."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class DenseView:
    """How one forward's dense tensors map onto its ``AttnBatch``."""

    batch: AttnBatch | None  # None when no row has a real query token
    batch_size: int
    q_len: int
    kv_len: int  # dense key length S (cached + new)
    q_rows: torch.Tensor  # int64: rows of the flattened [B * q_len] queries that are real
    model: _ModelMap | None = None  # the bound model's groups (None: a DenseView made by hand)


_VIEW: contextvars.ContextVar[DenseView | None] = contextvars.ContextVar(
    "attn_dispatch.transformers.view", default=None
)


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Bound:
    """What ``use`` did to one model; ``remove()`` undoes it."""

    model: Any
    binding: Binding
    previous_implementation: str | None
    original_forward: Callable[..., Any]

    @property
    def attn_binding(self) -> Binding:
        return self.binding

    def remove(self) -> None:
        """Restore the model's own forward and attention implementation."""
        self.model.__dict__.pop("forward", None)
        self.model.__dict__.pop("attn_binding", None)
        self.model.__dict__.pop("attn_dispatch", None)
        if self.previous_implementation is not None:
            self.model.set_attn_implementation(self.previous_implementation)


GROUP_FULL = "full"
GROUP_SLIDING = "sliding"
_LAYER_GROUPS = {"full_attention": GROUP_FULL, "sliding_attention": GROUP_SLIDING}
# Largest finite value of each FP8 format: the per-layer scale maps a layer's amax onto it.
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


def layer_groups(config: Any) -> list[str]:
    """The attention group (``"full"`` or ``"sliding"``) of every layer of a model config.

    From ``config.layer_types`` when present (Gemma 2/3, Cohere 2, gpt-oss, Qwen2), otherwise
    every layer is sliding when ``config.sliding_window`` is set (Mistral) and full if not.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(
        config, "is_causal", True
    ):
        raise UnsupportedModelError(
            f"model type {model_type!r} uses bidirectional attention; {IMPLEMENTATION!r} serves "
            "causal decoders only. Choices: keep transformers' own attention for this model"
        )
    types = getattr(config, "layer_types", None)
    if not types:
        sliding = getattr(config, "sliding_window", None) is not None
        return [GROUP_SLIDING if sliding else GROUP_FULL] * int(config.num_hidden_layers)
    other = sorted({t for t in types if t not in _LAYER_GROUPS})
    if other:
        raise UnsupportedModelError(
            f"model type {model_type!r} has layers of type {other!r}; {IMPLEMENTATION!r} serves "
            f"{sorted(_LAYER_GROUPS)!r} layers only (chunked, linear and other attention kinds "
            "are not mapped onto the paged contract). Choices: keep transformers' own attention"
        )
    return [_LAYER_GROUPS[t] for t in types]


def attn_configs_for(
    config: Any,
    *,
    dtype: Any,
    device: Any,
    page_size: int = 1,
    tree_verify: bool = False,
    sinks: bool = False,
    kv_dtype: str | None = None,
) -> dict[str, AttnConfig]:
    """One ``AttnConfig`` per attention group the model has (``"full"``, ``"sliding"``).

    Llama/Qwen2: ``head_dim`` (or hidden / heads), GQA ``num_key_value_heads``. DeepSeek-V3:
    q/k ``qk_nope_head_dim + qk_rope_head_dim`` and v ``v_head_dim`` per head, the latent
    expanded to every head before attention (so KV heads = query heads). Sliding layers get
    ``window_left = sliding_window - 1`` (transformers' window counts the query itself),
    every layer ``logit_cap = attn_logit_softcapping`` (Gemma 2) and ``sinks`` when the
    attention modules hold learned sinks (gpt-oss).

    >>> attn_configs_for(gemma2.config, dtype=torch.float32, device="cpu")["sliding"].window_left
    """
    groups = layer_groups(config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = int(config.num_attention_heads)
    if getattr(config, "qk_nope_head_dim", None) is not None:
        head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        v_head_dim = int(config.v_head_dim)
        kv_heads = heads
    else:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        v_head_dim = head_dim
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    cap = getattr(config, "attn_logit_softcapping", None)
    window = getattr(config, "sliding_window", None)
    if GROUP_SLIDING in groups and (not isinstance(window, int) or window < 1):
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} has sliding layers but "
            f"sliding_window={window!r}; expected an int >= 1"
        )
    base = AttnConfig(
        kind="mha",
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=str(dtype).removeprefix("torch."),
        kv_dtype=kv_dtype,
        page_size=page_size,
        device=str(device),
        tree_verify=tree_verify,
        logit_cap=float(cap) if cap else None,
        sinks=sinks,
    )
    out: dict[str, AttnConfig] = {}
    for group in groups:
        if group not in out:
            left = int(window) - 1 if group == GROUP_SLIDING else None  # type: ignore[arg-type]
            out[group] = dataclasses.replace(base, window_left=left)
    return out


def attn_config_for(
    config: Any,
    *,
    dtype: Any,
    device: Any,
    page_size: int = 1,
    tree_verify: bool = False,
    group: str | None = None,
) -> AttnConfig:
    """The ``AttnConfig`` of one attention group of a transformers model config (``group``
    may be left out when every layer is alike). See ``attn_configs_for``."""
    configs = attn_configs_for(
        config, dtype=dtype, device=device, page_size=page_size, tree_verify=tree_verify
    )
    if group is None and len(configs) == 1:
        return next(iter(configs.values()))
    if group not in configs:
        raise UnsupportedModelError(
            f"group {group!r} is not one of this model's attention groups {sorted(configs)!r}"
        )
    return configs[group]


def _has_sinks(model: Any) -> bool:
    # gpt-oss keeps one learned sink logit per head on each attention module (``sinks``) and
    # passes it as ``s_aux``; no config field says so.
    return any(
        isinstance(getattr(m, "sinks", None), torch.Tensor)
        for m in model.modules()
        if hasattr(m, "sinks")
    )


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class _ModelMap:
    """What the per-call functions need to know about one bound model."""

    configs: dict[str, AttnConfig]
    grouped: bool  # several groups: each layer passes group= to attention()
    window: int | None  # transformers' sliding_window (W) when some layer slides


def use(
    model: Any,
    spec: BackendSpec | str | Mapping[str, BackendSpec | str],
    *,
    label: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
    kv_dtype: str | None = None,
) -> Bound:
    """Make ``model`` (a transformers ``PreTrainedModel``) dispatch through ``spec``.

    >>> bound = use(model, "prefill=torch,decode=native", label="target")
    >>> model.generate(**inputs)        # every forward inside attn_scope(bound, batch)
    >>> bound.remove()                  # back to the model's own attention
    >>> use(gemma2, "torch", kv_dtype="float8_e4m3fn")   # sliding + full groups, FP8 pages

    A model whose layers differ (sliding and full: Gemma 2/3, Cohere 2, gpt-oss, Qwen2 with
    ``use_sliding_window``) gets one grouped binding ``{"sliding": ..., "full": ...}``; ``spec``
    may then be a mapping group -> spec. ``kv_dtype`` (``"float8_e4m3fn"``/``"float8_e5m2"``)
    stores each layer's K and V in FP8 pages with per-layer scales ``amax / FP8_MAX`` taken from
    that layer's tensors in that forward.

    Raises ``IncompatibleBackendError`` (every reason) when the spec cannot serve the model,
    ``UnsupportedModelError`` for models this mapping would get wrong.
    """
    if "attn_dispatch" in model.__dict__:
        raise UnsupportedModelError(
            f"model {type(model).__name__} is already bound "
            f"({model.__dict__['attn_dispatch'].binding!r}); call .remove() on the object "
            "use() returned before binding it again"
        )
    configs = attn_configs_for(
        model.config,
        dtype=model.dtype,
        device=model.device,
        sinks=_has_sinks(model),
        kv_dtype=kv_dtype,
    )
    grouped = len(configs) > 1
    target: AttnConfig | dict[str, AttnConfig] = configs
    if not grouped:
        ((only, target),) = configs.items()
        if isinstance(spec, Mapping):
            if only not in spec:
                raise InvalidSpecError(
                    "spec",
                    dict(spec),
                    f"this model has one group, {only!r}: name it or pass one spec",
                )
            spec = spec[only]
    binding = bind(spec, target, label=label, options=options)
    sliding = configs.get(GROUP_SLIDING)
    window = None if sliding is None or sliding.window_left is None else sliding.window_left + 1
    mapped = _ModelMap(configs, grouped, window)
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    original = model.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        view = _view_for(signature, args, kwargs, mapped)
        token = _VIEW.set(view)
        try:
            if view.batch is None:
                return original(*args, **kwargs)
            with attn_scope(binding, view.batch):
                return original(*args, **kwargs)
        finally:
            _VIEW.reset(token)

    bound = Bound(model, binding, previous, original)
    # Instance attributes: nn.Module.__call__ finds this forward; attn_binding makes the model
    # itself a runner (attn_scope(model) works too).
    object.__setattr__(model, "forward", forward)
    object.__setattr__(model, "attn_binding", binding)
    object.__setattr__(model, "attn_dispatch", bound)
    return bound


# ---------------------------------------------------------------------------------------------
# Per forward: the batch


def _view_for(
    signature: inspect.Signature,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    mapped: _ModelMap | None = None,
) -> DenseView:
    try:
        named = signature.bind_partial(*args, **kwargs).arguments
    except TypeError:
        named = dict(kwargs)
    extra = named.get("kwargs")
    if isinstance(extra, dict):
        named = {**extra, **named}
    ids = named.get("input_ids")
    embeds = named.get("inputs_embeds")
    ref = ids if ids is not None else embeds
    if ref is None:
        raise UnsupportedModelError("a forward needs input_ids or inputs_embeds")
    b, q = int(ref.shape[0]), int(ref.shape[1])
    cache = named.get("cache", named.get("past_key_values"))
    past = int(cache.get_seq_length()) if cache is not None else 0
    s = past + q
    mask = named.get("attention_mask")
    if mask is None:
        real = torch.ones(b, s, dtype=torch.bool)
    else:
        if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            raise UnsupportedModelError(
                "attention_mask must be the 2-D padding mask [batch, cached + new] "
                f"(got {type(mask).__name__} of shape {tuple(getattr(mask, 'shape', ()))}); "
                "prepared 4-D masks cannot be mapped onto per-request kv ranges"
            )
        real = mask.detach().to("cpu", torch.bool)
        if real.shape[1] != s:
            raise UnsupportedModelError(
                f"attention_mask covers {real.shape[1]} positions but the cache holds {past} "
                f"and the forward adds {q} (= {s}); pass the mask of the whole sequence"
            )
    phase = Phase.PREFILL if past == 0 else Phase.DECODE if q == 1 else Phase.VERIFY
    kv_lens, q_lens, tables, rows = [], [], [], []
    for i in range(b):
        keys = torch.nonzero(real[i]).flatten()
        nq = int(real[i, s - q :].sum())
        if nq == 0:
            continue  # a row with no real new token: its outputs stay zero
        if mapped is not None and mapped.window is not None and keys.numel():
            # transformers windows absolute positions (padding included), the contract counts
            # the request's own tokens: the same keys only when a row's tokens are contiguous.
            if int(keys[-1] - keys[0]) + 1 != keys.numel():
                raise UnsupportedModelError(
                    f"row {i} of attention_mask has padding between real tokens; a sliding "
                    f"window (sliding_window={mapped.window!r}) is served with left padding only "
                    "(transformers windows positions, padding included). Choices: left-pad"
                )
        tables.append((keys + i * s).tolist())
        kv_lens.append(int(keys.numel()))
        q_lens.append(nq)
        rows.extend((torch.nonzero(real[i, s - q :]).flatten() + i * q).tolist())
    device = ref.device
    batch = None
    if q_lens:
        batch = AttnBatch.build(
            phase,
            q_lens=q_lens,
            kv_lens=kv_lens,
            page_tables=tables,
            page_size=1,
            num_pages=b * s,
            device=device,
        )
    q_rows = torch.tensor(rows, dtype=torch.long, device=device)
    return DenseView(batch, b, q, s, q_rows, mapped)


# ---------------------------------------------------------------------------------------------
# The functions transformers calls


def _current_view(what: str) -> DenseView:
    view = _VIEW.get()
    if view is None:
        raise NoActiveScopeError(
            f"transformers {what} for implementation {IMPLEMENTATION!r} outside a forward "
            "wrapped by attn_dispatch.integrations.transformers.use(model, spec)"
        )
    return view


def attention_forward(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: ``[B, H, q, D]`` in, ``[B, q, H, Dv]`` out.

    The layer's group is what the layer asks for: ``sliding_window`` set -> ``"sliding"``;
    ``softcap`` and ``s_aux`` (gpt-oss sinks) must agree with the bound configs."""
    view = _current_view("attention")
    b, h, q, d = query.shape
    s_layer, dv = key.shape[2], value.shape[-1]
    if dropout and getattr(module, "training", False):
        raise UnsupportedModelError("attention dropout in training is not served; use .eval()")
    group, extra = _layer_call(module, view, kwargs)
    s = view.kv_len
    # A sliding layer's DynamicSlidingWindowLayer returns only the last keys (at least the
    # window before the first new token): a suffix of the sequence.
    shortest = s
    if group == GROUP_SLIDING and view.model is not None and view.model.window is not None:
        shortest = min(s, view.model.window - 1 + q)
    if (b, q) != (view.batch_size, view.q_len) or not shortest <= s_layer <= s:
        raise InvalidBatchError(
            "key",
            f"layer tensors (batch {b}, new {q}, keys {s_layer}) do not match the forward's "
            f"inputs (batch {view.batch_size}, new {view.q_len}, keys {s}); only a "
            "DynamicCache (or no cache) holding every past token (or, for sliding layers, "
            "every token of the window) is supported",
        )
    out = query.new_zeros(b * q, h, dv)
    if view.batch is not None:
        cfg = view.model.configs[group] if view.model is not None else None
        kv_dtype = cfg.kv_dtype if cfg is not None else None
        # Pages of one token: [B, Hkv, S, D] -> [B * S, 1, Hkv, D], contiguous (kernels such as
        # the native ones take row-major pages only; a copy unless the layout already is).
        k_cache, k_scale = _pages(key, s, kv_dtype)
        v_cache, v_scale = _pages(value, s, kv_dtype)
        if k_scale is not None:
            extra["k_scale"], extra["v_scale"] = k_scale, v_scale
        q_flat = query.transpose(1, 2).reshape(b * q, h, d)[view.q_rows].contiguous()
        scale = float(scaling) if scaling is not None else d**-0.5
        out[view.q_rows] = attention(q_flat, k_cache, v_cache, sm_scale=scale, **extra)
    return out.view(b, q, h, dv), None


def _layer_call(module: Any, view: DenseView, kwargs: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The group of the calling layer and the extra keywords of its ``attention`` call."""
    window = kwargs.get("sliding_window")
    cap = kwargs.get("softcap")
    sinks = kwargs.get("s_aux")
    group = GROUP_SLIDING if window is not None else GROUP_FULL
    mapped = view.model
    if mapped is None:  # a DenseView made without use(): full attention, no variants
        if window is not None or cap or sinks is not None:
            raise UnsupportedModelError(
                "a layer asked for a window, a soft-cap or sinks outside use(model, spec)"
            )
        return group, {}
    cfg = mapped.configs.get(group)
    problem = None
    if cfg is None:
        problem = f"a {group!r} layer, but the model config has only {sorted(mapped.configs)!r}"
    elif window is not None and int(window) - 1 != cfg.window_left:
        problem = f"sliding_window={window!r}, but the config says {mapped.window!r}"
    elif (float(cap) if cap else None) != cfg.logit_cap:
        problem = f"softcap={cap!r}, but the config says {cfg.logit_cap!r}"
    elif (sinks is not None) != cfg.sinks:
        given = "given" if sinks is not None else "missing"
        problem = f"sinks (s_aux) {given}, but the config says sinks={cfg.sinks!r}"
    if problem is not None:
        raise UnsupportedModelError(
            f"layer {getattr(module, 'layer_idx', '?')!r}: {problem}; the binding was made from "
            "the model config and cannot serve a layer that differs from it"
        )
    extra: dict[str, Any] = {}
    if mapped.grouped:
        extra["group"] = group
    if sinks is not None:
        extra["sinks"] = sinks.detach().to(torch.float32)
    return group, extra


def _pages(x: torch.Tensor, s: int, kv_dtype: str | None) -> tuple[torch.Tensor, float | None]:
    """``[B, Hkv, S_layer, D]`` -> one-token pages ``[B * S, 1, Hkv, D]`` (and the FP8 scale).

    A sliding layer's suffix lands at its absolute positions; the positions before it are
    zeros that its window never reaches."""
    b, hkv, s_layer, d = x.shape
    fp8 = kv_dtype in FP8_MAX
    scale = None
    if fp8:
        limit = FP8_MAX[str(kv_dtype)]
        amax = float(x.detach().abs().amax()) if x.numel() else 0.0
        scale = amax / limit if amax > 0.0 and amax == amax else 1.0
        x = (x.float() / scale).clamp_(-limit, limit).to(getattr(torch, str(kv_dtype)))
    src = x.transpose(1, 2)
    if s_layer == s:
        return src.reshape(b * s, 1, hkv, d).contiguous(), scale
    pages = src.new_zeros(b, s, hkv, d)
    pages[:, s - s_layer :] = src
    return pages.view(b * s, 1, hkv, d), scale


def dispatch_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Callable[..., Any] | None = None,
    attention_mask: Any = None,
    local_size: int | None = None,
    **kwargs: Any,
) -> None:
    """transformers' mask-function signature. Returns None: the attention function applies
    causality, the window and padding from the forward's batch. Accepts exactly transformers'
    causal mask and, for a model bound with sliding layers, its sliding-window causal mask of
    the config's width; refuses any other mask pattern."""
    from transformers.masking_utils import causal_mask_function

    window = _sliding_width(mask_function)
    if mask_function is not None and mask_function is not causal_mask_function and window is None:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise UnsupportedModelError(
            f"the model asked for a mask pattern {name!r} beyond causal, sliding-window causal "
            "and padding (chunked, bidirectional, packed sequences or a custom overlay); "
            f"{IMPLEMENTATION!r} serves causal attention with an optional window and "
            "per-request padding only. Choices: keep transformers' own attention for this model"
        )
    view = _current_view("mask creation")
    bound_window = view.model.window if view.model is not None else None
    if window is not None and window != bound_window:
        raise UnsupportedModelError(
            f"the model asked for a sliding window of {window!r} tokens but was bound with "
            f"sliding_window={bound_window!r}"
        )
    if local_size is not None and local_size != window:
        raise UnsupportedModelError(f"local attention (size {local_size!r}) is not served")
    # A sliding layer's cache holds only the window's keys: its mask covers a suffix.
    shortest = view.kv_len if window is None else min(view.kv_len, window - 1 + view.q_len)
    if (batch_size, q_length) != (view.batch_size, view.q_len) or not (
        shortest <= kv_length <= view.kv_len
    ):
        raise InvalidBatchError(
            "attention_mask",
            f"mask request (batch {batch_size}, q {q_length}, kv {kv_length}) does not match the "
            f"forward's inputs (batch {view.batch_size}, q {view.q_len}, kv {view.kv_len})",
        )
    return None


def _sliding_width(fn: Any) -> int | None:
    """W when ``fn`` is transformers' ``sliding_window_causal_mask_function(W)`` (an
    ``and_masks`` of its window overlay and the causal function), else None."""
    from transformers.masking_utils import causal_mask_function

    def cells(f: Any) -> dict[str, Any]:
        names = getattr(getattr(f, "__code__", None), "co_freevars", ())
        closure = getattr(f, "__closure__", None) or ()
        return {n: c.cell_contents for n, c in zip(names, closure, strict=False)}

    if getattr(fn, "__qualname__", "") != "and_masks.<locals>.and_mask":
        return None
    parts = cells(fn).get("mask_functions")
    if not isinstance(parts, tuple) or len(parts) != 2 or parts[1] is not causal_mask_function:
        return None
    if getattr(parts[0], "__qualname__", "") != "sliding_window_overlay.<locals>.inner_mask":
        return None
    width = cells(parts[0]).get("sliding_window")
    return width if isinstance(width, int) else None


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(IMPLEMENTATION, dispatch_mask)
    _registered = True


__all__ = [
    "FP8_MAX",
    "GROUP_FULL",
    "GROUP_SLIDING",
    "IMPLEMENTATION",
    "Bound",
    "DenseView",
    "UnsupportedModelError",
    "attention_forward",
    "attn_config_for",
    "attn_configs_for",
    "dispatch_mask",
    "layer_groups",
    "use",
]
