"""The demo models' sizes (no torch here: ``--help`` and the option checks need them)."""

from __future__ import annotations

import dataclasses


def _weights(layers: int, attn: int, width: int, mlp: int, vocab: int) -> int:
    """Weights one forward reads: per layer its attention's and a two-matrix MLP's, then the
    LM head (the embedding is a lookup and does not count)."""
    return layers * (attn + 2 * width * mlp) + width * vocab


@dataclasses.dataclass(frozen=True, slots=True)
class TargetShape:
    """Sizes of the MLA target (a DeepSeek-V3 layer shrunk: latent 512 -> 64, rope 64 -> 16)."""

    vocab: int = 96
    hidden: int = 64  # residual stream width
    layers: int = 2
    heads: int = 4
    qk_nope: int = 32  # per-head q/k width without rotary (DeepSeek-V3: 128)
    qk_rope: int = 16  # rotary part of q/k, one k_rope per token shared by all heads (64)
    kv_lora_rank: int = 64  # the latent c_kv a cache row holds (512)
    v_head: int = 32  # per-head v width of the decompressed form (128)
    mlp: int = 128  # MLP inner width
    # Directions of the residual stream the LM head reads (the draft's width); None: all.
    head_rank: int | None = None
    # Small output projections: the residual stream stays close to the token embedding, so
    # the draft (same embedding and head) guesses the target's next token often, not always.
    out_scale: float = 0.25
    mlp_scale: float = 0.05

    @property
    def cache_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope

    @property
    def rank(self) -> int:
        return self.hidden if self.head_rank is None else self.head_rank

    @property
    def params(self) -> int:
        s = self
        attn = s.hidden * (s.heads * (s.qk_nope + s.qk_rope) + s.cache_width)
        attn += s.heads * s.kv_lora_rank * (s.qk_nope + s.v_head) + s.heads * s.v_head * s.hidden
        return _weights(s.layers, attn, s.hidden, s.mlp, s.vocab)


@dataclasses.dataclass(frozen=True, slots=True)
class DraftShape:
    """Sizes of the GQA MHA draft (its width is the target's ``head_rank``)."""

    layers: int = 1
    heads: int = 4  # query heads
    kv_heads: int = 2  # grouped-query attention: heads // kv_heads queries per K/V head
    head_dim: int = 16
    mlp: int = 128  # MLP inner width
    # Scales of the output projections (see TargetShape).
    out_scale: float = 0.1
    mlp_scale: float = 0.1

    def params(self, width: int, vocab: int) -> int:
        s = self
        attn = width * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * width
        return _weights(s.layers, attn, width, s.mlp, vocab)
