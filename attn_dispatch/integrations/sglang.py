"""SGLang vocabulary -> attn_dispatch values (imports no SGLang).

    >>> import types
    >>> from attn_dispatch.integrations.sglang import forward_phase, spec_from_server_args
    >>> server_args = {"attention_backend": "triton", "decode_attention_backend": "flashinfer"}
    >>> str(spec_from_server_args(server_args, is_draft=True))   # the draft runner's own spec
    'prefill=triton,decode=flashinfer'
    >>> forward_batch = types.SimpleNamespace(forward_mode="TARGET_VERIFY")  # SGLang's, read
    >>> forward_phase(forward_batch)        # the phase of the AttnBatch for attn_scope(...)
    <Phase.VERIFY: 2>

SGLang's rules are written once, in ``attn_dispatch.integrations._sglang_rules``: its
forward-mode names (``phase_of``) and how its server arguments name each runner's backends
(``spec_from_server_args``).

Layer variants as SGLang spells them (``RadixAttention``'s fields): ``sliding_window_size``
is already FlashInfer's ``window_left`` (SGLang models pass HF's ``sliding_window - 1``;
``-1``, ``0`` or None = no window, as ``RadixAttention`` stores ``sliding_window_size or -1``)
and ``logit_cap`` (``0.0`` = off, tanh capping) is ``AttnConfig.logit_cap``:

    >>> layer = types.SimpleNamespace(tp_q_head_num=8, tp_k_head_num=2, qk_head_dim=64,
    ...     v_head_dim=64, scaling=0.125, sliding_window_size=4095, logit_cap=30.0)
    >>> cfg = attn_config_from_layer(layer, dtype="bfloat16", page_size=16)
    >>> cfg.window_left, cfg.logit_cap
    (4095, 30.0)
    >>> AttnConfig("mha", 8, 2, 64, dtype="bfloat16", page_size=16,
    ...            **variant_fields(sliding_window_size=4095, logit_cap=30.0)) == cfg.replace(
    ...     sm_scale=None)
    True
"""

from __future__ import annotations

from typing import Any

from attn_dispatch._config import AttnConfig
from attn_dispatch._errors import InvalidSpecError
from attn_dispatch._phase import Phase
from attn_dispatch._spec import BackendSpec
from attn_dispatch.integrations._sglang_rules import phase_of as phase_of
from attn_dispatch.integrations._sglang_rules import server_args_spec


def spec_from_server_args(
    server_args: object, *, is_draft: bool = False, speculative_algorithm: str | None = None
) -> BackendSpec:
    """The ``BackendSpec`` of one runner from SGLang ``ServerArgs`` (or a mapping of them).

    Resolved values (``resolved_dict()``) when the object has them; the draft follows the
    rules of ``speculative_algorithm`` (default: ``server_args.speculative_algorithm``), as
    SGLang 0.5.23 applies them.

    >>> args = {"attention_backend": "triton", "decode_attention_backend": "flashinfer",
    ...         "speculative_attention_mode": "decode"}
    >>> str(spec_from_server_args(args))
    'prefill=triton,decode=flashinfer,verify_mode=decode'
    >>> spec_from_server_args(args, is_draft=True, speculative_algorithm="EAGLE").names
    ('flashinfer', 'flashinfer', 'flashinfer')

    Reads ``resolved_dict()`` when ``server_args`` has one (SGLang >= 0.5.23 keeps the raw
    input in the attributes), else the attributes or mapping keys. The target runner follows
    ``attention_backends()`` and the hybrid backend; a draft runner follows the rules of
    ``speculative_algorithm`` (else ``server_args.speculative_algorithm``, else EAGLE's), as
    SGLang 0.5.23's draft factories apply them. Names SGLang rewrites are rewritten the same
    way and listed in ``note``. A phase without a name raises ``InvalidSpecError``.
    """
    return server_args_spec(
        BackendSpec, server_args, is_draft=is_draft, algorithm=speculative_algorithm
    )


def forward_phase(forward_batch: Any) -> Phase:
    """The ``Phase`` of an SGLang ``ForwardBatch`` (from its ``forward_mode``), e.g.
    ``TARGET_VERIFY`` -> ``Phase.VERIFY``; an unknown mode raises ``UnknownPhaseError``."""
    return phase_of(getattr(forward_batch, "forward_mode", forward_batch))


def variant_fields(
    *,
    sliding_window_size: int | None = -1,
    logit_cap: float | None = 0.0,
    logit_capping_method: str = "tanh",
) -> dict[str, Any]:
    """``AttnConfig`` keyword arguments (``window_left``, ``logit_cap``) from SGLang's names.

    >>> variant_fields(sliding_window_size=4095, logit_cap=50.0)
    {'window_left': 4095, 'logit_cap': 50.0}
    """
    if isinstance(sliding_window_size, bool) or not isinstance(sliding_window_size, int | None):
        raise InvalidSpecError(
            "sliding_window_size",
            sliding_window_size,
            "must be an int (SGLang's window_left: HF's sliding_window - 1; -1 = no window)",
        )
    if logit_capping_method != "tanh":
        raise InvalidSpecError(
            "logit_capping_method",
            logit_capping_method,
            "only SGLang's 'tanh' capping (cap * tanh(s / cap)) is served",
        )
    # RadixAttention keeps ``sliding_window_size or -1``: 0 and None mean no window there too.
    window = sliding_window_size if sliding_window_size and sliding_window_size > 0 else None
    return {"window_left": window, "logit_cap": logit_cap or None}


def attn_config_from_layer(
    layer: Any,
    *,
    dtype: str,
    page_size: int,
    device: str = "cpu",
    kv_dtype: str | None = None,
    sinks: bool = False,
    tree_verify: bool = False,
    attention_chunk_size: int | None = None,
) -> AttnConfig:
    """The MHA ``AttnConfig`` of one SGLang ``RadixAttention`` layer (read by attribute:
    ``tp_q_head_num``, ``tp_k_head_num``, ``qk_head_dim``, ``v_head_dim``, ``scaling``,
    ``sliding_window_size``, ``logit_cap``, ``logit_capping_method``, ``attn_type``,
    ``use_irope``). Sinks are a forward argument in SGLang (gpt-oss), so say ``sinks=True``
    for such layers. ``attention_chunk_size``: the model config's (Llama 4), which SGLang keeps
    on the model runner rather than on the layer; it applies to the layers with
    ``use_irope=True`` (the chunked ones). An ``ENCODER_ONLY`` layer is ``causal=False``.

    >>> import types
    >>> attn = types.SimpleNamespace(tp_q_head_num=8, tp_k_head_num=2, qk_head_dim=64,
    ...                              v_head_dim=64, scaling=0.125)   # an SGLang layer's fields
    >>> cfg = attn_config_from_layer(attn, dtype="bfloat16", page_size=16)
    >>> cfg.num_q_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sm_scale
    (8, 2, 64, 0.125)
    """
    if getattr(layer, "is_cross_attention", False):
        raise InvalidSpecError(
            "is_cross_attention", True, "cross attention has no paged self-attention config"
        )
    kind = getattr(getattr(layer, "attn_type", None), "value", getattr(layer, "attn_type", None))
    if kind not in (None, "decoder", "encoder_only"):
        raise InvalidSpecError(
            "attn_type",
            kind,
            "served: 'decoder' (causal) and 'encoder_only' (causal=False); a bidirectional "
            "span inside a causal decoder is not an AttnConfig",
        )
    chunk = None
    if getattr(layer, "use_irope", False):
        if attention_chunk_size is None:
            raise InvalidSpecError(
                "attention_chunk_size",
                None,
                "this layer has use_irope=True (chunked local attention, Llama 4): pass the "
                "model config's attention_chunk_size",
            )
        chunk = attention_chunk_size
    head_dim = int(getattr(layer, "qk_head_dim", None) or layer.head_dim)
    v_head_dim = getattr(layer, "v_head_dim", -1)
    return AttnConfig(
        kind="mha",
        num_q_heads=int(layer.tp_q_head_num),
        num_kv_heads=int(layer.tp_k_head_num),
        head_dim=head_dim,
        v_head_dim=head_dim if v_head_dim in (None, -1) else int(v_head_dim),
        dtype=dtype,
        kv_dtype=kv_dtype,
        page_size=page_size,
        device=device,
        tree_verify=tree_verify,
        sm_scale=float(layer.scaling) if getattr(layer, "scaling", None) else None,
        sinks=sinks,
        causal=kind != "encoder_only",
        attention_chunk_size=chunk,
        **variant_fields(
            sliding_window_size=getattr(layer, "sliding_window_size", -1),
            logit_cap=getattr(layer, "logit_cap", 0.0),
            logit_capping_method=getattr(layer, "logit_capping_method", "tanh"),
        ),
    )


__all__ = [
    "attn_config_from_layer",
    "forward_phase",
    "phase_of",
    "spec_from_server_args",
    "variant_fields",
]
