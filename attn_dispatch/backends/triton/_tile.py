"""What both triton kernels share: the argument bundles, the query load, the tile step (a
block of keys gathered through the page table against a block of query rows, folded into an
online softmax in the log2 domain), the sink fold and the final normalisation.

Decode (rows = the query heads of one kv head) and extend (rows = the query tokens of one
head) call the same functions, so the guards live in one place:

- a token whose page entry or page index is outside ``kv_indices`` or the cache is dropped
  (never loaded), and a row with nothing allowed yet keeps its state (no ``inf - inf``);
- a key a row may not see never reaches that row, whatever the cache holds there: its score
  is -inf, and a value that is not finite is zeroed before ``p . V`` (0 * NaN is NaN);
- a row that sees a key whose scaled score is not finite (NaN/inf in q or the key, or an
  overflow), or a value row holding NaN/inf, is marked ``bad``: its output is NaN (the
  rule of docs/concepts/safety.md for every backend).

The online-softmax state is the tuple ``(acc, m, l, bad)``: the unnormalised output, the
running max and sum of ``exp2`` (log2 units: scores carry ``log2(e)``), and the NaN flag.
Argument bundles are NamedTuples: triton passes them as tuples (each int specialised as a
lone int would be), so a kernel signature names one bundle where it listed its members.
"""

# Triton kernel parameters are typed by triton itself (pointers, ints, tl.constexpr): mypy
# cannot see those types, so it is told not to demand annotations here.
# mypy: disable-error-code="no-untyped-def,untyped-decorator"

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

#: log2(e): scores carry it, so the kernels keep their sums with exp2 (host and kernel copy).
LOG2E = 1.4426950408889634
_LOG2E = tl.constexpr(LOG2E)
#: ln(2) = 1 / log2(e): the kernels keep log2 sums; the lse they return is a natural log.
LN2 = tl.constexpr(0.6931471805599453)


#: Sizes both attention kernels take that vary between configs and batches: not specialised
#: on (value 1, multiple of 16), which would only multiply the compiled variants (a JIT
#: compile costs seconds). Each kernel adds its own.
UNSPECIALISED = (
    "page_size",
    "group_size",
    "num_pages",
    "num_indices",
    "window_left",
    "chunk_size",
    "num_requests",
)


class Widths(NamedTuple):
    """Compile-time head widths (``_dims.DimLayout``), one constexpr bundle."""

    HEAD_DIM: int
    V_DIM: int
    D_MAIN: int
    D_REST: int
    DV_BLOCK: int


class Math(NamedTuple):
    """Compile-time switches of the tile step: V read from the latent row (MLA), fp32 dots in
    IEEE precision, the soft cap, and the interpreter's upcast of every load to fp32."""

    V_FROM_K: bool
    IEEE: bool
    SOFTCAP: bool
    UPCAST: bool


class Scales(NamedTuple):
    """Runtime score and output scales (``_ops.score_args``; ``v_scale`` 1 without FP8)."""

    sm_scale_log2: float
    cap_in: float
    cap_out: float
    v_scale: float


class CacheStrides(NamedTuple):
    """Element strides of the K and V caches: page, slot, kv head (0 for MLA's one head)."""

    kp: int
    ks: int
    kh: int
    vp: int
    vs: int
    vh: int


class RowStrides(NamedTuple):
    """Strides of a [tokens, heads, ...] tensor (q, out, lse)."""

    t: int
    h: int


class PartStrides(NamedTuple):
    """Strides of the decode split scratch: partial outputs [b, h, split, dv] and their
    log2-sum-exp [b, h, split]."""

    ob: int
    oh: int
    os: int
    lb: int
    lh: int


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
def _load_rows(ptr, row_mask, W: tl.constexpr, UPCAST: tl.constexpr):
    """Query rows at ``ptr`` ([rows, 1] pointers) as the ``(main, rest)`` pair the tile dots
    take (``_dims``); ``rest`` is ``main`` again, never used, when the width is a power of
    two. Masked rows load 0."""
    offs_d = tl.arange(0, W.D_MAIN)
    main = tl.load(ptr + offs_d[None, :], mask=row_mask[:, None], other=0.0)
    if UPCAST:
        main = main.to(tl.float32)
    rest = main
    if W.D_REST > 0:
        offs_r = W.D_MAIN + tl.arange(0, W.D_REST)
        rest = tl.load(
            ptr + offs_r[None, :],
            mask=row_mask[:, None] & (offs_r < W.HEAD_DIM)[None, :],
            other=0.0,
        )
        if UPCAST:
            rest = rest.to(tl.float32)
    return main, rest


@triton.jit
def _empty_state(ROWS: tl.constexpr, DV_BLOCK: tl.constexpr):
    """The state before any key: no output, max -inf, sum 0, not NaN."""
    acc = tl.zeros([ROWS, DV_BLOCK], dtype=tl.float32)
    m = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    return acc, m, tl.zeros([ROWS], dtype=tl.float32), tl.zeros([ROWS], dtype=tl.int1)


@triton.jit
def _attend_tile(
    state,
    q,
    pages,
    sizes,
    offs_n,
    n_mask,
    allowed,
    scales,
    strides,
    W: tl.constexpr,
    M: tl.constexpr,
):
    """One key block folded into ``state``. ``q`` is the ``(main, rest)`` pair of
    ``_load_rows``; ``pages`` = ``(K, V, kv_indices, page_base, kv_head)``: the request's page
    table from ``page_base`` and the kv head read; ``sizes`` = ``(page_size, num_pages,
    num_indices)`` bound what may be read; ``allowed`` [rows, BLOCK_N] says which row sees
    which key (already bounded by the block's range). ``W``: ``Widths``, ``M``: ``Math``
    (constexpr)."""
    acc, m_i, l_i, bad = state
    q_main, q_rest = q
    K, V, kv_indices, page_base, kv_head = pages
    page_size, num_pages, num_indices = sizes
    offs_d = tl.arange(0, W.D_MAIN)
    # Never read outside kv_indices or the cache: such a token is dropped.
    entry = page_base + offs_n // page_size
    n_mask = n_mask & (entry >= 0) & (entry < num_indices)
    page = tl.load(kv_indices + entry, mask=n_mask, other=0)
    n_mask = n_mask & (page >= 0) & (page < num_pages)
    allowed = allowed & n_mask[None, :]
    slot = offs_n % page_size
    k_row = K + page.to(tl.int64) * strides.kp + slot * strides.ks + kv_head * strides.kh
    k_main = tl.load(k_row[:, None] + offs_d[None, :], mask=n_mask[:, None], other=0.0)
    # To q's dtype (fp32 under the interpreter; an exact widening of an FP8 cache).
    k_main = _widen(k_main, q_main.dtype, M.UPCAST)
    if M.IEEE:
        qk = tl.dot(q_main, tl.trans(k_main), input_precision="ieee")
    else:
        qk = tl.dot(q_main, tl.trans(k_main))
    if W.D_REST > 0:
        offs_r = W.D_MAIN + tl.arange(0, W.D_REST)
        k_rest = tl.load(
            k_row[:, None] + offs_r[None, :],
            mask=n_mask[:, None] & (offs_r < W.HEAD_DIM)[None, :],
            other=0.0,
        )
        k_rest = _widen(k_rest, q_main.dtype, M.UPCAST)
        if M.IEEE:
            qk += tl.dot(q_rest, tl.trans(k_rest), input_precision="ieee")
        else:
            qk += tl.dot(q_rest, tl.trans(k_rest))
    # The rule for scores a row reads (x - x is 0 exactly when x is finite).
    scaled = qk * scales.sm_scale_log2
    finite = (scaled - scaled) == 0.0
    bad = bad | (tl.max((allowed & ~finite).to(tl.int32), 1) > 0)
    qk = tl.where(finite, qk, 0.0)
    if M.SOFTCAP:
        qk = _soft_cap(qk, scales.cap_in, scales.cap_out)
    else:
        qk = qk * scales.sm_scale_log2
    qk = tl.where(allowed, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # A row with nothing allowed so far keeps m = -inf: shift by 0 instead (no inf - inf).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(qk - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if M.V_FROM_K:
        # MLA: V is the leading V_DIM (== D_MAIN) columns of the latent row just loaded.
        v = k_main
    else:
        offs_v = tl.arange(0, W.DV_BLOCK)
        v_row = V + page.to(tl.int64) * strides.vp + slot * strides.vs + kv_head * strides.vh
        v = tl.load(
            v_row[:, None] + offs_v[None, :],
            mask=n_mask[:, None] & (offs_v < W.V_DIM)[None, :],
            other=0.0,
        )
        v = _widen(v, q_main.dtype, M.UPCAST)
    # p = 0 for a key a row does not see, but 0 * NaN is NaN: zero what is not finite, and
    # mark the rows that do see such a value.
    v_finite = (v - v) == 0.0
    v_bad = tl.max((~v_finite).to(tl.int32), 1) > 0
    bad = bad | (tl.max((allowed & v_bad[None, :]).to(tl.int32), 1) > 0)
    v = tl.where(v_finite, v, 0.0)
    if M.IEEE:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l_i, bad


@triton.jit
def _fold_sink(state, sink):
    """The sink logit (natural log, one per row) joins the denominator only (no value). The
    rule for non-finite sinks: NaN gives a NaN row, +inf takes all the weight (output 0, lse
    +inf: ``m`` becomes +inf), -inf is no sink (weight ``exp2(-inf) = 0``)."""
    acc, m, total, bad = state
    sink = sink * _LOG2E
    bad = bad | (sink != sink)
    sink_all = sink == float("inf")
    sink = tl.where(sink_all | (sink != sink), 0.0, sink)
    m_new = tl.maximum(m, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    scale = tl.exp2(m - m_safe)
    acc = acc * scale[:, None]
    total = total * scale + tl.exp2(sink - m_safe)
    acc = tl.where(sink_all[:, None], 0.0, acc)
    return acc, tl.where(sink_all, float("inf"), m_new), total, bad


@triton.jit
def _finish(state):
    """``(out, lse2)`` of a state: the normalised output and its log2-sum-exp. A row that saw
    nothing (sum 0) gives 0 and -inf (a merge gives it no weight); a row marked bad gives NaN
    in both (a merge passes it on)."""
    acc, m, total, bad = state
    empty = total == 0.0
    out = acc / tl.where(empty, 1.0, total)[:, None]
    lse = tl.where(empty, float("-inf"), m + tl.log2(tl.where(empty, 1.0, total)))
    out = tl.where(bad[:, None], float("nan"), out)
    lse = tl.where(bad, float("nan"), lse)
    return out, lse
