"""Contract cases: plain-data kernel cases, the strategies that draw them, their tensors, and
the float64 oracle's answer for them (``attn_dispatch.testing.contract.oracle``).

A ``KernelCase`` is plain data; ``materialise`` turns it into tensors with a seeded generator,
so a failing example is reproducible from its repr. ``Limits`` bound the shapes the strategies
draw (``limits_for`` derives them from a backend's ``Capabilities``); ``Served`` is what of
the layer variants and FP8 formats one backend serves for one (kind, phase).

Needs torch and hypothesis (the ``testing`` extra).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
from hypothesis import strategies as st

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import Phase
from attn_dispatch import tree_mask
from attn_dispatch.testing.contract import oracle

__all__ = [
    "DEFAULT_LIMITS",
    "EDGE_CASES",
    "VARIANT_EDGES",
    "KernelCase",
    "Limits",
    "Materialised",
    "Served",
    "assert_lse_matches",
    "config_of",
    "kernel_cases",
    "lse_tolerance",
    "make_case",
    "materialise",
    "naive_attention",
    "naive_state",
    "reference_lse",
    "split_cases",
    "tolerance",
    "trees",
    "variant_cases",
    "visible_keys",
]


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
    # Tree (custom-mask) verify: ``trees`` for every kind (a backend that declares
    # ``custom_mask``), ``mla_trees`` for MLA too (FlashInfer's MLA path has no custom mask).
    trees: bool = True
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
    # Layer variants and the FP8 cache (defaults: none; see variant_cases).
    window_left: int | None = None
    logit_cap: float | None = None
    sinks: bool = False
    kv_dtype: str | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0
    # With trees: per request, prefix positions its custom mask hides from every draft node
    # (a mask that is not a plain tree; the window then counts only the keys it allows).
    hidden_prefix: tuple[tuple[int, ...], ...] | None = None
    # Attention types: non-causal (every key of the request) and chunked local attention.
    causal: bool = True
    chunk: int | None = None
    # The attention state: the config has return_lse=True and the call asks for (out, lse).
    lse: bool = False

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
    trees_ok = limits.trees and (kind != "mla" or limits.mla_trees)
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


@dataclasses.dataclass(frozen=True)
class Served:
    """What of the variants and FP8 formats one backend serves for one (kind, phase)."""

    variants: frozenset[str] = frozenset()
    fp8: tuple[str, ...] = ()


@st.composite
def variant_cases(
    draw: Any, *, kind: str, phase: Phase, served: Served, limits: Limits = DEFAULT_LIMITS
) -> KernelCase:
    """``kernel_cases`` plus the variants and FP8 caches in ``served``: windows from 0 to
    larger than any context, caps from tight (0.5, most scores saturate) to loose, sinks,
    FP8 caches in both formats with scales other than 1, and the attention types: chunks
    from 1 to larger than any context, and non-causal layers (never with a window or chunk);
    and the attention state (``lse``) where served."""
    base: KernelCase = draw(kernel_cases(kind=kind, phase=phase, limits=limits))
    window = cap = None
    if "window" in served.variants and draw(st.booleans()):
        window = draw(st.sampled_from((0, 1, 3)) | st.integers(0, 64) | st.just(100_000))
    if "logit_cap" in served.variants and draw(st.booleans()):
        cap = draw(st.sampled_from((0.5, 2.0, 30.0)))
    sinks = "sinks" in served.variants and draw(st.booleans())
    chunk, causal = None, True
    if "chunked" in served.variants and draw(st.booleans()):
        chunk = draw(st.sampled_from((1, 3, 16)) | st.integers(1, 80) | st.just(100_000))
    if "non_causal" in served.variants and window is None and chunk is None:
        causal = draw(st.integers(0, 3)) != 0  # non-causal one time in four
    kv_dtype, k_scale, v_scale = None, 1.0, 1.0
    if served.fp8 and draw(st.booleans()):
        kv_dtype = draw(st.sampled_from(served.fp8))
        k_scale = draw(st.sampled_from((0.25, 0.5, 1.0, 3.0)))
        v_scale = k_scale if kind == "mla" else draw(st.sampled_from((0.125, 1.0, 2.0)))
    lse = "lse" in served.variants and draw(st.booleans())  # the state, checked too
    return dataclasses.replace(
        base,
        lse=lse,
        window_left=window,
        logit_cap=cap,
        sinks=sinks,
        kv_dtype=kv_dtype,
        k_scale=k_scale,
        v_scale=v_scale,
        causal=causal,
        chunk=chunk,
    )


@dataclass
class Materialised:
    config: AttnConfig
    batch: AttnBatch
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor | None
    sm_scale: float
    page_tables: list[list[int]]
    masks: list[torch.Tensor] | None
    sinks: torch.Tensor | None = None
    k_scale: float = 1.0
    v_scale: float = 1.0

    def extras(self) -> dict[str, Any]:
        """The per-call keywords of ``attention`` this case needs."""
        kw: dict[str, Any] = {}
        if self.sinks is not None:
            kw["sinks"] = self.sinks
        if self.config.kv_fp8:
            kw["k_scale"] = self.k_scale
            if self.config.kind != "mla":
                kw["v_scale"] = self.v_scale
        return kw


def config_of(case: KernelCase, device: str = "cpu") -> AttnConfig:
    return AttnConfig(
        kind=case.kind,  # type: ignore[arg-type]
        num_q_heads=case.num_q_heads,
        num_kv_heads=case.num_kv_heads,
        head_dim=case.head_dim,
        v_head_dim=case.v_head_dim,
        dtype=case.dtype,
        page_size=case.page_size,
        device=device,
        tree_verify=case.trees is not None,
        window_left=case.window_left,
        logit_cap=case.logit_cap,
        sinks=case.sinks,
        kv_dtype=case.kv_dtype,
        causal=case.causal,
        attention_chunk_size=case.chunk,
        return_lse=case.lse,
    )


def materialise(case: KernelCase, device: str = "cpu") -> Materialised:
    """Random q and a paged cache with shuffled page tables and unused pages."""
    g = torch.Generator().manual_seed(case.seed)
    f32 = torch.float32  # explicit draws: the same numbers whatever torch's default dtype is
    ps = case.page_size
    need = [math.ceil(k / ps) for k in case.kv_lens]
    total = sum(need) + case.extra_pages
    perm = torch.randperm(total, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    dtype = getattr(torch, case.dtype)
    t = sum(case.q_lens)
    q = torch.randn(t, case.num_q_heads, case.head_dim, generator=g, dtype=f32).to(dtype)
    # An FP8 cache holds K / k_scale and V / v_scale (values from the same random draw).
    kv_dtype = dtype if case.kv_dtype is None else getattr(torch, case.kv_dtype)
    k_div = case.k_scale if case.kv_dtype is not None else 1.0
    v_div = case.v_scale if case.kv_dtype is not None else 1.0
    if case.kind == "mla":
        k_cache = (torch.randn(total, ps, case.head_dim, generator=g, dtype=f32) / k_div).to(
            kv_dtype
        )
        v_cache = None
    else:
        k_cache = torch.randn(total, ps, case.num_kv_heads, case.head_dim, generator=g, dtype=f32)
        k_cache = (k_cache / k_div).to(kv_dtype)
        v_cache = torch.randn(total, ps, case.num_kv_heads, case.v_head_dim, generator=g, dtype=f32)
        v_cache = (v_cache / v_div).to(kv_dtype)
    sinks = None
    if case.sinks:
        sinks = torch.randn(case.num_q_heads, generator=g, dtype=f32) * 2.0
    masks = None
    if case.trees is not None:
        masks = [tree_mask(list(tr), p) for tr, p in zip(case.trees, case.prefix_lens, strict=True)]
        for mask, hidden in zip(masks, case.hidden_prefix or (), strict=False):
            mask[:, list(hidden)] = False
    batch = AttnBatch.build(
        case.phase,
        q_lens=list(case.q_lens),
        kv_lens=list(case.kv_lens),
        page_tables=tables,
        page_size=ps,
        num_pages=total,
        masks=masks,
    )
    m = Materialised(
        config=config_of(case, device),
        batch=batch,
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        sm_scale=1.0 / math.sqrt(case.head_dim),
        page_tables=tables,
        masks=masks,
        sinks=sinks,
        k_scale=case.k_scale,
        v_scale=case.v_scale,
    )
    if device != "cpu":
        m.batch = batch.to(device)
        m.q = q.to(device)
        m.k_cache = k_cache.to(device)
        m.v_cache = None if v_cache is None else v_cache.to(device)
        m.sinks = None if sinks is None else sinks.to(device)
    return m


def visible_keys(m: Materialised, i: int) -> torch.Tensor:
    """bool ``[q_len, kv_len]`` of request ``i``: which keys each of its queries sees
    (``oracle.visible_keys`` for this case's config and mask)."""
    c = m.config
    qo = m.batch.qo_indptr_host.tolist()
    return oracle.visible_keys(
        qo[i + 1] - qo[i],
        int(m.batch.kv_lens_host[i]),
        mask=None if m.masks is None else m.masks[i],
        causal=c.causal,
        window_left=c.window_left,
        chunk=c.attention_chunk_size,
    )


def naive_attention(m: Materialised) -> torch.Tensor:
    """The float64 oracle's output for this case (``oracle``)."""
    return naive_state(m)[0]


def reference_lse(m: Materialised) -> torch.Tensor:
    """The float64 oracle's lse for this case: natural log, sink counted once, -inf for a
    row that attends no key (``oracle``)."""
    return naive_state(m)[1]


def naive_state(m: Materialised) -> tuple[torch.Tensor, torch.Tensor]:
    """``(naive_attention(m), reference_lse(m))``: ``oracle.reference_state`` on the
    case's own page tables and masks (FP8 scales only for an FP8 cache), float64."""
    c = m.config
    qo = m.batch.qo_indptr_host.tolist()
    return oracle.reference_state(
        m.q,
        m.k_cache,
        m.v_cache,
        q_lens=[qo[i + 1] - qo[i] for i in range(len(m.page_tables))],
        kv_lens=m.batch.kv_lens_host.tolist(),
        page_tables=m.page_tables,
        masks=m.masks,
        sm_scale=m.sm_scale,
        v_head_dim=int(c.v_head_dim or c.head_dim),
        causal=c.causal,
        window_left=c.window_left,
        chunk=c.attention_chunk_size,
        logit_cap=c.logit_cap,
        sinks=m.sinks,
        k_scale=m.k_scale if c.kv_fp8 else 1.0,
        v_scale=m.v_scale if c.kv_fp8 else 1.0,
    )


def tolerance(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for comparing a backend's output in ``dtype`` with the float64 reference."""
    if dtype == "float32":
        return 2e-4, 2e-4
    if dtype == "float16":
        return 4e-3, 4e-3
    return 2.5e-2, 2.5e-2  # bfloat16: 8 mantissa bits, inputs already rounded


def lse_tolerance(dtype: str) -> tuple[float, float]:
    """(atol, rtol) for a backend's lse (float32 whatever ``dtype``) against the float64
    reference. The inputs are rounded to ``dtype`` before both see them, so what differs is
    the kernel's arithmetic: fp32 scores and sums, or 16-bit products where a kernel keeps
    its tiles in ``dtype``."""
    if dtype == "float32":
        return 1e-4, 1e-4
    return 2e-3, 2e-3


def assert_lse_matches(lse: torch.Tensor, m: Materialised, ref: torch.Tensor | None = None) -> None:
    """The contract for a backend's lse: float32 ``[tokens, num_q_heads]`` on q's device,
    contiguous, equal to ``reference_lse(m)`` (or ``ref``) within ``lse_tolerance``; -inf,
    +inf and NaN exactly where the reference has them."""
    want = reference_lse(m) if ref is None else ref
    assert isinstance(lse, torch.Tensor)
    assert lse.dtype == torch.float32, lse.dtype
    assert tuple(lse.shape) == (m.q.shape[0], m.config.num_q_heads), tuple(lse.shape)
    assert lse.device == m.q.device and lse.is_contiguous()
    atol, rtol = lse_tolerance(m.config.dtype)
    torch.testing.assert_close(lse.cpu().double(), want, atol=atol, rtol=rtol, equal_nan=True)


@st.composite
def split_cases(
    draw: Any, *, kind: str, served: Served, limits: Limits = DEFAULT_LIMITS
) -> tuple[KernelCase, tuple[int, ...]]:
    """A case with ``lse=True`` whose every query sees every key of its request (decode, or a
    non-causal prefill/verify when served), so its keys split at any page boundary into two
    sets that each give a valid batch: and the cut, pages in the first part, per request.
    Each part holds at least ``q_len`` keys; caps, sinks and FP8 as ``served`` allows
    (position-dependent variants, window and chunk, do not split this way)."""
    non_causal = "non_causal" in served.variants and draw(st.booleans())
    phase = draw(st.sampled_from([Phase.PREFILL, Phase.VERIFY])) if non_causal else Phase.DECODE
    splittable = Served(variants=served.variants & {"logit_cap", "sinks"}, fp8=served.fp8)
    case = draw(variant_cases(kind=kind, phase=phase, served=splittable, limits=limits))
    ps = case.page_size
    cuts, prefixes = [], []
    for q in case.q_lens:
        cut = -(-q // ps) + draw(st.integers(0, 1))  # whole pages, at least q keys
        room = max(limits.max_prefix - cut * ps, 0)
        cuts.append(cut)
        prefixes.append(cut * ps + draw(st.integers(0, room)))  # the second part: >= q keys
    case = dataclasses.replace(
        case, prefix_lens=tuple(prefixes), trees=None, causal=not non_causal, lse=True
    )
    return case, tuple(cuts)


# Fixed edge cases: exact boundaries the strategies reach only by chance.


def make_case(**over: object) -> KernelCase:
    """A small fixed case (MHA prefill, fp32, one request of 3 queries over 13 cached keys),
    with ``over`` replacing any field."""
    base: dict[str, object] = dict(
        kind="mha",
        phase=Phase.PREFILL,
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        v_head_dim=64,
        page_size=16,
        dtype="float32",
        q_lens=(3,),
        prefix_lens=(13,),
        trees=None,
        extra_pages=2,
        seed=7,
    )
    base.update(over)
    return KernelCase(**base)  # type: ignore[arg-type]


EDGE_CASES = {
    "one-full-page-decode": make_case(phase=Phase.DECODE, q_lens=(1,), prefix_lens=(15,)),
    "one-full-page-prefill": make_case(q_lens=(16,), prefix_lens=(0,)),
    "partial-last-page": make_case(q_lens=(5, 2), prefix_lens=(30, 1)),
    "mla-partial-page": make_case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(20, 47),
    ),
    "verify-tree": make_case(
        phase=Phase.VERIFY, q_lens=(4,), prefix_lens=(9,), trees=((-1, 0, 0, 1),)
    ),
}

VARIANT_EDGES = {
    # attention types (issue 27): non-causal (encoders) and chunked local attention (Llama 4)
    "non-causal-prefill": make_case(q_lens=(6, 2), prefix_lens=(10, 0), causal=False),
    "non-causal-decode": make_case(
        phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(40, 3), causal=False
    ),
    "non-causal-tree": make_case(
        phase=Phase.VERIFY, q_lens=(4,), prefix_lens=(9,), trees=((-1, 0, 0, 1),), causal=False
    ),
    "non-causal-cap-sinks-fp8": make_case(
        q_lens=(5,),
        prefix_lens=(20,),
        causal=False,
        logit_cap=2.0,
        sinks=True,
        kv_dtype="float8_e4m3fn",
        k_scale=0.5,
        v_scale=2.0,
        dtype="bfloat16",
    ),
    "chunk-prefill-crosses-chunks": make_case(q_lens=(20, 3), prefix_lens=(9, 30), chunk=8),
    "chunk-decode-skips-pages": make_case(
        phase=Phase.DECODE, q_lens=(1, 1, 1), prefix_lens=(300, 63, 64), chunk=64
    ),
    "chunk-1": make_case(q_lens=(4,), prefix_lens=(5,), chunk=1),
    "chunk-tree": make_case(
        phase=Phase.VERIFY, q_lens=(5,), prefix_lens=(6,), trees=((-1, 0, 1, 0, 3),), chunk=4
    ),
    "chunk-window-cap-sinks-fp8": make_case(
        q_lens=(12, 1),
        prefix_lens=(21, 40),
        chunk=8,
        window_left=5,
        logit_cap=2.0,
        sinks=True,
        kv_dtype="float8_e5m2",
        k_scale=0.5,
        v_scale=2.0,
        dtype="bfloat16",
    ),
    "chunk-mla-decode": make_case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(70, 5),
        chunk=16,
    ),
    "window-0-prefill": make_case(q_lens=(5,), prefix_lens=(20,), window_left=0),
    "window-beyond-context": make_case(q_lens=(3, 1), prefix_lens=(40, 2), window_left=10_000),
    "window-decode-skips-pages": make_case(
        phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(300, 17), window_left=31
    ),
    "window-tree": make_case(
        phase=Phase.VERIFY,
        q_lens=(5,),
        prefix_lens=(9,),
        trees=((-1, 0, 0, 1, 2),),
        window_left=3,
    ),
    "cap-and-sinks": make_case(
        phase=Phase.DECODE, q_lens=(1, 1), prefix_lens=(30, 0), logit_cap=1.0, sinks=True
    ),
    "fp8-e4m3-mha": make_case(
        q_lens=(4,),
        prefix_lens=(25,),
        kv_dtype="float8_e4m3fn",
        k_scale=0.5,
        v_scale=2.0,
        dtype="bfloat16",
    ),
    "fp8-e5m2-mla": make_case(
        kind="mla",
        num_q_heads=2,
        num_kv_heads=1,
        head_dim=80,
        v_head_dim=64,
        phase=Phase.DECODE,
        q_lens=(1, 1),
        prefix_lens=(20, 47),
        kv_dtype="float8_e5m2",
        k_scale=3.0,
        v_scale=3.0,
    ),
    "everything-verify": make_case(
        phase=Phase.VERIFY,
        q_lens=(4, 3),
        prefix_lens=(33, 5),
        trees=((-1, 0, 1, 1), (-1, -1, 1)),
        window_left=6,
        logit_cap=2.0,
        sinks=True,
        kv_dtype="float8_e4m3fn",
        k_scale=0.25,
        v_scale=0.5,
    ),
}
