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

from ._tile import _attend_tile


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
        "chunk_size",
        "num_rows",
        "num_requests",
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
    chunk_size,
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
    num_rows,
    num_requests,
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
    # Request b's query is row b of q and of the output: a request past either (a plan that
    # does not fit the tensors it is called with) reads and writes nothing.
    b_ok = b < tl.minimum(num_rows, num_requests)
    # (compared as a vector: the interpreter refuses a scalar bool broadcast into a mask)
    h_mask = (in_group < group_size) & ((in_group * 0 + b) < tl.minimum(num_rows, num_requests))
    heads = kv_head * group_size + in_group

    # (A clamped index, not a masked load: the interpreter takes no scalar mask; the host
    # launches only with at least one request.)
    b_in = tl.where(b_ok, b, 0)
    kv_len = tl.where(b_ok, tl.load(kv_lens + b_in), 0)
    page_base = tl.load(kv_indptr + b_in)
    # The query sits at position kv_len - 1 and sees keys from kv_len - 1 - window_left on
    # (window_left is huge for full attention): the splits share only that range, so keys
    # before the window are never loaded, not merely masked.
    # Chunked local attention likewise starts at the query's chunk (chunk_size is huge when
    # off, making that 0): the pages before it are skipped.
    first = tl.maximum(kv_len - 1 - window_left, 0)
    first = tl.maximum(first, (kv_len - 1) - (kv_len - 1) % chunk_size)
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
    q_rest = q_main  # placeholder when there is no rest part; never used then
    if D_REST > 0:
        offs_r = D_MAIN + tl.arange(0, D_REST)
        r_mask = offs_r < HEAD_DIM
        q_rest = tl.load(q_row + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        if UPCAST:
            q_rest = q_rest.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    bad = tl.zeros([BLOCK_H], dtype=tl.int1)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], dtype=tl.float32)

    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # The tile step extend uses too (_tile.py): dropped pages, invisible keys and
        # non-finite values are guarded there once.
        acc, m_i, l_i, bad = _attend_tile(
            acc, m_i, l_i, bad, q_main, q_rest, K, V, kv_indices, page_base, offs_n, n_mask,
            h_mask[:, None] & n_mask[None, :], page_size, num_pages, num_indices, kv_head,
            sm_scale_log2, cap_in, cap_out, stride_kp, stride_ks, stride_kh, stride_vp,
            stride_vs, stride_vh, HEAD_DIM, V_DIM, D_MAIN, D_REST, DV_BLOCK, V_FROM_K, IEEE,
            SOFTCAP, UPCAST,
        )  # fmt: skip

    # An empty split (or an empty request) leaves l_i == 0: store 0 and lse = -inf so the
    # merge gives it no weight.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    if KV_SCALED:
        # FP8 cache: V was stored divided by v_scale; the output is linear in V.
        out = out * v_scale
    lse = tl.where(empty, float("-inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    # A row that read a non-finite key or value: NaN, which the merge passes on.
    out = tl.where(bad[:, None], float("nan"), out)
    lse = tl.where(bad, float("nan"), lse)
    p_row = Part_out + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + s * stride_ps
    tl.store(p_row + offs_v[None, :], out, mask=h_mask[:, None] & v_mask[None, :])
    tl.store(Part_lse + b * stride_lb + heads * stride_lh + s, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_heads", "num_splits", "num_rows"])
def _decode_merge_kernel(
    Part_out,
    Part_lse,
    Out,
    Sinks,
    num_heads,
    num_splits,
    num_rows,
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
    h_mask = (heads < num_heads) & ((heads * 0 + b) < num_rows)  # output row b exists
    offs_v = tl.arange(0, DV_BLOCK)
    mask = h_mask[:, None] & (offs_v < V_DIM)[None, :]

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    total = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV_BLOCK], dtype=tl.float32)
    bad = tl.zeros([BLOCK_H], dtype=tl.int1)
    p_base = Part_out + b.to(tl.int64) * stride_pb + heads[:, None] * stride_ph + offs_v[None, :]
    l_base = Part_lse + b * stride_lb + heads * stride_lh
    for s in range(0, num_splits):
        lse = tl.load(l_base + s, mask=h_mask, other=float("-inf"))
        part = tl.load(p_base + s * stride_ps, mask=mask, other=0.0)
        bad = bad | (lse != lse)  # a split whose rows read a non-finite key or value
        lse = tl.where(lse != lse, float("-inf"), lse)
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
        # The rule for non-finite sinks: NaN gives NaN, +inf takes all the weight (0), and
        # -inf is no sink (weight exp2(-inf) = 0 below).
        bad = bad | (sink != sink)
        sink_all = sink == float("inf")
        sink = tl.where(sink_all | (sink != sink), 0.0, sink)
        m_new = tl.maximum(m, sink)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp2(m - m_safe)
        acc = acc * scale[:, None]
        total = total * scale + tl.exp2(sink - m_safe)
        acc = tl.where(sink_all[:, None], 0.0, acc)
    out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
    out = tl.where(bad[:, None], float("nan"), out)
    o_ptr = Out + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_v[None, :]
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=mask)
