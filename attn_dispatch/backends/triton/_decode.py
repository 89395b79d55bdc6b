"""Split-KV paged decode: stage 1 attends one slice of each sequence, stage 2 merges slices.

Stage 1 runs on a grid (request, head group, kv split). A head group is up to ``BLOCK_H``
query heads that read the same KV head (GQA group, or every head for MLA), so q.k is one
``tl.dot`` of [BLOCK_H, D] x [D, BLOCK_N] and each gathered K/V block is read once for the
whole group. Each program walks its slice in blocks of ``BLOCK_N`` tokens gathered through the
page table, keeps an online softmax in the log2 domain, and writes its normalised partial
output and log2-sum-exp. Stage 2 (grid: request, head block) folds the splits together, adds
the sink, and writes the output and, when asked (``STORE_LSE``), the row's lse (natural log).

Only device tensors are read inside the kernels: the number of splits is a launch constant
chosen by ``plan`` from host copies, so a launch never waits on the device (CUDA-graph safe).
"""

# Triton kernel parameters are typed by triton itself (pointers, ints, tl.constexpr): mypy
# cannot see those types, so it is told not to demand annotations here.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

import triton
import triton.language as tl

from ._tile import LN2
from ._tile import UNSPECIALISED
from ._tile import _attend_tile
from ._tile import _empty_state
from ._tile import _finish
from ._tile import _fold_sink
from ._tile import _load_rows


@triton.jit(do_not_specialize=[*UNSPECIALISED, "groups_per_kv", "num_splits", "num_rows"])
def _decode_split_kernel(
    Q, K, V, kv_indptr, kv_indices, kv_lens,  # as _extend_kernel (_ops.common_args)
    scales, window_left, chunk_size, q_strides, kv_strides,
    Part_out, Part_lse, part_strides,
    page_size, group_size, groups_per_kv, num_splits, num_pages, num_indices, num_rows,
    num_requests,
    W: tl.constexpr, M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_SCALED: tl.constexpr,
):  # fmt: skip
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

    q_row = Q + b.to(tl.int64) * q_strides.t + heads[:, None].to(tl.int64) * q_strides.h
    q = _load_rows(q_row, h_mask, W, M.UPCAST)
    pages = (K, V, kv_indices, page_base, kv_head)
    sizes = (page_size, num_pages, num_indices)
    state = _empty_state(BLOCK_H, W.DV_BLOCK)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # The tile step extend uses too (_tile.py): dropped pages, invisible keys and
        # non-finite values are guarded there once.
        allowed = h_mask[:, None] & n_mask[None, :]
        state = _attend_tile(
            state, q, pages, sizes, offs_n, n_mask, allowed, scales, kv_strides, W, M
        )

    # An empty split (or an empty request) stores 0 and lse = -inf, so the merge gives it
    # no weight; a row that read a non-finite key or value stores NaN, which it passes on.
    out, lse = _finish(state)
    if KV_SCALED:
        # FP8 cache: V was stored divided by v_scale; the output is linear in V.
        out = out * scales.v_scale
    offs_v = tl.arange(0, W.DV_BLOCK)
    p_row = Part_out + b.to(tl.int64) * part_strides.ob + heads[:, None] * part_strides.oh
    p_row += s * part_strides.os
    tl.store(p_row + offs_v[None, :], out, mask=h_mask[:, None] & (offs_v < W.V_DIM)[None, :])
    l_row = Part_lse + b * part_strides.lb + heads * part_strides.lh
    tl.store(l_row + s, lse, mask=h_mask)


@triton.jit(do_not_specialize=["num_heads", "num_splits", "num_rows"])
def _decode_merge_kernel(
    Part_out, Part_lse, part_strides, Out, Lse, out_strides, lse_strides, Sinks,
    num_heads, num_splits, num_rows,
    V_DIM: tl.constexpr, DV_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_SINKS: tl.constexpr, STORE_LSE: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = (heads < num_heads) & ((heads * 0 + b) < num_rows)  # output row b exists
    offs_v = tl.arange(0, DV_BLOCK)
    mask = h_mask[:, None] & (offs_v < V_DIM)[None, :]

    acc, m, total, bad = _empty_state(BLOCK_H, DV_BLOCK)
    p_base = Part_out + b.to(tl.int64) * part_strides.ob + heads[:, None] * part_strides.oh
    p_base += offs_v[None, :]
    l_base = Part_lse + b * part_strides.lb + heads * part_strides.lh
    for s in range(0, num_splits):
        lse = tl.load(l_base + s, mask=h_mask, other=float("-inf"))
        part = tl.load(p_base + s * part_strides.os, mask=mask, other=0.0)
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
    state = (acc, m, total, bad)
    if HAS_SINKS:
        # The head's sink logit, as one more split with a zero partial output.
        state = _fold_sink(state, tl.load(Sinks + heads, mask=h_mask, other=0.0))
    out, lse = _finish(state)
    o_ptr = Out + b.to(tl.int64) * out_strides.t + heads[:, None] * out_strides.h
    tl.store(o_ptr + offs_v[None, :], out.to(Out.dtype.element_ty), mask=mask)
    if STORE_LSE:
        tl.store(
            Lse + b.to(tl.int64) * lse_strides.t + heads * lse_strides.h, lse * LN2, mask=h_mask
        )
