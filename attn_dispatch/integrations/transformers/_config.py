"""Reading a transformers model config: the attention group of every layer and one
``AttnConfig`` per group.

A sliding layer (``config.layer_types`` or, without it, ``sliding_window``) gets
``window_left = sliding_window - 1``; ``attn_logit_softcapping`` is every layer's
``logit_cap``; attention modules holding ``sinks`` (gpt-oss, passed as ``s_aux``) make
``sinks=True`` (``has_sinks``). Chunked layers (Llama 4's ``"chunked_attention"``) get
``attention_chunk_size = config.attention_chunk_size``. DeepSeek-V3's non-absorbed form reads
as q/k ``qk_nope_head_dim + qk_rope_head_dim`` and v ``v_head_dim`` with KV heads = query heads.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING
from typing import Any
from typing import NamedTuple

import torch

from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import AttnDispatchError
from attn_dispatch.integrations.transformers._common import GROUP_CHUNKED
from attn_dispatch.integrations.transformers._common import GROUP_FULL
from attn_dispatch.integrations.transformers._common import GROUP_SLIDING
from attn_dispatch.integrations.transformers._common import IMPLEMENTATION
from attn_dispatch.integrations.transformers._common import UnsupportedModelError

if TYPE_CHECKING:
    # typing.Unpack and NotRequired are Python 3.11+; the package supports 3.10.
    from typing_extensions import NotRequired
    from typing_extensions import TypedDict
    from typing_extensions import Unpack

    class ConfigOptions(TypedDict):
        """The keywords of ``attn_configs_for`` (``attn_config_for`` passes them on)."""

        dtype: Any
        device: Any
        page_size: NotRequired[int]
        tree_verify: NotRequired[bool]
        sinks: NotRequired[bool]
        kv_dtype: NotRequired[str | None]


_LAYER_GROUPS = {
    "chunked_attention": GROUP_CHUNKED,
    "full_attention": GROUP_FULL,
    "sliding_attention": GROUP_SLIDING,
}


def layer_groups(config: Any) -> list[str]:
    """The attention group (``"full"``, ``"sliding"`` or ``"chunked"``) of every layer of a
    model config.

    From ``config.layer_types`` when present (Gemma 2/3, Cohere 2, gpt-oss, Qwen2, Llama 4's
    ``"chunked_attention"``/``"full_attention"``), otherwise every layer is sliding when
    ``config.sliding_window`` is set (Mistral) and full if not.

    For Llama 4's text config the first four layers read ``['chunked', 'chunked',
    'chunked', 'full']``.
    """
    config = _text_config(config)
    model_type = getattr(config, "model_type", "?")
    if getattr(config, "use_bidirectional_attention", False) or not getattr(
        config, "is_causal", True
    ):
        raise UnsupportedModelError(
            f"model type {model_type!r} uses bidirectional attention; {IMPLEMENTATION!r} serves "
            "causal decoders only. Choices: keep transformers' own attention for this model"
        )
    types = getattr(config, "layer_types", None)
    layers = getattr(config, "num_hidden_layers", None)
    if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
        raise UnsupportedModelError(
            f"model type {model_type!r}: num_hidden_layers={layers!r}; expected an int >= 1"
        )
    if not types:
        sliding = getattr(config, "sliding_window", None) is not None
        return [GROUP_SLIDING if sliding else GROUP_FULL] * layers
    if len(types) != layers:
        raise UnsupportedModelError(
            f"model type {model_type!r}: layer_types lists {len(types)} layers but "
            f"num_hidden_layers={layers}; transformers cannot tell each layer's kind either. "
            "Choices: fix the config so that both agree"
        )
    other = sorted({t for t in types if t not in _LAYER_GROUPS})
    if other:
        raise UnsupportedModelError(
            f"model type {model_type!r} has layers of type {other!r}; {IMPLEMENTATION!r} serves "
            f"{sorted(_LAYER_GROUPS)!r} layers only (linear, recurrent and other attention "
            "kinds are not mapped onto the paged contract). Choices: keep transformers' own "
            "attention"
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
    """One ``AttnConfig`` per attention group the model has (``"full"``, ``"sliding"``,
    ``"chunked"``).

    Llama/Qwen2: ``head_dim`` (or hidden / heads), GQA ``num_key_value_heads``. DeepSeek-V3:
    q/k ``qk_nope_head_dim + qk_rope_head_dim`` and v ``v_head_dim`` per head, the latent
    expanded to every head before attention (so KV heads = query heads). Sliding layers get
    ``window_left = sliding_window - 1`` (transformers' window counts the query itself),
    every layer ``logit_cap = attn_logit_softcapping`` (Gemma 2) and ``sinks`` when the
    attention modules hold learned sinks (gpt-oss). Chunked layers (Llama 4) get
    ``attention_chunk_size = config.attention_chunk_size``: transformers' chunked mask counts
    positions from a row's first real token, as the contract counts a request's keys.

    Example (Gemma 2, ``sliding_window=4096``)::

        attn_configs_for(gemma2.config, dtype=torch.float32, device="cpu")["sliding"].window_left
        # 4095
    """
    groups = layer_groups(config)
    config = _text_config(config)
    try:
        shape = _shape_of(config, groups)
    except (AttributeError, TypeError, ValueError) as err:
        if isinstance(err, AttnDispatchError):
            raise
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r}: its config cannot be read as "
            f"one attention shape per group ({type(err).__name__}: {err})"
        ) from err
    base = AttnConfig(
        kind="mha",
        num_q_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        v_head_dim=shape.v_head_dim,
        dtype=str(dtype).removeprefix("torch."),
        kv_dtype=kv_dtype,
        page_size=page_size,
        device=str(device),
        tree_verify=tree_verify,
        logit_cap=shape.cap,
        sinks=sinks,
    )
    out: dict[str, AttnConfig] = {}
    for group in groups:
        if group not in out:
            left = shape.window - 1 if group == GROUP_SLIDING and shape.window else None
            size = shape.chunk if group == GROUP_CHUNKED else None
            out[group] = dataclasses.replace(base, window_left=left, attention_chunk_size=size)
    return out


def _text_config(config: Any) -> Any:
    """The decoder's config; heterogeneous (per-layer) configs are refused by name."""
    try:
        config = config.get_text_config() if hasattr(config, "get_text_config") else config
    except Exception as err:  # transformers' own error for a config it cannot split
        raise UnsupportedModelError(
            f"transformers cannot read this model's text config ({type(err).__name__}: {err})"
        ) from err
    per_layer = set(getattr(config, "per_layer_attributes", None) or ())
    varying = sorted(per_layer & _ATTENTION_FIELDS)
    if varying:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} sets {varying!r} per layer "
            "(per_layer_config): its layers' attention shapes or windows differ in ways one "
            f"binding per group cannot express; {IMPLEMENTATION!r} serves models whose "
            "attention fields are global. Choices: keep transformers' own attention"
        )
    return config


# The config fields the attention mapping reads: a heterogeneous config may vary others.
_ATTENTION_FIELDS = frozenset(
    {
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_size",
        "sliding_window",
        "layer_types",
        "attn_logit_softcapping",
        "use_bidirectional_attention",
        "is_causal",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "attention_chunk_size",
        "use_sliding_window",
        "max_window_layers",
    }
)


class _Shape(NamedTuple):
    """What the attention mapping reads from a model config."""

    heads: int
    kv_heads: int
    head_dim: int
    v_head_dim: int
    cap: float | None  # attn_logit_softcapping (None: off)
    window: int | None  # sliding_window, checked when some layer slides
    chunk: int | None  # attention_chunk_size, checked when some layer is chunked


def _shape_of(config: Any, groups: list[str]) -> _Shape:
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
    if GROUP_SLIDING not in groups:
        window = None
    elif not isinstance(window, int) or window < 1:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} has sliding layers but "
            f"sliding_window={window!r}; expected an int >= 1"
        )
    chunk = getattr(config, "attention_chunk_size", None)
    if GROUP_CHUNKED not in groups:
        chunk = None
    elif isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise UnsupportedModelError(
            f"model type {getattr(config, 'model_type', '?')!r} has 'chunked_attention' layers "
            f"but attention_chunk_size={chunk!r}; expected an int >= 1"
        )
    return _Shape(
        heads,
        kv_heads,
        head_dim,
        v_head_dim,
        float(cap) if cap else None,
        window,
        chunk,
    )


def attn_config_for(
    config: Any, *, group: str | None = None, **options: Unpack[ConfigOptions]
) -> AttnConfig:
    """The ``AttnConfig`` of one attention group of a transformers model config (``group``
    may be left out when every layer is alike); ``options`` are ``attn_configs_for``'s.

    Example::

        attn_config_for(llama.config, dtype=torch.bfloat16, device="cpu", page_size=16)
    """
    configs = attn_configs_for(config, **options)
    if group is None and len(configs) == 1:
        return next(iter(configs.values()))
    if group not in configs:
        raise UnsupportedModelError(
            f"group {group!r} is not one of this model's attention groups {sorted(configs)!r}"
        )
    return configs[group]


def has_sinks(model: Any) -> bool:
    """Whether ``model``'s attention modules hold learned sink logits (gpt-oss keeps one per
    head on each attention module, ``sinks``, and passes it as ``s_aux``; no config field
    says so). ``use()`` binds such a model with ``sinks=True``."""
    return any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules())
