"""The one tile step both triton kernels share: a block of keys gathered through the page
table against a block of query rows, folded into an online softmax in the log2 domain.

Decode (rows = the query heads of one kv head) and extend (rows = the query tokens of one
head) call the same function, so the guards live in one place:

- a token whose page entry or page index is outside ``kv_indices`` or the cache is dropped
  (never loaded), and a row with nothing allowed yet keeps its state (no ``inf - inf``);
- a key a row may not see never reaches that row, whatever the cache holds there: its score
  is -inf, and a value that is not finite is zeroed before ``p . V`` (0 * NaN is NaN);
- a row that sees a key whose scaled score is not finite (NaN/inf in q or the key, or an
  overflow), or a value row holding NaN/inf, is marked ``bad``: its output is NaN (the
  README's rule for every backend).
"""

# Triton kernel parameters are typed by triton itself (pointers, ints, tl.constexpr): mypy
# cannot see those types, so it is told not to demand annotations here.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _soft_cap(qk, cap_in, cap_out):
    """``cap * tanh(qk * sm_scale / cap)`` in the log2 domain: ``cap_in = sm_scale / cap``
    (k_scale folded in), ``cap_out = cap * log2(e)``. tanh(x) = 1 - 2 / (e^2x + 1) saturates
    to +-1 without NaN for any finite x (e^2x -> inf or 0)."""
    x = qk * cap_in
    th = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)
    return th * cap_out


@triton.jit
def _widen(x, dtype, FIX_FP8: tl.constexpr):
    """A cache block to the compute dtype. ``FIX_FP8`` (the CPU interpreter only): its FP8
    conversion reads the NaN/inf codes as ordinary numbers (e4m3fn 0x7f as 480), so they are
    put back from the bits; on the GPU the conversion instructions keep them."""
    y = x.to(dtype)
    if FIX_FP8:
        if x.dtype == tl.float8e4nv:
            bits = x.to(tl.uint8, bitcast=True)
            y = tl.where((bits & 0x7F) == 0x7F, float("nan"), y)
        elif x.dtype == tl.float8e5:
            bits = x.to(tl.uint8, bitcast=True)
            inf = tl.where((bits & 0x80) != 0, float("-inf"), float("inf"))
            special = tl.where((bits & 0x03) != 0, float("nan"), inf)
            y = tl.where((bits & 0x7C) == 0x7C, special, y)
    return y


@triton.jit
def _attend_tile(
    acc,
    m_i,
    l_i,
    bad,
    q_main,
    q_rest,
    K,
    V,
    kv_indices,
    page_base,
    offs_n,
    n_mask,
    allowed,
    page_size,
    num_pages,
    num_indices,
    kv_head,
    sm_scale_log2,
    cap_in,
    cap_out,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_REST: tl.constexpr,
    DV_BLOCK: tl.constexpr,
    V_FROM_K: tl.constexpr,
    IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """One key block: ``allowed`` [rows, BLOCK_N] says which row sees which key (already
    bounded by the block's range); returns the new ``(acc, m_i, l_i, bad)``."""
    offs_d = tl.arange(0, D_MAIN)
    # Never read outside kv_indices or the cache: such a token is dropped.
    entry = page_base + offs_n // page_size
    n_mask = n_mask & (entry >= 0) & (entry < num_indices)
    page = tl.load(kv_indices + entry, mask=n_mask, other=0)
    n_mask = n_mask & (page >= 0) & (page < num_pages)
    allowed = allowed & n_mask[None, :]
    slot = offs_n % page_size
    k_row = K + page.to(tl.int64) * stride_kp + slot * stride_ks + kv_head * stride_kh
    k_main = tl.load(k_row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    # To q's dtype (fp32 under the interpreter; an exact widening of an FP8 cache).
    k_main = _widen(k_main, q_main.dtype, UPCAST)
    if IEEE:
        qk = tl.dot(q_main, tl.trans(k_main), input_precision="ieee")
    else:
        qk = tl.dot(q_main, tl.trans(k_main))
    if D_REST > 0:
        offs_r = D_MAIN + tl.arange(0, D_REST)
        k_rest = tl.load(
            k_row[:, None] + offs_r[None, :],
            mask=n_mask[:, None] & (offs_r < HEAD_DIM)[None, :],
            other=0.0,
        )
        k_rest = _widen(k_rest, q_main.dtype, UPCAST)
        if IEEE:
            qk += tl.dot(q_rest, tl.trans(k_rest), input_precision="ieee")
        else:
            qk += tl.dot(q_rest, tl.trans(k_rest))
    # The rule for scores a row reads (x - x is 0 exactly when x is finite).
    scaled = qk * sm_scale_log2
    finite = (scaled - scaled) == 0.0
    bad = bad | (tl.max((allowed & ~finite).to(tl.int32), 1) > 0)
    qk = tl.where(finite, qk, 0.0)
    if SOFTCAP:
        qk = _soft_cap(qk, cap_in, cap_out)
    else:
        qk = qk * sm_scale_log2
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing allowed so far keeps m = -inf: shift by 0 instead (no inf - inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_FROM_K:
        # MLA: V is the leading V_DIM (== D_MAIN) columns of the latent row just loaded.
        v = k_main
    else:
        offs_v = tl.arange(0, DV_BLOCK)
        v_row = V + page.to(tl.int64) * stride_vp + slot * stride_vs + kv_head * stride_vh
        v = tl.load(
            v_row[:, None] + offs_v[None, :],
            mask=n_mask[:, None] & (offs_v < V_DIM)[None, :],
            other=0.0,
        )
        v = _widen(v, q_main.dtype, UPCAST)
    # p = 0 for a key a row does not see, but 0 * NaN is NaN: zero what is not finite, and
    # mark the rows that do see such a value.
    v_finite = (v - v) == 0.0
    v_bad = tl.max((~v_finite).to(tl.int32), 1) > 0
    bad = bad | (tl.max((allowed & v_bad[None, :]).to(tl.int32), 1) > 0)
    v = tl.where(v_finite, v, 0.0)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i, bad
