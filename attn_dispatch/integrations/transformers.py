"""Run a Hugging Face transformers model's attention through an attn_dispatch binding.

    >>> from attn_dispatch.integrations.transformers import use
    >>> use(model, "torch", label="target")          # model.generate(...) now dispatches per call

``use`` binds ``spec`` to an ``AttnConfig`` derived from the model config and:

- registers one attention function AND its mask function under the implementation name
  ``"attn_dispatch"`` (``AttentionInterface`` / ``AttentionMaskInterface``). A custom attention
  name without a mask function makes transformers skip mask creation (``attention_mask=None``),
  which silently drops causal masking of multi-token steps; ours receives the mask request,
  refuses patterns it does not represent (sliding window, bidirectional, packed sequences,
  custom or/and masks) and lets the attention function apply causality itself.
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

Supported: decoder-only models with full attention in every layer and a ``DynamicCache`` (or
no cache): Llama family, Qwen2 family (without sliding windows), DeepSeek-V3 (the
non-absorbed 192/128 q/k vs v form). The KV layout change costs one copy of each layer's K/V
per forward; the 2-D mask is read on the host once per forward.
"""

from __future__ import annotations

import contextvars
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch

from attn_dispatch._batch import AttnBatch
from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch._errors import InvalidBatchError
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


def attn_config_for(
    config: Any, *, dtype: Any, device: Any, page_size: int = 1, tree_verify: bool = False
) -> AttnConfig:
    """The ``AttnConfig`` of a transformers model config (what its attention function sees).

    Llama/Qwen2: ``head_dim`` (or hidden / heads), GQA ``num_key_value_heads``. DeepSeek-V3:
    q/k ``qk_nope_head_dim + qk_rope_head_dim`` and v ``v_head_dim`` per head, the latent
    expanded to every head before attention (so KV heads = query heads).
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    layer_types = getattr(config, "layer_types", None) or []
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other or getattr(config, "use_sliding_window", False):
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} has layers of type "
            f"{other or ['sliding_attention']!r}; this integration serves full-attention layers "
            "only (a sliding window needs a windowed kv range per request). Choices: disable "
            "the sliding window in the config, or keep transformers' own attention"
        )
    heads = int(config.num_attention_heads)
    if getattr(config, "qk_nope_head_dim", None) is not None:
        head_dim = int(config.qk_nope_head_dim) + int(config.qk_rope_head_dim)
        v_head_dim = int(config.v_head_dim)
        kv_heads = heads
    else:
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        v_head_dim = head_dim
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    return AttnConfig(
        kind="mha",
        num_q_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        dtype=str(dtype).removeprefix("torch."),
        page_size=page_size,
        device=str(device),
        tree_verify=tree_verify,
    )


def use(
    model: Any,
    spec: BackendSpec | str,
    *,
    label: str | None = None,
    options: dict[str, dict[str, Any]] | None = None,
) -> Bound:
    """Make ``model`` (a transformers ``PreTrainedModel``) dispatch through ``spec``.

    >>> bound = use(model, "prefill=torch,decode=native", label="target")
    >>> model.generate(**inputs)        # every forward inside attn_scope(bound, batch)
    >>> bound.remove()                  # back to the model's own attention

    Raises ``IncompatibleBackendError`` (every reason) when the spec cannot serve the model,
    ``UnsupportedModelError`` for models this mapping would get wrong.
    """
    if "attn_dispatch" in model.__dict__:
        raise UnsupportedModelError(
            f"model {type(model).__name__} is already bound "
            f"({model.__dict__['attn_dispatch'].binding!r}); call .remove() on the object "
            "use() returned before binding it again"
        )
    config = attn_config_for(model.config, dtype=model.dtype, device=model.device)
    binding = bind(spec, config, label=label, options=options)
    _register()
    previous = model.config._attn_implementation
    model.set_attn_implementation(IMPLEMENTATION)
    original = model.forward
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        view = _view_for(signature, args, kwargs)
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
    signature: inspect.Signature, args: tuple[Any, ...], kwargs: dict[str, Any]
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
    return DenseView(batch, b, q, s, q_rows)


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
    """transformers' attention-function signature: ``[B, H, q, D]`` in, ``[B, q, H, Dv]`` out."""
    view = _current_view("attention")
    b, h, q, d = query.shape
    hkv, s, dv = key.shape[1], key.shape[2], value.shape[-1]
    if dropout and getattr(module, "training", False):
        raise UnsupportedModelError("attention dropout in training is not served; use .eval()")
    if (b, q, s) != (view.batch_size, view.q_len, view.kv_len):
        raise InvalidBatchError(
            "key",
            f"layer tensors (batch {b}, new {q}, keys {s}) do not match the forward's inputs "
            f"(batch {view.batch_size}, new {view.q_len}, keys {view.kv_len}); only a "
            "DynamicCache (or no cache) holding every past token is supported",
        )
    out = query.new_zeros(b * q, h, dv)
    if view.batch is not None:
        # Pages of one token: [B, Hkv, S, D] -> [B * S, 1, Hkv, D], contiguous (kernels such as
        # the native ones take row-major pages only; a copy unless the layout already is).
        k_cache = key.transpose(1, 2).reshape(b * s, 1, hkv, d).contiguous()
        v_cache = value.transpose(1, 2).reshape(b * s, 1, hkv, dv).contiguous()
        q_flat = query.transpose(1, 2).reshape(b * q, h, d)[view.q_rows].contiguous()
        scale = float(scaling) if scaling is not None else d**-0.5
        out[view.q_rows] = attention(q_flat, k_cache, v_cache, sm_scale=scale)
    return out.view(b, q, h, dv), None


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
    causality and padding from the forward's batch. Refuses any other mask pattern."""
    from transformers.masking_utils import causal_mask_function

    if mask_function is not None and mask_function is not causal_mask_function:
        name = getattr(mask_function, "__qualname__", repr(mask_function))
        raise UnsupportedModelError(
            f"the model asked for a mask pattern {name!r} beyond causal + padding "
            "(sliding window, chunked, bidirectional, packed sequences or a custom overlay); "
            f"{IMPLEMENTATION!r} serves causal attention with per-request padding only. "
            "Choices: keep transformers' own attention for this model"
        )
    if local_size is not None:
        raise UnsupportedModelError(f"local attention (size {local_size!r}) is not served")
    view = _current_view("mask creation")
    if (batch_size, q_length, kv_length) != (view.batch_size, view.q_len, view.kv_len):
        raise InvalidBatchError(
            "attention_mask",
            f"mask request (batch {batch_size}, q {q_length}, kv {kv_length}) does not match the "
            f"forward's inputs (batch {view.batch_size}, q {view.q_len}, kv {view.kv_len})",
        )
    return None


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
    "IMPLEMENTATION",
    "Bound",
    "DenseView",
    "UnsupportedModelError",
    "attention_forward",
    "attn_config_for",
    "dispatch_mask",
    "use",
]
