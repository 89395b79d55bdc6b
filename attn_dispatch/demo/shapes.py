"""The demo models' sizes (no torch here: ``--help`` and the option checks need them)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, slots=True)
class TargetShape:
    """Sizes of the MLA target (a DeepSeek-V3 layer shrunk: latent 512 -> 64, rope 64 -> 16)."""

    vocab: int = 96
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    qk_nope: int = 32
    qk_rope: int = 16
    kv_lora_rank: int = 64
    v_head: int = 32
    mlp: int = 128
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
        """Weights read per forward (the embedding is a lookup and does not count)."""
        s = self
        attn = s.hidden * (s.heads * (s.qk_nope + s.qk_rope) + s.cache_width)
        attn += s.heads * s.kv_lora_rank * (s.qk_nope + s.v_head) + s.heads * s.v_head * s.hidden
        return s.layers * (attn + 2 * s.hidden * s.mlp) + s.hidden * s.vocab


@dataclasses.dataclass(frozen=True, slots=True)
class DraftShape:
    """Sizes of the GQA MHA draft (its width is the target's ``head_rank``)."""

    layers: int = 1
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    mlp: int = 128
    out_scale: float = 0.1
    mlp_scale: float = 0.1

    def params(self, width: int, vocab: int) -> int:
        s = self
        attn = width * (s.heads + 2 * s.kv_heads) * s.head_dim + s.heads * s.head_dim * width
        return s.layers * (attn + 2 * width * s.mlp) + width * vocab
