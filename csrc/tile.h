// Tile layer of the native kernels: what every item kernel (fused_item, item_impl in
// kernels_impl.h, bf16_item in bf16_path.h) shares: per-thread buffers, the tile geometry and
// per-row prologue, the masks (causal limit, window, chunk, custom mask, NaN guards) and the
// finish of a row (normalise, sinks, lse, or a split's partial result).
//
// Compiles alone (see simd.h for NA_NS and NA_W).
#ifndef NATIVE_ATTN_TILE_H
#define NATIVE_ATTN_TILE_H
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace NA_NS {

// Per-thread buffers, grown on demand and kept for the life of the thread.
struct Buffers {
  std::vector<float> q, k, v, s, acc, m, l;
  // False when a buffer could not be grown (the item then returns -2).
  bool ensure(int rows, int dp, int dvp) noexcept {
    auto grow = [](std::vector<float>& b, size_t n) {
      if (b.size() < n) b.resize(n);
    };
    try {
    grow(q, size_t(rows) * dp);
    grow(k, size_t(BK) * dp);
    grow(v, size_t(BK) * dvp);
    grow(s, size_t(rows) * BK);
    grow(acc, size_t(rows) * dvp);
    grow(m, size_t(rows));
    grow(l, size_t(rows));
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }
};
static thread_local Buffers tls_buffers;

// What an e4m3fn value loads as, times this, is its value (a power of two: exact); k_scale
// and v_scale absorb it once per call instead of a multiply per vector.
static inline float f8_unit(const NaProblem& P) {
  return P.kv_dtype == NA_E4M3 ? kF8Unit : 1.0f;
}

// Where row jj of a tile comes from: its request and query index. A tile's own request's
// query q0 + jj, or for a cascade tile the group's (q0 + jj)-th cascade token.
struct RowSrc {
  int req, j;
};
static inline RowSrc row_src(const NaProblem& P, const NaItem& it, int jj) {
  if (!it.shared) return RowSrc{it.req, it.q0 + jj};
  const int32_t* c = P.ctoks + 2 * (int64_t(it.cbase) + it.q0 + jj);
  return RowSrc{c[0], c[1]};
}

// ln 2: the kernels keep scores in log2 units; lse is reported in natural-log units.
constexpr float kLn2 = 0.6931471805599453f;

// The geometry of one work item, read by every item kernel (the shared prologue): rows are
// ordered (kv head gi, query jj, head hh), r = gi * R1 + jj * nh + hh.
struct Tile {
  int Hq, Hkv, D, Dv, ps, G;
  int nh, nq, R1;  // heads and queries per kv head; R1 = nh * nq rows per kv head
  int nkv, R;      // kv heads in the tile; R = nkv * R1 rows in all
  bool mla;
  const int32_t* pages;  // the request's page table
  Tile(const NaProblem& P, const NaItem& it)
      : Hq(P.num_q_heads),
        Hkv(P.num_kv_heads),
        D(P.head_dim),
        Dv(P.v_head_dim),
        ps(P.page_size),
        G(P.num_q_heads / P.num_kv_heads),
        nh(it.h1 - it.h0),
        nq(it.q1 - it.q0),
        R1(nh * nq),
        nkv(it.kv_head_end - it.kv_head),
        R(nkv * R1),
        mla(P.kind == NA_MLA),
        pages(P.kv_indices + P.kv_indptr[it.req]) {}
  // The cache slot (page * page_size + offset) of key position pos.
  int64_t slot(int pos) const { return int64_t(pages[pos / ps]) * ps + pos % ps; }
  int query_of(int r) const { return (r % R1) / nh; }
  int head_of(const NaItem& it, int r) const { return (it.kv_head + r / R1) * G + it.h0 + r % nh; }
  // Elements between two tokens' rows of the K (and V) cache: one head's rows are this far
  // apart, a token's heads adjacent.
  int64_t kstride() const { return mla ? D : int64_t(Hkv) * D; }
  int64_t vstride() const { return mla ? D : int64_t(Hkv) * Dv; }
};

// Calls f(pos, s0, run) for each run of consecutive cache slots among key positions pos0 ..
// pos1 - 1 of the tile's request: positions pos .. pos + run - 1 are slots s0 .. s0 + run - 1
// (one page, or its part in range). T.slot per run: one division per page, not one per key.
template <typename F>
__attribute__((always_inline)) inline void for_page_runs(const Tile& T, int pos0, int pos1,
                                                         F&& f) {
  for (int pos = pos0; pos < pos1;) {
    const int off = pos % T.ps;
    const int run = std::min(pos1 - pos, T.ps - off);
    f(pos, int64_t(T.pages[pos / T.ps]) * T.ps + off, run);
    pos += run;
  }
}

// Queues on q (a prefetch queue: PfCursor, rows_path.h's PfLines) the K then V rows of key
// positions pos0 .. pos1 - 1 of the tile's request, in address order (K and V of each key
// in turn).
template <typename Q, typename KT>
__attribute__((always_inline)) inline void queue_page_rows(Q& q, const Tile& T, int pos0,
                                                           int pos1, const KT* kbase,
                                                           const KT* vbase, int64_t kstride,
                                                           int64_t vstride, int klines,
                                                           int vlines) {
  for_page_runs(T, pos0, pos1, [&](int, int64_t s0, int run) {
    for (int i = 0; i < run; ++i) {
      q.add(kbase + (s0 + i) * kstride, klines);
      q.add(vbase + (s0 + i) * vstride, vlines);
    }
  });
}

// The lines of the rows a few blocks ahead, issued a few at a time between the compute
// steps of the current block. A burst of hundreds of prefetches fills the core's miss
// buffers and stalls it until memory answers (fetch and compute then add up instead of
// overlapping); spread evenly, the block's compute hides the fetch of a later block.
// Lines per step() above which the cursor keeps its per-line counters (paced, below).
constexpr int kPfBurst = 16;
struct PfCursor {
  const char* rows[2 * BK];
  int len[2 * BK];
  int nrows = 0, row = 0, line = 0, quota = 1;
  bool lean = false, paced = true;
  // The next line to issue (of entry row) and the end of that entry, kept by add and step.
  const char* cur = nullptr;
  const char* end = nullptr;
  void reset() { nrows = row = line = 0; }
  void add(const void* r, int lines) {
    if (lines <= 0) return;
    if (nrows == 2 * BK) {  // full (more than one block queued): issue what is queued first
      flush();
      reset();
    }
    const char* c = static_cast<const char*>(r);
    // A row that starts where the last one ends (a page run of rows holding every head)
    // extends it: one entry instead of one per key.
    if (nrows > 0 && rows[nrows - 1] + 64 * int64_t(len[nrows - 1]) == c) {
      len[nrows - 1] += lines;
      if (nrows - 1 == row) end += 64 * int64_t(lines);
      return;
    }
    rows[nrows] = c;
    len[nrows++] = lines;
    if (nrows - 1 == row) {
      cur = c;
      end = c + 64 * int64_t(lines);
    }
  }
  // Spread the queued lines over `calls` calls of step().
  void plan(int calls) {
    int total = 0;
    for (int i = 0; i < nrows; ++i) total += len[i];
    quota = std::max(1, (total + calls - 1) / std::max(1, calls));
    paced = !lean || quota > kPfBurst;
  }
  // Before the first queue_rows: whether this call may take the lean step (NaProblem's
  // lean_prefetch: its K/V small enough to be in cache).
  void set_lean(bool l) {
    lean = l;
    paced = !l;
  }
  // Inlined into the tile loops (out of line it was a call per score tile and value chunk).
  // The same lines in the same order either way:
  // - lean (a call whose K/V may be in cache, na::kLeanPrefetchBytes, and quota <=
  //   kPfBurst): one pointer walks the current entry, a prefetch, an add and a compare per
  //   line. The per-line counters below cost ~11 instructions a line, and the
  //   decode kernel with its K/V in L2 or L3 spent ~20% of its samples there (perf, the vLLM
  //   tiny model's shape: quota 13); lean, that shape's decode takes 0.80-0.91x the time.
  // - paced (the rest): the counters' instructions space the prefetches out. Issued back to
  //   back, lines that miss L2 made decode from DRAM slower: MHA (22 lines a step) 1.15-1.25x
  //   on one thread, GQA 32/8 (8 lines a step) 1.02-1.07x on two (AMD EPYC, avx512bf16).
  // plan() picks the mode right after queue_rows (nothing issued yet), so the two positions
  // (row and line, cur and end) agree whenever the mode changes.
  __attribute__((always_inline)) void step() {
    if (paced) {
      for (int q = quota; q > 0 && row < nrows; --q) {
        __builtin_prefetch(rows[row] + 64 * int64_t(line), 0, 1);
        if (++line == len[row]) {
          line = 0;
          ++row;
        }
      }
      return;
    }
    for (int q = quota; q > 0 && row < nrows; --q) {
      __builtin_prefetch(cur, 0, 1);  // prefetcht2: into L2
      cur += 64;
      if (cur == end) {
        ++row;
        if (row < nrows) {
          cur = rows[row];
          end = cur + 64 * int64_t(len[row]);
        }
      }
    }
  }
  void flush() {
    while (row < nrows) step();
  }
  // Issues what is left of the previous queue, then queues whole rows (every head) of key
  // positions pos0 .. pos1 - 1 of the tile's request, K then V per token, in address order.
  template <typename KT>
  void queue_rows(const Tile& T, int pos0, int pos1, const KT* kbase, const KT* vbase,
                  int64_t kstride, int64_t vstride, int klines, int vlines) {
    flush();
    reset();
    // Per page run, its K rows then its V rows (each tensor in address order), so that
    // adjacent rows merge into one entry (add). Where they follow each other in memory (the
    // tile holds every head of the token) the run is added as that one entry at once.
    const bool kdense = kstride * int64_t(sizeof(KT)) == 64 * int64_t(klines);
    const bool vdense = vstride * int64_t(sizeof(KT)) == 64 * int64_t(vlines);
    for_page_runs(T, pos0, pos1, [&](int, int64_t s0, int run) {
      if (kdense) {
        add(kbase + s0 * kstride, run * klines);
      } else {
        for (int i = 0; i < run; ++i) add(kbase + (s0 + i) * kstride, klines);
      }
      if (vdense) {
        add(vbase + s0 * vstride, run * vlines);
      } else {
        for (int i = 0; i < run; ++i) add(vbase + (s0 + i) * vstride, vlines);
      }
    });
  }
};

// kp[t], vp[t] = the K and V rows of key positions k0 .. k0 + n - 1 (the slots of T.slot),
// computed per page run (for_page_runs).
template <typename KT>
static inline void block_rows(const Tile& T, int k0, int n, const KT* kbase, const KT* vbase,
                              int64_t kstride, int64_t vstride, const KT** kp, const KT** vp) {
  for_page_runs(T, k0, k0 + n, [&](int pos, int64_t s0, int run) {
    const int t = pos - k0;
    const KT* kr = kbase + s0 * kstride;
    const KT* vr = vbase + s0 * vstride;
    for (int i = 0; i < run; ++i) {
      kp[t + i] = kr + int64_t(i) * kstride;
      vp[t + i] = vr + int64_t(i) * vstride;
    }
  });
}

// Per-row state of a tile besides the buffers: the block's rescale factor, the causal limit,
// whether the row is NaN already, and its custom-mask row.
struct RowState {
  float alpha[na::kMaxTileRows];
  int lim[na::kMaxTileRows];
  bool bad[na::kMaxTileRows];
  const uint8_t* mrow[na::kMaxTileRows];
};

// The per-row prologue every item kernel runs: where row r's query is, whether it holds a
// NaN/inf, its causal limit and mask row, and a fresh softmax state (m = -inf, l = 0, acc =
// 0 over acc_len floats). Returns the query row in P.q.
template <typename QT>
static inline const QT* start_row(const NaProblem& P, const NaItem& it, const Tile& T, int r,
                                  RowState& S, float* m, float* l, float* acc_row, int acc_len) {
  const RowSrc src = row_src(P, it, T.query_of(r));
  const int qs = P.qo_indptr[src.req];
  const int q_len = P.qo_indptr[src.req + 1] - qs;
  const int kv_len = P.kv_lens[src.req];
  const int64_t token = qs + src.j;
  const QT* qrow = static_cast<const QT*>(P.q) + (token * T.Hq + T.head_of(it, r)) * T.D;
  S.bad[r] = row_not_finite(qrow, T.D);
  S.lim[r] = P.noncausal ? kv_len - 1 : kv_len - q_len + src.j;
  S.mrow[r] = P.causal ? nullptr : P.mask + P.mask_indptr[src.req] + int64_t(src.j) * kv_len;
  m[r] = kNegInf;
  l[r] = 0.0f;
  std::memset(acc_row, 0, sizeof(float) * size_t(acc_len));
  return qrow;
}

// The fp32 kernels' prologue: every row started, its q widened to fp32 (row stride Dp, zero
// padded) and scaled into log2 units, where an FP8 cache's k_scale also folds in.
template <typename QT>
static void init_rows(const NaProblem& P, const NaItem& it, const Tile& T, int Dp, int Dvp,
                      float* qb, float* m, float* l, float* acc, RowState& S) {
  const float qscale = P.sm_scale * kLog2e * P.k_scale * f8_unit(P);
  for (int r = 0; r < T.R; ++r) {
    const QT* qrow = start_row<QT>(P, it, T, r, S, m, l, acc + size_t(r) * Dvp, Dvp);
    float* qr = qb + size_t(r) * Dp;
    load_row(qr, qrow, T.D, Dp);
    for (int c = 0; c < Dp; ++c) qr[c] *= qscale;
  }
}

// Writes row r of a finished tile: the output (direct) or a partial result and its
// log2-sum-exp (split-KV, cascade). A NaN row stays NaN through the merge.
template <typename OT>
static inline void finish_row(const NaProblem& P, const NaItem& it, const Tile& T, int r,
                              const float* row, float inv, float m, float l, bool bad, OT* out) {
  const int Hq = T.Hq, Dv = T.Dv;
  const float vscale = P.v_scale * f8_unit(P);
  inv *= vscale;  // FP8: V's dequantisation factor, applied once per output row
  // A value row the row read held NaN or inf (invisible keys never reach acc: guard_values).
  bad = bad || row_not_finite(row, Dv);
  const int jj = T.query_of(r);
  const int head = T.head_of(it, r);
  if (it.slot < 0) {
    const RowSrc src = row_src(P, it, jj);
    const int64_t token = P.qo_indptr[src.req] + src.j;
    OT* o = out + (token * Hq + head) * Dv;
    // log2 of the row's sum of exp2(score): -inf when it saw no key.
    float lse2 = l > 0.0f ? m + std::log2(l) : kNegInf;
    if (P.sinks != nullptr) {
      // The sink joins the denominator only: acc / (l + e^(sink - m)), in a common frame.
      // A NaN sink gives a NaN row; +inf takes all the weight (the row is 0); -inf is no sink.
      const float sk = P.sinks[head] * kLog2e;
      const float big = std::max(m, sk);
      if (sk != sk) {
        bad = true;
      } else if (sk == -kNegInf || big == kNegInf) {
        inv = 0.0f;
        lse2 = big;
      } else {
        const float a = std::exp2(m - big);  // 0 when the row saw no key
        const float denom = l * a + std::exp2(sk - big);
        inv = a / denom * vscale;
        lse2 = big + std::log2(denom);
      }
    }
    if (bad) {
      fill_nan(o, Dv);
      lse2 = std::numeric_limits<float>::quiet_NaN();
    } else {
      store_row(o, row, inv, Dv);
    }
    if (P.lse != nullptr) P.lse[token * Hq + head] = lse2 * kLn2;
  } else {
    // A split's partial: row r of the tile; a cascade tile's: per (token, head) of its group.
    const int64_t srow =
        it.shared ? int64_t(it.slot) + int64_t(it.q0 + jj) * Hq + head : int64_t(it.slot) + r;
    float* lse = P.scratch + P.scratch_rows * Dv;
    if (bad) {
      fill_nan(P.scratch + srow * Dv, Dv);
      lse[srow] = std::numeric_limits<float>::quiet_NaN();
    } else {
      store_row(P.scratch + srow * Dv, row, inv, Dv);
      lse[srow] = l > 0.0f ? m + std::log2(l) : kNegInf;
    }
  }
}

// Normalises each row of a finished tile and writes it (finish_row). row_of(r) gives row r's
// accumulator in column order.
template <typename OT, typename RowOf>
static inline void finish_rows(const NaProblem& P, const NaItem& it, const Tile& T,
                               const float* m, const float* l, const RowState& S,
                               RowOf&& row_of) {
  for (int r = 0; r < T.R; ++r) {
    // Rows that saw no key at all give zeros, never NaN.
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    finish_row(P, it, T, r, row_of(r), inv, m[r], l[r], S.bad[r], static_cast<OT*>(P.out));
  }
}

// The first key a causal row with limit lim sees: its window's or its chunk's start.
static inline int64_t row_lo(const NaProblem& P, int lim) {
  int64_t lo = 0;
  if (P.window_left >= 0) lo = std::max<int64_t>(lo, int64_t(lim) - P.window_left);
  if (P.chunk_size > 0) lo = std::max<int64_t>(lo, lim - lim % P.chunk_size);
  return lo;
}

// Whether a row (causal limit lim, or custom mask row mrow) sees the key at position pos.
static inline bool sees(const NaProblem& P, int lim, const uint8_t* mrow, int pos) {
  if (!P.causal) return mrow[pos] != 0;
  return pos <= lim && int64_t(pos) >= row_lo(P, lim);
}

// A block's scores of one row after q.k: the logit cap, then -inf for keys past the block,
// past the row's causal limit, before its window, or outside its custom mask. Returns true
// when a key the row sees has a score that is not finite (NaN or inf in the key, or in q, or
// an overflow): that row's output is NaN. Such scores become -inf first, so a key the row
// does not see never reaches its softmax, whatever it holds.
static inline bool post_scores(const NaProblem& P, float* sr, int n, int k0, int lim,
                               const uint8_t* mrow) {
  bool bad = false;
  {
    vu nf = vu{};
    for (int t = 0; t < BK; t += W) {
      const vf x = ld(sr + t);
      nf |= (vu)(!(x - x == 0.0f));
    }
    unsigned any = 0;
    for (int i = 0; i < W; ++i) any |= nf[i];
    if (any) {  // rare: find which, among the first n keys
      for (int t = 0; t < n; ++t) {
        if (sr[t] - sr[t] == 0.0f) continue;
        bad = bad || sees(P, lim, mrow, k0 + t);
        sr[t] = kNegInf;
      }
    }
  }
  if (P.logit_cap > 0.0f) {
    const float cap2 = P.logit_cap * kLog2e;
    for (int t = 0; t < BK; t += W) st(sr + t, vcap(ld(sr + t), cap2));
  }
  for (int t = n; t < BK; ++t) sr[t] = kNegInf;
  if (P.causal) {
    for (int t = std::max(0, lim + 1 - k0); t < n; ++t) sr[t] = kNegInf;
    if (P.window_left >= 0 || P.chunk_size > 0) {
      const int64_t lo = row_lo(P, lim);  // first visible key
      for (int t = 0, e = int(std::min<int64_t>(n, lo - k0)); t < e; ++t) sr[t] = kNegInf;
    }
  } else {
    const uint8_t* mk = mrow + k0;
    for (int t = 0; t < n; ++t)
      if (!mk[t]) sr[t] = kNegInf;
  }
  return bad;
}

// Before p . V of one block for rows [r0, r1) (one kv head): a key that some of these rows
// do not see has weight 0 for them, and 0 * NaN is NaN, so its value row is replaced by zeros
// when it is not finite (keys no row sees: always), and the rows that do see it are marked
// bad (NaN output, the rule for a value row read). vp[t]: key t's value row, of type T.
template <typename T>
static inline void guard_values(const NaProblem& P, const int* lim, const uint8_t* const* mrow,
                                bool* bad, int r0, int r1, int k0, int n, const T** vp, int Dv) {
  int lo_lim = INT32_MAX, hi_lim = INT32_MIN;
  if (P.causal) {
    for (int r = r0; r < r1; ++r) {
      lo_lim = std::min(lo_lim, lim[r]);
      hi_lim = std::max(hi_lim, lim[r]);
    }
    // Every key of the block seen by every row: nothing to guard (the common case). row_lo
    // grows with the limit, so the latest row has the latest first key.
    if (k0 + n - 1 <= lo_lim && int64_t(k0) >= row_lo(P, hi_lim)) return;
  }
  for (int t = 0; t < n; ++t) {
    const int pos = k0 + t;
    int seen = 0;
    for (int r = r0; r < r1; ++r) seen += sees(P, lim[r], mrow[r], pos);
    if (seen == r1 - r0) continue;
    if (seen > 0) {
      if (!row_not_finite(vp[t], Dv)) continue;
      for (int r = r0; r < r1; ++r) bad[r] = bad[r] || sees(P, lim[r], mrow[r], pos);
    }
    vp[t] = zero_row<T>();
  }
}

}  // namespace NA_NS

#endif  // NATIVE_ATTN_TILE_H
