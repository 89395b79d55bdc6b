"""Paged extend attention for PREFILL and VERIFY: cached prefix, then the new tokens.

Grid (request, query head, query block of ``BLOCK_M`` rows). Request i has q_len new tokens
at the end of its kv_len cached tokens (their K/V already written), so the prefix is
``[0, kv_len - q_len)``. Pass 1 walks the prefix: without a custom mask every new token sees
all of it, so no mask work at all. Pass 2 walks the new tokens: causally it stops at the last
key the block's last query may see (tiles past the diagonal are never visited); with a custom
mask (tree verify) each tile's bits are read first and a tile with no allowed bit is skipped
before its K/V are loaded. Rows that allow no key at all come out as 0, not NaN (lse -inf).
With ``STORE_LSE`` each row's lse (natural log, sink included) is written too.
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


@triton.jit
def _attend_range(
    state, q, pages, sizes, lo, hi, n_end, rows, mask, scales, strides, keys,
    W: tl.constexpr, M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    USE_MASK: tl.constexpr, WINDOW: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """Keys ``[lo, hi)`` (bounded by ``n_end``) into ``state``, block by block (arguments as
    ``_attend_tile``'s). ``rows`` = ``(rows, row_mask, q_pos)``: the block's query rows,
    which exist, and their positions; ``mask`` = ``(Mask, mask_base, kv_len, num_mask)``: the
    request's custom mask rows; ``keys`` = ``(window_left, chunk_size)``."""
    rows, row_mask, q_pos = rows
    Mask, mask_base, kv_len, num_mask = mask
    window_left, chunk_size = keys
    for n0 in range(lo, hi, BLOCK_N):
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
                state = _attend_tile(
                    state, q, pages, sizes, offs_n, n_mask, allowed, scales, strides, W, M
                )
        else:
            state = _attend_tile(
                state, q, pages, sizes, offs_n, n_mask, allowed, scales, strides, W, M
            )
    return state


@triton.jit(do_not_specialize=[*UNSPECIALISED, "num_tokens", "num_mask"])
def _extend_kernel(
    Q, K, V, kv_indptr, kv_indices, kv_lens,  # as _decode_split_kernel (_ops.common_args)
    scales, window_left, chunk_size, q_strides, kv_strides,
    Out, Lse, out_strides, lse_strides,
    qo_indptr, Mask, mask_indptr, Sinks,
    page_size, group_size, num_tokens, num_pages, num_indices, num_mask, num_requests,
    W: tl.constexpr, M: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_MASK: tl.constexpr, WINDOW: tl.constexpr, WINDOW_MASK: tl.constexpr,
    CHUNK: tl.constexpr, CHUNK_MASK: tl.constexpr, NON_CAUSAL: tl.constexpr,
    HAS_SINKS: tl.constexpr, KV_SCALED: tl.constexpr, STORE_LSE: tl.constexpr,
):  # fmt: skip
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
        q_ptr = Q + (q_start + rows)[:, None].to(tl.int64) * q_strides.t + h * q_strides.h
        q = _load_rows(q_ptr, row_mask, W, M.UPCAST)
        state = _empty_state(BLOCK_M, W.DV_BLOCK)

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
        # What both passes share: the request's pages, the rows, the mask, the key bounds.
        pages = (K, V, kv_indices, page_base, kv_head)
        sizes = (page_size, num_pages, num_indices)
        rows_at = (rows, row_mask, q_pos)
        mask = (Mask, mask_base, kv_len, num_mask)
        keys = (window_left, chunk_size)
        # Pass 1: the cached prefix, visible to every new token unless a custom mask says no.
        state = _attend_range(
            state, q, pages, sizes, lo, prefix, prefix, rows_at, mask, scales, kv_strides, keys,
            W, M, BLOCK_N, False, USE_MASK, WINDOW_MASK, CHUNK_MASK,
        )  # fmt: skip
        # Pass 2: the new tokens. Causal: keys past this block's last query are never visited.
        if USE_MASK or NON_CAUSAL:
            new_end = kv_len
        else:
            new_end = tl.minimum(kv_len, prefix + m0 + BLOCK_M)
        state = _attend_range(
            state, q, pages, sizes, new_start, new_end, kv_len, rows_at, mask, scales,
            kv_strides, keys, W, M, BLOCK_N, not USE_MASK and not NON_CAUSAL, USE_MASK,
            WINDOW_MASK, CHUNK_MASK,
        )  # fmt: skip

        if HAS_SINKS:
            # (a vector per row: the interpreter mixes no scalar bool into a vector one)
            state = _fold_sink(state, tl.load(Sinks + h) + tl.zeros([BLOCK_M], tl.float32))
        out, lse = _finish(state)
        if KV_SCALED:
            out = out * scales.v_scale
        offs_v = tl.arange(0, W.DV_BLOCK)
        o_ptr = Out + (q_start + rows)[:, None].to(tl.int64) * out_strides.t + h * out_strides.h
        tl.store(
            o_ptr + offs_v[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_mask[:, None] & (offs_v < W.V_DIM)[None, :],
        )
        if STORE_LSE:
            l_ptr = Lse + (q_start + rows).to(tl.int64) * lse_strides.t + h * lse_strides.h
            tl.store(l_ptr, lse * LN2, mask=row_mask)
