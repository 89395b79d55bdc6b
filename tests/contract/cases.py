"""Turn a KernelCase into tensors; its reference is the float64 oracle (tests/oracle.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import tree_mask
from tests import oracle
from tests.strategies import KernelCase


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

    def extras(self) -> dict[str, object]:
        """The per-call keywords of ``attention`` this case needs."""
        kw: dict[str, object] = {}
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
    (``tests.oracle.visible_keys`` for this case's config and mask)."""
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
    """The float64 oracle's output for this case (``tests.oracle``)."""
    return naive_state(m)[0]


def reference_lse(m: Materialised) -> torch.Tensor:
    """The float64 oracle's lse for this case: natural log, sink counted once, -inf for a
    row that attends no key (``tests.oracle``)."""
    return naive_state(m)[1]


def naive_state(m: Materialised) -> tuple[torch.Tensor, torch.Tensor]:
    """``(naive_attention(m), reference_lse(m))``: ``tests.oracle.reference_state`` on the
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
