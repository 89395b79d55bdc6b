"""Paged extend attention for PREFILL and VERIFY: cached prefix, then the new tokens.

Grid (request, query head, query block of ``BLOCK_M`` rows). Request i has q_len new tokens
at the end of its kv_len cached tokens (their K/V already written), so the prefix is
``[0, kv_len - q_len)``. Pass 1 walks the prefix: without a custom mask every new token sees
all of it, so no mask work at all. Pass 2 walks the new tokens: causally it stops at the last
key the block's last query may see (tiles past the diagonal are never visited); with a custom
mask (tree verify) each tile's bits are read first and a tile with no allowed bit is skipped
before its K/V are loaded. Rows that allow no key at all come out as 0, not NaN.
"""

# Triton kernel parameters are typed by triton itself (pointers, ints, tl.constexpr): mypy
# cannot see those types, so it is told not to demand annotations here.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from ._tile import _attend_tile


@triton.jit
def _attend_block(
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
    n0,
    n_end,
    rows,
    row_mask,
    q_pos,
    Mask,
    mask_base,
    kv_len,
    page_size,
    num_pages,
    num_indices,
    num_mask,
    kv_head,
    sm_scale_log2,
    cap_in,
    cap_out,
    window_left,
    chunk_size,
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
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    USE_MASK: tl.constexpr,
    V_FROM_K: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    CHUNK: tl.constexpr,
    SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_end
    allowed = row_mask[:, None] & n_mask[None, :]
    if USE_MASK:
        bit = mask_base + rows[:, None].to(tl.int64) * kv_len + offs_n[None, :]
        bits = tl.load(Mask + bit, mask=allowed & (bit >= 0) & (bit < num_mask), other=0)
        allowed = allowed & (bits != 0)
    if CAUSAL:
        allowed = allowed & (offs_n[None, :] <= q_pos[:, None])
    if WINDOW:
        allowed = allowed & (offs_n[None, :] >= q_pos[:, None] - window_left)
    if CHUNK:
        allowed = allowed & (offs_n[None, :] >= q_pos[:, None] - q_pos[:, None] % chunk_size)
    if USE_MASK:
        # Skip a tile no row may see before loading its K/V. Only with a custom mask: the
        # causal passes never visit such tiles, and a data-dependent branch costs registers.
        if tl.max(allowed.to(tl.int32)) > 0:
            acc, m_i, l_i, bad = _attend_tile(
                acc, m_i, l_i, bad, q_main, q_rest, K, V, kv_indices, page_base, offs_n, n_mask,
                allowed, page_size, num_pages, num_indices, kv_head, sm_scale_log2, cap_in,
                cap_out, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                HEAD_DIM, V_DIM, D_MAIN, D_REST, DV_BLOCK, V_FROM_K, IEEE, SOFTCAP, UPCAST,
            )  # fmt: skip
    else:
        acc, m_i, l_i, bad = _attend_tile(
            acc, m_i, l_i, bad, q_main, q_rest, K, V, kv_indices, page_base, offs_n, n_mask,
            allowed, page_size, num_pages, num_indices, kv_head, sm_scale_log2, cap_in,
            cap_out, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            HEAD_DIM, V_DIM, D_MAIN, D_REST, DV_BLOCK, V_FROM_K, IEEE, SOFTCAP, UPCAST,
        )  # fmt: skip
    return acc, m_i, l_i, bad


# Not specialised on page size or group size: fewer compiled variants (see _decode).
@triton.jit(
    do_not_specialize=[
        "page_size",
        "group_size",
        "num_tokens",
        "num_pages",
        "num_indices",
        "num_mask",
        "window_left",
        "chunk_size",
        "num_requests",
    ]
)
def _extend_kernel(
    Q,
    K,
    V,
    Out,
    qo_indptr,
    kv_indptr,
    kv_indices,
    kv_lens,
    Mask,
    mask_indptr,
    Sinks,
    sm_scale_log2,
    cap_in,
    cap_out,
    v_scale,
    window_left,
    chunk_size,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    page_size,
    group_size,
    num_tokens,
    num_pages,
    num_indices,
    num_mask,
    num_requests,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_REST: tl.constexpr,
    DV_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr,
    V_FROM_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    WINDOW: tl.constexpr,
    WINDOW_MASK: tl.constexpr,
    CHUNK: tl.constexpr,
    CHUNK_MASK: tl.constexpr,
    NON_CAUSAL: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)

    # A request past the plan's index tensors (a grid that does not fit them) does nothing.
    # (A clamped index, not a masked load: the interpreter takes no scalar mask; the host
    # launches only with at least one request.)
    b_ok = b < num_requests
    b_in = tl.where(b_ok, b, 0)
    q_start = tl.load(qo_indptr + b_in)
    q_len = tl.where(b_ok, tl.load(qo_indptr + b_in + 1) - q_start, 0)
    m0 = mblk * BLOCK_M
    if m0 < q_len:
        kv_len = tl.load(kv_lens + b_in)
        prefix = kv_len - q_len
        page_base = tl.load(kv_indptr + b_in)
        kv_head = h // group_size
        mask_base = 0
        if USE_MASK:
            mask_base = tl.load(mask_indptr + b_in)

        rows = m0 + tl.arange(0, BLOCK_M)
        # Rows outside q (device indptr the host did not check) are neither read nor written.
        row_mask = (rows < q_len) & (q_start + rows >= 0) & (q_start + rows < num_tokens)
        q_pos = prefix + rows
        offs_d = tl.arange(0, D_MAIN)
        q_ptr = Q + (q_start + rows)[:, None].to(tl.int64) * stride_qt + h * stride_qh
        q_main = tl.load(q_ptr + offs_d[None, :], mask=row_mask[:, None], other=0.0)
        if UPCAST:
            q_main = q_main.to(tl.float32)
        q_rest = q_main  # placeholder when there is no rest part; never used then
        if D_REST > 0:
            offs_r = D_MAIN + tl.arange(0, D_REST)
            q_rest = tl.load(
                q_ptr + offs_r[None, :],
                mask=row_mask[:, None] & (offs_r < HEAD_DIM)[None, :],
                other=0.0,
            )
            if UPCAST:
                q_rest = q_rest.to(tl.float32)

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV_BLOCK], dtype=tl.float32)
        bad = tl.zeros([BLOCK_M], dtype=tl.int1)

        # Keys before the window of the block's first row are never visited (the block's
        # later rows see only later keys); partly visible tiles are masked per row.
        lo = 0
        new_start = prefix
        if WINDOW:
            if USE_MASK:
                # Tree verify: the window was folded into the mask at plan time (a node sees
                # the last window_left + 1 keys its mask allows). A mask may hide prefix keys,
                # which pushes that window further back, so walk from key 0: tiles no row
                # may see are skipped on their mask bits before any K/V load.
                lo = 0
            else:
                lo = tl.maximum(prefix + m0 - window_left, 0)
            new_start = tl.maximum(prefix, lo)
        if CHUNK:
            if not USE_MASK:
                # Keys before the chunk of the block's first row are skipped, not masked
                # (a tree mask carries its chunk, folded in at plan time).
                first_pos = prefix + m0
                lo = tl.maximum(lo, first_pos - first_pos % chunk_size)
                new_start = tl.maximum(prefix, lo)
        # Pass 1: the cached prefix, visible to every new token unless a custom mask says no.
        for n0 in range(lo, prefix, BLOCK_N):
            acc, m_i, l_i, bad = _attend_block(
                acc, m_i, l_i, bad, q_main, q_rest, K, V, kv_indices, page_base, n0, prefix,
                rows, row_mask, q_pos, Mask, mask_base, kv_len, page_size, num_pages,
                num_indices, num_mask, kv_head, sm_scale_log2, cap_in, cap_out, window_left,
                chunk_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                HEAD_DIM, V_DIM, D_MAIN, D_REST, DV_BLOCK, BLOCK_N,
                False, USE_MASK, V_FROM_K, IEEE, WINDOW_MASK, CHUNK_MASK, SOFTCAP, UPCAST,
            )  # fmt: skip
        # Pass 2: the new tokens. Causal: keys past this block's last query are never visited.
        if USE_MASK or NON_CAUSAL:
            new_end = kv_len
        else:
            new_end = tl.minimum(kv_len, prefix + m0 + BLOCK_M)
        for n0 in range(new_start, new_end, BLOCK_N):
            acc, m_i, l_i, bad = _attend_block(
                acc, m_i, l_i, bad, q_main, q_rest, K, V, kv_indices, page_base, n0, kv_len,
                rows, row_mask, q_pos, Mask, mask_base, kv_len, page_size, num_pages,
                num_indices, num_mask, kv_head, sm_scale_log2, cap_in, cap_out, window_left,
                chunk_size, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                HEAD_DIM, V_DIM, D_MAIN, D_REST, DV_BLOCK, BLOCK_N,
                not USE_MASK and not NON_CAUSAL, USE_MASK, V_FROM_K, IEEE, WINDOW_MASK,
                CHUNK_MASK, SOFTCAP, UPCAST,
            )  # fmt: skip

        if HAS_SINKS:
            # The head's sink logit joins the denominator only (no value).
            # (a vector per row: the interpreter mixes no scalar bool into a vector one)
            sink = tl.load(Sinks + h) * 1.4426950408889634 + tl.zeros([BLOCK_M], tl.float32)
            # NaN: a NaN row; +inf: all the weight, a row of 0; -inf: no sink.
            bad = bad | (sink != sink)
            sink_all = sink == float("inf")
            sink = tl.where(sink_all | (sink != sink), 0.0, sink)
            m_new = tl.maximum(m_i, sink)
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_safe)
            acc = tl.where(sink_all[:, None], 0.0, acc)
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        out = tl.where(bad[:, None], float("nan"), out)
        if KV_SCALED:
            out = out * v_scale
        offs_v = tl.arange(0, DV_BLOCK)
        o_ptr = Out + (q_start + rows)[:, None].to(tl.int64) * stride_ot + h * stride_oh
        tl.store(
            o_ptr + offs_v[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_mask[:, None] & (offs_v < V_DIM)[None, :],
        )
