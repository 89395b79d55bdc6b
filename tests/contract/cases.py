"""Turn a KernelCase into tensors, and the naive reference the contract suite checks against."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from attn_dispatch import AttnBatch
from attn_dispatch import AttnConfig
from attn_dispatch import tree_mask
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
    q = torch.randn(t, case.num_q_heads, case.head_dim, generator=g).to(dtype)
    # An FP8 cache holds K / k_scale and V / v_scale (values from the same random draw).
    kv_dtype = dtype if case.kv_dtype is None else getattr(torch, case.kv_dtype)
    k_div = case.k_scale if case.kv_dtype is not None else 1.0
    v_div = case.v_scale if case.kv_dtype is not None else 1.0
    if case.kind == "mla":
        k_cache = (torch.randn(total, ps, case.head_dim, generator=g) / k_div).to(kv_dtype)
        v_cache = None
    else:
        k_cache = torch.randn(total, ps, case.num_kv_heads, case.head_dim, generator=g)
        k_cache = (k_cache / k_div).to(kv_dtype)
        v_cache = torch.randn(total, ps, case.num_kv_heads, case.v_head_dim, generator=g)
        v_cache = (v_cache / v_div).to(kv_dtype)
    sinks = None
    if case.sinks:
        sinks = torch.randn(case.num_q_heads, generator=g) * 2.0
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
    """bool ``[q_len, kv_len]`` of request ``i``: which keys each of its queries sees (its
    mask, or causal; then the window keeps the last ``window_left + 1`` of those)."""
    c = m.config
    qo = m.batch.qo_indptr_host.tolist()
    kl = int(m.batch.kv_lens_host[i])
    ql = qo[i + 1] - qo[i]
    if m.masks is not None:
        allowed = m.masks[i].clone()
    elif not c.causal:
        allowed = torch.ones(ql, kl, dtype=torch.bool)
    else:
        allowed = torch.zeros(ql, kl, dtype=torch.bool)
        for j in range(ql):
            allowed[j, : kl - ql + j + 1] = True
    if c.attention_chunk_size is not None:
        # A query at sequence position p (its allowed keys - 1) sees (p // C) * C ..= p.
        for j in range(ql):
            seen = allowed[j].nonzero().flatten()
            p = len(seen) - 1
            allowed[j, seen[: p - p % c.attention_chunk_size]] = False
    if c.window_left is not None:
        for j in range(ql):
            seen = allowed[j].nonzero().flatten()
            allowed[j, seen[: max(0, len(seen) - (c.window_left + 1))]] = False
    return allowed


def naive_attention(m: Materialised) -> torch.Tensor:
    """Plain per-request, per-head attention in float64 with a dense mask, on the dequantised
    cache, with the layer variants written out the simplest way (docs/guides/variants.md):
    the window keeps the last ``window_left + 1`` keys each query's mask allows
    (for a causal mask: positions ``p - window_left ..= p``), the cap is
    ``cap * tanh(s / cap)``, and a sink is one more logit in the softmax's denominator."""
    return naive_state(m)[0]


def reference_lse(m: Materialised) -> torch.Tensor:
    """float64 ``[tokens, num_q_heads]``: the natural log of the sum of exp(score) over the
    keys each query attends (scores after sm_scale, the FP8 k_scale and the cap), the sink
    counted once (docs/guides/lse-cascade.md); -inf for a row that attends
    no key."""
    return naive_state(m)[1]


def naive_state(m: Materialised) -> tuple[torch.Tensor, torch.Tensor]:
    """``(naive_attention(m), reference_lse(m))`` in one pass, float64."""
    c = m.config
    ps = c.page_size
    q = m.q.cpu().double()
    k_scale = m.k_scale if c.kv_fp8 else 1.0
    v_scale = m.v_scale if c.kv_fp8 else 1.0
    k_cache = m.k_cache.cpu().double() * k_scale
    v_cache = None if m.v_cache is None else m.v_cache.cpu().double() * v_scale
    dv = int(c.v_head_dim or c.head_dim)
    out = torch.zeros(q.shape[0], c.num_q_heads, dv, dtype=torch.float64)
    lse = torch.full((q.shape[0], c.num_q_heads), -math.inf, dtype=torch.float64)
    qo = m.batch.qo_indptr_host.tolist()
    kv_lens = m.batch.kv_lens_host.tolist()
    for i, table in enumerate(m.page_tables):
        kl = kv_lens[i]
        ql = qo[i + 1] - qo[i]
        pages = [table[t // ps] for t in range(kl)]
        slots = [t % ps for t in range(kl)]
        allowed = visible_keys(m, i)
        for h in range(c.num_q_heads):
            kvh = h // c.group_size
            if c.kind == "mla":
                keys = k_cache[pages, slots]
                vals = keys[:, :dv]
            else:
                assert v_cache is not None
                keys = k_cache[pages, slots, kvh]
                vals = v_cache[pages, slots, kvh]
            qi = q[qo[i] : qo[i + 1], h]
            s = (qi @ keys.T) * m.sm_scale
            if c.logit_cap is not None:
                s = c.logit_cap * torch.tanh(s / c.logit_cap)
            s = s.masked_fill(~allowed, -math.inf)
            if m.sinks is not None:
                sink = torch.full((ql, 1), float(m.sinks[h]), dtype=torch.float64)
                s = torch.cat((s, sink), dim=1)
                vals = torch.cat((vals, torch.zeros(1, dv, dtype=torch.float64)))
            out[qo[i] : qo[i + 1], h] = torch.softmax(s, dim=-1) @ vals
            lse[qo[i] : qo[i + 1], h] = torch.logsumexp(s, dim=-1)
    return out, lse


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
