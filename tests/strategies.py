"""Hypothesis strategies for the whole test suite (one module, as the style guide asks)."""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st

from attn_dispatch import Phase

# ---------------------------------------------------------------------------------------------
# Kernel cases for the contract suite. A case is plain data; tests/contract/cases.py turns it
# into tensors with a seeded generator, so a failing example is reproducible from its repr.


@dataclasses.dataclass(frozen=True)
class Limits:
    """Size limits per backend (the triton interpreter needs tiny shapes)."""

    max_requests: int = 8
    max_q: int = 40
    max_prefix: int = 300
    page_sizes: tuple[int, ...] = (1, 16, 64)
    gqa_ratios: tuple[int, ...] = (1, 2, 4, 8)
    max_kv_heads: int = 2
    mha_dims: tuple[tuple[int, int], ...] = ((64, 64), (128, 128), (192, 128))
    mla_dims: tuple[tuple[int, int], ...] = ((576, 512), (80, 64))
    mla_heads: tuple[int, ...] = (1, 2, 4, 16)
    dtypes: tuple[str, ...] = ("float32", "bfloat16")
    # Tree (custom-mask) verify for MLA; FlashInfer's MLA path has no custom mask.
    mla_trees: bool = True


DEFAULT_LIMITS = Limits()


@dataclasses.dataclass(frozen=True)
class KernelCase:
    kind: str
    phase: Phase
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    page_size: int
    dtype: str
    q_lens: tuple[int, ...]
    prefix_lens: tuple[int, ...]
    # For VERIFY: per request, parent index of each draft token (-1 = child of the prefix),
    # or None for a causal chain.
    trees: tuple[tuple[int, ...], ...] | None
    extra_pages: int
    seed: int

    @property
    def kv_lens(self) -> tuple[int, ...]:
        return tuple(p + q for p, q in zip(self.prefix_lens, self.q_lens, strict=True))


@st.composite
def trees(draw: Any, size: int) -> tuple[int, ...]:
    """Parents of ``size`` draft tokens; each parent precedes its child."""
    return tuple(draw(st.integers(-1, j - 1)) for j in range(size))


@st.composite
def kernel_cases(
    draw: Any, *, kind: str, phase: Phase, limits: Limits = DEFAULT_LIMITS
) -> KernelCase:
    n = draw(st.integers(1, limits.max_requests))
    if kind == "mla":
        head_dim, v_head_dim = draw(st.sampled_from(limits.mla_dims))
        hq, hkv = draw(st.sampled_from(limits.mla_heads)), 1
    else:
        head_dim, v_head_dim = draw(st.sampled_from(limits.mha_dims))
        hkv = draw(st.integers(1, limits.max_kv_heads))
        hq = hkv * draw(st.sampled_from(limits.gqa_ratios))
    if phase is Phase.DECODE:
        q_lens = (1,) * n
    else:
        q_lens = tuple(draw(st.integers(1, limits.max_q)) for _ in range(n))
    prefix_lens = tuple(draw(st.integers(0, limits.max_prefix)) for _ in range(n))
    tree = None
    trees_ok = kind != "mla" or limits.mla_trees
    if phase is Phase.VERIFY and trees_ok and draw(st.booleans()):
        tree = tuple(draw(trees(q)) for q in q_lens)
    return KernelCase(
        kind=kind,
        phase=phase,
        num_q_heads=hq,
        num_kv_heads=hkv,
        head_dim=head_dim,
        v_head_dim=v_head_dim,
        page_size=draw(st.sampled_from(limits.page_sizes)),
        dtype=draw(st.sampled_from(limits.dtypes)),
        q_lens=q_lens,
        prefix_lens=prefix_lens,
        trees=tree,
        extra_pages=draw(st.integers(0, 5)),
        seed=draw(st.integers(0, 2**31 - 1)),
    )
