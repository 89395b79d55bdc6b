"""One vLLM attention layer as attn_dispatch sees it, and the state one engine keeps.

``layer_config`` maps a vLLM layer's arguments to an ``AttnConfig`` (or refuses it with every
reason); ``LayerDispatch`` is what the layer then dispatches through. ``EngineState`` is what
the plugin keeps per vLLM engine: the bindings its alike layers share and the cross-rank
checks it ran. It hangs off the engine's ``CompilationConfig`` (every runner of an engine,
the proposer's copies of ``VllmConfig`` included, shares that one object: vLLM registers
every attention layer in its ``static_forward_context``), so a second engine in the same
process binds afresh, and an engine's state goes when vLLM drops the engine.
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any

import torch
from vllm.v1.attention.backend import AttentionType

from attn_dispatch._binding import Binding
from attn_dispatch._binding import bind
from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import UnsupportedModelError
from attn_dispatch.integrations.vllm._settings import DRAFT
from attn_dispatch.integrations.vllm._settings import Settings

#: vLLM ``kv_cache_dtype`` -> the ``AttnConfig.kv_dtype`` it stores (``"auto"``: the model's).
KV_DTYPES = {
    "fp8": "float8_e4m3fn",
    "fp8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2",
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
}
#: The largest finite value of each FP8 KV dtype (a write clamps to it).
FP8_MAX = {"float8_e4m3fn": 448.0, "float8_e5m2": 57344.0}


@dataclasses.dataclass(slots=True, eq=False)  # mutable: the engine's caches
class EngineState:
    """What the plugin keeps for one vLLM engine (``engine_state``)."""

    #: One ``Binding`` per (runner, spec, options, config): the layers that are alike share it.
    bindings: dict[tuple[str, str, str, AttnConfig], Binding] = dataclasses.field(
        default_factory=dict
    )
    #: The ``check_agreement`` runs at start-up (``worker_table`` reports them).
    agreements: list[dict[str, Any]] = dataclasses.field(default_factory=list)
    #: The open ``record_dispatch`` of ``record_ranks`` (context manager, recorder), if any.
    recording: tuple[Any, Any] | None = None

    def binding_for(self, label: str, settings: Settings, config: AttnConfig) -> Binding:
        """The engine's ``Binding`` of runner ``label`` for ``config`` (bound on first use)."""
        spec = settings.spec_for(label)
        key = (label, str(spec), repr(sorted(settings.options.items())), config)
        found = self.bindings.get(key)
        if found is None:
            options = settings.options or None
            found = self.bindings[key] = bind(spec, config, label=label, options=options)
        return found


# Engine key (the id of its CompilationConfig) -> its state. An entry lives as long as that
# object: a finalizer drops it (vLLM's config classes are not hashable, so no WeakKeyDictionary).
_ENGINES: dict[int, EngineState] = {}


def engine_state(compilation_config: Any) -> EngineState:
    """The ``EngineState`` of the engine whose ``CompilationConfig`` this is (made on first use).

    Pass ``vllm_config.compilation_config`` (or a model runner's ``compilation_config``).
    """
    key = id(compilation_config)
    found = _ENGINES.get(key)
    if found is None:
        found = _ENGINES[key] = EngineState()
        weakref.finalize(compilation_config, _ENGINES.pop, key, None)
    return found


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class LayerDispatch:
    """What one attention layer dispatches through (fixed at start-up)."""

    label: str
    binding: Binding
    config: AttnConfig
    kv_torch_dtype: torch.dtype
    fp8: bool
    #: ``label == "draft"`` (the phase rule the layer steps with), read per call.
    draft: bool = False
    #: Whether calls pass keywords (sinks, FP8 scales); without, a call builds no dict.
    extras: bool = False


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
    # vLLM's config is untyped here: whatever it holds is checked before use.
    page_size: Any = vllm_config.cache_config.block_size if block_size is None else block_size
    if not isinstance(page_size, int) or page_size < 1:
        reasons.append(f"cache block size {page_size!r} is not known at start-up")
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
        page_size=int(page_size),
        device="cpu",
        sm_scale=float(scale),
        window_left=None
        if sliding_window is None or sliding_window < 0
        else int(sliding_window) - 1,
        logit_cap=float(logits_soft_cap) if logits_soft_cap else None,
        sinks=sinks is not None,
    )


def make_dispatch(
    label: str, settings: Settings, config: AttnConfig, state: EngineState
) -> LayerDispatch:
    """A layer's ``LayerDispatch``: the engine's binding of its runner for ``config``."""
    kv = str(config.kv_dtype)
    return LayerDispatch(
        label=label,
        binding=state.binding_for(label, settings, config),
        config=config,
        kv_torch_dtype=getattr(torch, kv),
        fp8=kv in FP8_MAX,
        draft=label == DRAFT,
        extras=config.sinks or kv in FP8_MAX,
    )


__all__ = [
    "FP8_MAX",
    "KV_DTYPES",
    "EngineState",
    "LayerDispatch",
    "engine_state",
    "layer_config",
    "make_dispatch",
]
