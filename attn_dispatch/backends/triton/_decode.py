"""Split-KV paged decode: stage 1 attends one slice of each sequence, stage 2 merges slices.

Stage 1 runs on a grid (request, head group, kv split). A head group is up to ``BLOCK_H``
query heads that read the same KV head (GQA group, or every head for MLA), so q.k is one
``tl.dot`` of [BLOCK_H, D] x [D, BLOCK_N] and each gathered K/V block is read once for the
whole group. Each program walks its slice in blocks of ``BLOCK_N`` tokens gathered through the
page table, keeps an online softmax in the log2 domain, and writes its normalised partial
output and log2-sum-exp. Stage 2 (grid: request, head block) folds the splits together.

Only device tensors are read inside the kernels: the number of splits is a launch constant
chosen by ``plan`` from host copies, so a launch never waits on the device (CUDA-graph safe).
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


# Sizes that vary between configs and batches are not specialised on (value 1, multiple of
# 16): it would only multiply the compiled variants (a JIT compile costs seconds).
@triton.jit(
    do_not_specialize=[
        "page_size",
        "group_size",
        "groups_per_kv",
        "num_splits",
        "num_pages",
        "num_indices",
        "window_left",
    ]
)
def _decode_split_kernel(
    Q,
    K,
    V,
    kv_indptr,
    kv_indices,
    kv_lens,
    Part_out,
    Part_lse,
    sm_scale_log2,
    cap_in,
    cap_out,
    v_scale,
    window_left,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    page_size,
    group_size,
    groups_per_kv,
    num_splits,
    num_pages,
    num_indices,
    HEAD_DIM: tl.constexpr,
    V_DIM: tl.constexpr,
    D_MAIN: tl.constexpr,
    D_REST: tl.constexpr,
    DV_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    V_FROM_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_SCALED: tl.constexpr,
):
    b = tl.program_id(0)
    hg = tl.program_id(1)
    s = tl.program_id(2)

    kv_head = hg // groups_per_kv
    in_group = (hg % groups_per_kv) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = in_group < group_size
    heads = kv_head * group_size + in_group

    kv_len = tl.load(kv_lens + b)
    page_base = tl.load(kv_indptr + b)
    # The query sits at position kv_len - 1 and sees keys from kv_len - 1 - window_left on
    # (window_left is huge for full attention): the splits share only that range, so keys
    # before the window are never loaded, not merely masked.
    first = tl.maximum(kv_len - 1 - window_left, 0)
    # Every split gets the same whole number of blocks; trailing splits may be empty.
    split_len = tl.cdiv(tl.cdiv(kv_len - first, num_splits), BLOCK_N) * BLOCK_N
    start = first + s * split_len
    end = tl.minimum(start + split_len, kv_len)

    offs_d = tl.arange(0, D_MAIN)
    offs_v = tl.arange(0, DV_BLOCK)
    v_mask = offs_v < V_DIM
    q_row = Q + b.to(tl.int64) * stride_qt + heads[:, None].to(tl.int64) * stride_qh
    q_main = tl.load(q_row + offs_d[None, :], mask=h_mask[:, None], other=0.0)
    if UPCAST:
        q_main = q_main.to(tl.float32)
    if D_REST > 0:
        offs_r = D_MAIN + tl.arange(0, D_REST)
        r_mask = offs_r < HEAD_DIM
        q_rest = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            q_rest = q_rest.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # Never read outside kv_indices or the cache: an index the host did not check (CUDA
        # without validate) that points outside drops its token instead of faulting.
        entry = page_base + offs_n // page_size
        n_mask = n_mask & (entry >= 0) & (entry < num_indices)
        page = tl.load(kv_indices + entry, mask=n_mask, other=0)
        n_mask = n_mask & (page >= 0) & (page < num_pages)
        slot = offs_n % page_size
        k_row = K + page.to(tl.int64) * stride_kp + slot * stride_ks + kv_head * stride_kh
        k_main = tl.load(k_row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
        # To q's dtype: fp32 under the interpreter (UPCAST), and an exact widening of an FP8
        # cache on the GPU (e4m3/e5m2 values are all representable in fp16/bf16).
        k_main = k_main.to(q_main.dtype)
        if IEEE:
            qk = tl.dot(q_main, tl.trans(k_main), input_precision="ieee")
        else:
            qk = tl.dot(q_main, tl.trans(k_main))
        if D_REST > 0:
            k_rest = tl.load(
                k_row[:, None] + offs_r[None, :],
                mask=n_mask[:, None] & r_mask[None, :],
                other=0.0,
            )
            k_rest = k_rest.to(q_main.dtype)
            if IEEE:
                qk += tl.dot(q_rest, tl.trans(k_rest), input_precision="ieee")
            else:
                qk += tl.dot(q_rest, tl.trans(k_rest))
        if SOFTCAP:
            qk = _soft_cap(qk, cap_in, cap_out)
        else:
            qk = qk * sm_scale_log2
        qk = tl.where(n_mask[None, :], qk, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(qk, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)

        if V_FROM_K:
            # MLA: V is the leading V_DIM (== D_MAIN) columns of the latent row just loaded.
            v = k_main
        else:
            v_row = V + page.to(tl.int64) * stride_vp + slot * stride_vs + kv_head * stride_vh
            v = tl.load(
                v_row[:, None] + offs_v[None, :], mask=n_mask[:, None] & v_mask[None, :], other=0.0
            )
            v = v.to(q_main.dtype)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # An empty split (or an empty request) leaves l_i == 0: store 0 and lse = -inf so the
    # merge gives it no weight.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_SCALED:
        # FP8 cache: V was stored divided by v_scale; the output is linear in V.
        out = out * v_scale
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    p_row = Part_out + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + s * stride_ps
    tl.store(p_row + offs_v[None, :], out, mask=h_mask[:, None] & v_mask[None, :])
    tl.store(Part_lse + b * stride_lb + heads * stride_lh + s, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_heads", "num_splits"])
def _decode_merge_kernel(
    Part_out,
    Part_lse,
    Out,
    Sinks,
    num_heads,
    num_splits,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ot,
    stride_oh,
    V_DIM: tl.constexpr,
    DV_BLOCK: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = heads < num_heads
    offs_v = tl.arange(0, DV_BLOCK)
    mask = h_mask[:, None] & (offs_v < V_DIM)[None, :]

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], dtype=tl.float32)
    p_base = Part_out + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + offs_v[None, :]
    l_base = Part_lse + b * stride_lb + heads * stride_lh
    for s in range(0, num_splits):
        lse = tl.load(l_base + s, mask=h_mask, other=float("-inf"))
        part = tl.load(p_base + s * stride_ps, mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        # All of this head's splits so far empty: keep everything at zero, avoid inf - inf.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe)
        acc = acc * scale[:, None] + w[:, None] * part
        total = total * scale + w
        m = m_new
    if HAS_SINKS:
        # The sink logit (natural log, one per head) joins the denominator only: a split
        # with lse = sink * log2(e) and a zero partial output.
        sink = tl.load(Sinks + heads, mask=h_mask, other=0.0) * 1.4426950408889634
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp2(m - m_safe)
        acc = acc * scale[:, None]
        total = total * scale + tl.exp2(sink - m_safe)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    o_ptr = Out + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mask)
