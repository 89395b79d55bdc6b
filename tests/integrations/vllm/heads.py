"""Tiny random models and EAGLE / EAGLE-3 draft heads, written as vLLM reads them.

The heads are plain safetensors files plus a ``config.json`` of a ``LlamaConfig`` with
``architectures: ["LlamaForCausalLM"]`` (vLLM renames the architecture for the method):

- EAGLE-1: ``fc.weight`` [H, 2H] over (token embedding, target hidden state) and one decoder
  layer ``layers.0.*`` without ``input_layernorm``; embeddings and LM head are the target's.
- EAGLE-3: ``midlayer.*`` with 2H-wide q/k/v projections, ``midlayer.hidden_norm``,
  ``fc.weight`` [H, 3H] over three target hidden states (``eagle_aux_hidden_state_layer_ids``
  names them), ``norm.weight`` and its own ``lm_head.weight``.

``exact=True`` builds a target whose next token depends on the last token only (its attention
and MLP outputs are zeroed, so the hidden state is the RMS-normed embedding) and an EAGLE-1 head
that reproduces it: ``fc`` keeps the embedding half, the head's own attention and MLP add
nothing, and the shared LM head's argmax is unchanged by the norm's positive scale. Every draft
token is then accepted, so vLLM runs its multi-token acceptance path (the draft's passes over
several accepted tokens).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

VOCAB = 256
HIDDEN = 128
HEADS, KV_HEADS, HEAD_DIM = 4, 2, 32
TARGET_LAYERS = 2


def _config(**over: Any) -> dict[str, Any]:
    base = dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=2 * HIDDEN,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        hidden_act="silu",
        tie_word_embeddings=False,
        torch_dtype="float32",
        bos_token_id=1,
        eos_token_id=2,
    )
    base.update(over)
    return base


def _write(path: Path, config: dict[str, Any], weights: dict[str, Any]) -> str:
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path / "model.safetensors"))
    return str(path)


def _layer(
    prefix: str,
    g: Any,
    *,
    qkv_in: int,
    norms: tuple[str, ...],
    quiet: bool,
    kv_heads: int = KV_HEADS,
) -> dict[str, Any]:
    """One Llama decoder layer's weights; ``quiet``: attention and MLP outputs are zero."""
    import torch

    def rand(*shape: int) -> Any:
        return torch.randn(*shape, generator=g) * 0.08

    w = {
        f"{prefix}self_attn.q_proj.weight": rand(HEADS * HEAD_DIM, qkv_in),
        f"{prefix}self_attn.k_proj.weight": rand(kv_heads * HEAD_DIM, qkv_in),
        f"{prefix}self_attn.v_proj.weight": rand(kv_heads * HEAD_DIM, qkv_in),
        f"{prefix}self_attn.o_proj.weight": rand(HIDDEN, HEADS * HEAD_DIM),
        f"{prefix}mlp.gate_proj.weight": rand(2 * HIDDEN, HIDDEN),
        f"{prefix}mlp.up_proj.weight": rand(2 * HIDDEN, HIDDEN),
        f"{prefix}mlp.down_proj.weight": rand(HIDDEN, 2 * HIDDEN),
    }
    if quiet:
        w[f"{prefix}self_attn.o_proj.weight"].zero_()
        w[f"{prefix}mlp.down_proj.weight"].zero_()
    for norm in norms:
        w[f"{prefix}{norm}.weight"] = torch.ones(HIDDEN)
    return w


def target(path: Path, *, seed: int = 0, exact: bool = False, kv_heads: int = KV_HEADS) -> str:
    """A Llama target of ``TARGET_LAYERS`` layers (GQA 4/2 x 32, hidden 128, vocab 256;
    ``kv_heads=1``: MQA, what vLLM's decode context parallel at 2 ranks needs)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w: dict[str, Any] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.1,
    }
    for i in range(TARGET_LAYERS):
        w.update(
            _layer(
                f"model.layers.{i}.",
                g,
                qkv_in=HIDDEN,
                norms=("input_layernorm", "post_attention_layernorm"),
                quiet=exact,
                kv_heads=kv_heads,
            )
        )
    config = _config(num_hidden_layers=TARGET_LAYERS, num_key_value_heads=kv_heads)
    return _write(path, config, w)


def eagle1(path: Path, *, seed: int = 1, exact: bool = False) -> str:
    """An EAGLE-1 head (one layer, no input_layernorm, the target's embeddings and LM head)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = _layer("layers.0.", g, qkv_in=HIDDEN, norms=("post_attention_layernorm",), quiet=exact)
    if exact:  # keep the next token's embedding, drop the target's hidden state
        w["fc.weight"] = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)], dim=1)
    else:
        w["fc.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.08
    return _write(path, _config(), w)


def eagle3(path: Path, *, seed: int = 2) -> str:
    """An EAGLE-3 head over the target's hidden states after layers 0 (embeddings), 1 and 2."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w = _layer(
        "midlayer.",
        g,
        qkv_in=2 * HIDDEN,
        norms=("input_layernorm", "hidden_norm", "post_attention_layernorm"),
        quiet=False,
    )
    w["fc.weight"] = torch.randn(HIDDEN, 3 * HIDDEN, generator=g) * 0.05
    w["norm.weight"] = torch.ones(HIDDEN)
    w["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    return _write(
        path,
        _config(eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, TARGET_LAYERS]}),
        w,
    )


def medusa(path: Path, *, seed: int = 3, heads: int = 3) -> str:
    """Medusa heads: ``heads`` residual MLP blocks over the target's hidden state, each with its
    own LM head (no attention layer)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w: dict[str, Any] = {}
    for h in range(heads):
        w[f"blocks.{h}.layers.0.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.05
        w[f"lm_heads.{h}.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.1
    config = dict(
        architectures=["MedusaModel"],
        model_type="medusa",
        hidden_size=HIDDEN,
        vocab_size=VOCAB,
        num_heads=heads,
        num_hidden_layers=1,
        torch_dtype="float32",
    )
    return _write(path, config, w)


def mimo_with_mtp(path: Path, *, seed: int = 4) -> str:
    """A MiMo target (Qwen2 layers, q/k/v biases) whose checkpoint also holds one MTP layer
    (``model.mtp_layers.0.*``: token and hidden norms, ``input_proj`` [H, 2H], a decoder block,
    a final norm): vLLM's ``mtp`` method builds the draft from the same checkpoint."""
    import torch

    g = torch.Generator().manual_seed(seed)
    w: dict[str, Any] = {
        "model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g),
        "model.norm.weight": torch.ones(HIDDEN),
        "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.1,
    }
    norms = ("input_layernorm", "post_attention_layernorm")
    prefixes = [f"model.layers.{i}." for i in range(TARGET_LAYERS)]
    # The MTP block's own decoder-layer weights sit directly under model.mtp_layers.0.
    for prefix in [*prefixes, "model.mtp_layers.0."]:
        w.update(_layer(prefix, g, qkv_in=HIDDEN, norms=norms, quiet=False))
        for proj, width in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
            w[f"{prefix}self_attn.{proj}_proj.bias"] = torch.zeros(width * HEAD_DIM)
    mtp = "model.mtp_layers.0."
    for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
        w[f"{mtp}{norm}.weight"] = torch.ones(HIDDEN)
    w[f"{mtp}input_proj.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.05
    config = _config(
        architectures=["MiMoForCausalLM"],
        model_type="qwen2",  # MiMo configs are Qwen2 ones; vLLM keys on the architecture
        num_hidden_layers=TARGET_LAYERS,
        num_nextn_predict_layers=1,
        use_sliding_window=False,
        max_window_layers=TARGET_LAYERS,
    )
    config.pop("head_dim")
    return _write(path, config, w)
