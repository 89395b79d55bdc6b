// Many-row tile path: items whose rows per kv head (q heads of one kv head x query tokens:
// GQA verify chains and trees, prefill/extend, a cascade's shared part; MLA, whose 16 heads
// share each latent row, from decode on) are many. GEMM-shaped
// instead of dot-product-shaped: the scores of a block are computed TRANSPOSED, s[key][row],
// one vector lane per row, so
//   - q.K^T is an outer product: q packed once per item as q^T[c][row] (rows along the
//     lanes), each key element broadcast from its row and multiplied into NK x NV
//     accumulators (no horizontal sums, no reduction shuffles, every lane useful once the
//     rows fill a vector);
//   - the online softmax is vertical: a row's block max, exp2 and sum are lane-wise over the
//     keys' vectors;
//   - the masks are per score tile: a block every row sees fully (the common case) takes no
//     mask work at all; an edge block compares each key's position with the rows' [first
//     key, causal limit] lanes (window and chunk fold into the first key), or takes the rows'
//     custom-mask bytes as a lane vector: a select per key vector, never a branch per score.
//   - p.V keeps the accumulators along the value columns (pv_tile / pv_rows_bf16 with the
//     weights read in [key][row] order).
// Two variants: rows_item (fp32 accumulation, any ISA: FMA on AVX-512/AVX2, the generic
// vectors elsewhere; bf16/fp16/FP8 blocks widened to fp32 once per block per kv head) and,
// on AVX-512 BF16, rows_item_bf16 (bf16 q with bf16 or FP8 caches: vdpbf16ps on q^T pairs x
// broadcast key pairs; FP8 K/V rows widened to bf16 once per block, exactly). In the amx
// unit (NA_HAVE_AMX) the same kernel runs q.K^T and p.V on AMX tiles (amx_path.h); its
// masks, softmax, guards and finish are this file's, unchanged.
//
// Which items take it: see rows_path_applies (kernels_impl.h's item()).
#ifndef NATIVE_ATTN_ROWS_PATH_H
#define NATIVE_ATTN_ROWS_PATH_H
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "tile.h"
#ifdef NA_HAVE_BF16_PATH
#include "bf16_path.h"
#endif
#ifdef NA_HAVE_AMX
#include "amx_path.h"
#endif

namespace NA_NS {

// Rows per kv head from which an item takes this path: NATIVE_ATTN_ROWS_MIN (read once per
// process; tests force the path on every item with 1, benchmarks compare) or the measured
// default for this unit and cache dtype (kernels.h).
static inline int rows_min_env() {
  static const int v = [] {
    const char* e = std::getenv("NATIVE_ATTN_ROWS_MIN");
    if (e != nullptr) {
      char* end = nullptr;
      const long x = std::strtol(e, &end, 10);
      if (end != e && *end == '\0' && x >= 1 && x <= 1 << 20) return int(x);
    }
    return 0;
  }();
  return v;
}
// bf16 q over a bf16 or FP8 cache: the dtypes the vdpbf16ps (and AMX) tiles take.
static inline bool bf16_tile_dtypes(int kv_dtype, int q_dtype) {
  return q_dtype == NA_BF16 &&
         (kv_dtype == NA_BF16 || kv_dtype == NA_E4M3 || kv_dtype == NA_E5M2);
}
static inline int rows_min(int kv_dtype, int q_dtype) {
  if (const int v = rows_min_env()) return v;
#ifdef NA_HAVE_AMX
  // The AMX tiles (bf16 q, bf16 or FP8 cache): from one tile's 16 rows.
  if (bf16_tile_dtypes(kv_dtype, q_dtype)) return na::kRowsMinAmx;
#endif
  (void)q_dtype;
#ifdef NA_HAVE_BF16_PATH
  return kv_dtype == NA_E4M3 || kv_dtype == NA_E5M2 ? na::kRowsMinFp8Bf16 : na::kRowsMinBf16;
#else
  (void)kv_dtype;
  return W >= 8 ? na::kRowsMinF32 : na::kRowsMinGeneric;  // avx512 and avx2 : generic
#endif
}

// MLA items (one latent row per token read by every q head) from this many rows (q heads x
// query tokens): na::kRowsMinMla* (kernels.h, measured). The amx unit keeps MLA on its
// decode kernel (its tiles were never run with 576-wide rows): no item qualifies there.
static inline int rows_min_mla(int kv_dtype, int q_dtype) {
#ifdef NA_HAVE_AMX
  (void)kv_dtype;
  (void)q_dtype;
  return 1 << 30;
#else
  if (const int v = rows_min_env()) return v;
#ifdef NA_HAVE_BF16_PATH
  if (bf16_tile_dtypes(kv_dtype, q_dtype)) return na::kRowsMinMlaBf16;
#endif
  (void)kv_dtype;
  (void)q_dtype;
  // fp32 accumulation: only the 16-lane (AVX-512) kernel gains; on AVX2 verify-4 ran 1.0-1.13x
  // the decode kernel's time (bench/native_notes.md, "MLA on the many-row path").
  return W >= 16 ? na::kRowsMinMlaF32 : 1 << 30;
#endif
}

// Per-thread buffers of the many-row path (besides tls_buffers).
struct RowsBuffers {
  std::vector<float> qt, st, kb, vb, ml;
  bool ensure(size_t nq, size_t ns, size_t nk, size_t nv, size_t nml) noexcept {
    try {
      if (qt.size() < nq) qt.resize(nq);
      if (st.size() < ns) st.resize(ns);
      if (kb.size() < nk) kb.resize(nk);
      if (vb.size() < nv) vb.resize(nv);
      if (ml.size() < nml) ml.resize(nml);
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }
};
static thread_local RowsBuffers tls_rows;

#ifdef NA_HAVE_AMX
// The AMX unit's extra per-thread buffers: the padded accumulators (every lane of a tile
// row group has its row, so tile loads and stores stay inside the buffer) and the
// micro-kernels' scratch (amx_path.h).
struct AmxBuffers {
  std::vector<float> acc;
  std::vector<unsigned char> scratch;
  bool ensure(size_t nacc, size_t nscratch) noexcept {
    try {
      if (acc.size() < nacc) acc.resize(nacc);
      if (scratch.size() < nscratch) scratch.resize(nscratch);
    } catch (const std::bad_alloc&) {
      return false;
    }
    return true;
  }
};
static thread_local AmxBuffers tls_amx;

// Loads the all-16x64 tile config for the item's life, releases it at the end (every return).
struct AmxTiles {
  AmxTiles() {
    static const na_amx::TileConfig cfg = na_amx::full_config();
    na_amx::tile_config(&cfg);
  }
  ~AmxTiles() { na_amx::tile_release(); }
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};
#endif

// The lanes of one kv head's rows: first key and causal limit per row (pad lanes see
// nothing), the custom-mask rows, and whether the block is wholly visible to every row.
struct RowLanes {
  int Rp;         // lanes (rows padded to the vector width)
  int R1;         // real rows
  int lo_max, lim_min;  // over the real rows (causal): a block inside [lo_max, lim_min] is seen whole
  int mseen;            // custom mask: every real row sees every key of [k0 of the item, mseen)
  alignas(64) int32_t lim[na::kMaxTileRows + 16];
  alignas(64) int32_t lo[na::kMaxTileRows + 16];
  alignas(64) int32_t real[na::kMaxTileRows + 16];  // -1: a real row's lane, 0: a pad lane
  const uint8_t* mrow[na::kMaxTileRows];
};

static inline void lanes_init(const NaProblem& P, const NaItem& it, const RowState& S, int r0,
                              int R1, int Rp, RowLanes& L) {
  L.Rp = Rp;
  L.R1 = R1;
  L.lo_max = INT32_MIN;
  L.lim_min = INT32_MAX;
  L.mseen = it.k1;
  for (int i = 0; i < Rp; ++i) {
    if (i < R1) {
      const int lim = S.lim[r0 + i];
      L.lim[i] = lim;
      L.lo[i] = P.causal ? int32_t(std::min<int64_t>(row_lo(P, lim), INT32_MAX)) : 0;
      L.mrow[i] = S.mrow[r0 + i];
      L.real[i] = -1;
      L.lo_max = std::max(L.lo_max, L.lo[i]);
      L.lim_min = std::min(L.lim_min, L.lim[i]);
      if (!P.causal && L.mseen > it.k0) {  // the first key of the item's range the row misses
        const void* z = std::memchr(L.mrow[i] + it.k0, 0, size_t(L.mseen - it.k0));
        if (z != nullptr) L.mseen = int(static_cast<const uint8_t*>(z) - L.mrow[i]);
      }
    } else {  // pad lane: no key is visible
      L.lim[i] = -1;
      L.lo[i] = 0;
      L.real[i] = 0;
    }
  }
}

// Whether every real row sees every key of [k0, k0 + n) (a block of the item's range).
// Custom masks: the blocks before the first key some row misses (found once per item by
// lanes_init, one memchr per row) are whole without a look; from there on, one memchr per row
// and block, as before.
static inline bool block_seen_whole(const NaProblem& P, const RowLanes& L, int k0, int n) {
  if (P.causal) return k0 >= L.lo_max && k0 + n - 1 <= L.lim_min;
  if (k0 + n <= L.mseen) return true;
  for (int i = 0; i < L.R1; ++i) {
    if (std::memchr(L.mrow[i] + k0, 0, size_t(n)) != nullptr) return false;
  }
  return true;
}

// One score vector of key pos (lanes j*W..) after the logit cap and the masks: -inf where
// masked or non-finite; a non-finite score a lane sees marks the lane bad.
__attribute__((always_inline)) static inline vf mask_scores(const NaProblem& P,
                                                           const RowLanes& L, vf x, int j,
                                                           int pos, bool whole, float cap2,
                                                           vu* badv) {
  if (P.logit_cap > 0.0f) x = vcap(x, cap2);
  vu vis;
  if (whole) {
    std::memcpy(&vis, L.real + j * W, sizeof vis);  // real lanes only
  } else if (P.causal) {
    vi lim, lo;
    std::memcpy(&lim, L.lim + j * W, sizeof lim);
    std::memcpy(&lo, L.lo + j * W, sizeof lo);
    vis = (vu)((pos <= lim) & (pos >= lo));
  } else {
    vi mk = vi{};
    for (int i = 0; i < W; ++i) {
      const int lane = j * W + i;
      mk[i] = lane < L.R1 ? L.mrow[lane][pos] : 0;
    }
    vis = (vu)(mk != 0);
  }
  const vu nf = (vu)(!(x - x == 0.0f));
  badv[j] |= nf & vis;
  return (vi)(nf | ~vis) != 0 ? splat(kNegInf) : x;
}

// One block's transposed scores s[t][lane] (t < nt, lanes Rp, log2 units) of one kv head:
// logit cap, non-finite scores (a seen one marks its row bad), the masks, then the online
// softmax. On return s holds the weights p (0 for masked keys and keys t >= n), m/l/alpha the
// lanes' running max, sum and this block's rescale factor; badv collects bad lanes.
// (The vdpbf16ps kernel's variant, rows_softmax_pairs, rounds the weights to bf16 before they
// are summed, so the normaliser sums what the accumulation uses.)
static inline void rows_softmax(const NaProblem& P, const RowLanes& L, float* s, int nt, int n,
                                int k0, bool whole, float* m, float* l, float* alpha, vu* badv) {
  const int Rp = L.Rp;
  const int nvec = Rp / W;
  const float cap2 = P.logit_cap * kLog2e;
  const vf ninf = splat(kNegInf);
  for (int t = 0; t < nt; ++t) {
    float* st_ = s + size_t(t) * Rp;
    if (t >= n) {
      for (int j = 0; j < nvec; ++j) st(st_ + j * W, ninf);
      continue;
    }
    const int pos = k0 + t;
    for (int j = 0; j < nvec; ++j) {
      st(st_ + j * W, mask_scores(P, L, ld(st_ + j * W), j, pos, whole, cap2, badv));
    }
  }
  for (int j = 0; j < nvec; ++j) {
    vf bm = ninf;
    for (int t = 0; t < nt; ++t) bm = vmax(bm, ld(s + size_t(t) * Rp + j * W));
    const vf mo = ld(m + j * W);
    const vf mn = vmax(mo, bm);
    // A lane that has seen no key yet keeps m = -inf: its weights and rescale are 0 and 1.
    const vi none = mn == ninf;
    const vf base = none ? splat(0.0f) : mn;
    const vf a = none ? splat(1.0f) : vexp2(mo - base);
    vf sum = splat(0.0f);
    for (int t = 0; t < nt; ++t) {
      float* p = s + size_t(t) * Rp + j * W;
      vf w = vexp2(ld(p) - base);
      sum += w;
      st(p, w);
    }
    st(alpha + j * W, a);
    st(l + j * W, ld(l + j * W) * a + sum);
    st(m + j * W, mn);
  }
}

#ifdef NA_HAVE_BF16_PATH
// vexp2 for x in [-inf, 0] (what the softmax feeds it: a score or the running max minus a max
// at least as large): vexp2's upper clamp is then the identity and is left out; the rest is
// vexp2's, so the same bits.
__attribute__((always_inline)) static inline vf vexp2_nonpos(vf x) {
  vi under = x < -125.0f;
  x = x < -125.0f ? splat(-125.0f) : x;
  const float magic = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  vf t = x + magic;
  vf fn = t - magic;
  vi n;
  std::memcpy(&n, &t, sizeof n);
  n -= 0x4B400000;  // bit pattern of magic
  vf f = x - fn;
  vf p = splat(1.5252733804059840e-5f);
  p = p * f + 1.5403530393381610e-4f;
  p = p * f + 1.3333558146428443e-3f;
  p = p * f + 9.6181291076284772e-3f;
  p = p * f + 5.5504108664821580e-2f;
  p = p * f + 2.4022650695910071e-1f;
  p = p * f + 6.9314718055994531e-1f;
  p = p * f + 1.0f;
  vi pb;
  std::memcpy(&pb, &p, sizeof pb);
  pb += n << 23;
  std::memcpy(&p, &pb, sizeof p);
  return under ? splat(0.0f) : p;
}

// rows_softmax for the vdpbf16ps kernel, in two passes over the block instead of four: per
// vector of lanes, the masks fused with the block max, then exp2, bf16 rounding and the sum
// fused with the weight-pair packing: pb[tp][lane] = (bf16 p[2tp + 1] << 16) | bf16 p[2tp]
// for tp < nt / 2 (nt even; keys t >= n weigh 0). Per lane the same operations in the same
// order as rows_softmax(..., bf16 = true) followed by the packing, so the same bits; the
// float weights are not stored.
static inline void rows_softmax_pairs(const NaProblem& P, const RowLanes& L, float* s, int nt,
                                      int n, int k0, bool whole, float* m, float* l,
                                      float* alpha, vu* badv, uint32_t* pb) {
  const int Rp = L.Rp;
  const int nvec = Rp / W;
  const float cap2 = P.logit_cap * kLog2e;
  const vf ninf = splat(kNegInf);
  for (int j = 0; j < nvec; ++j) {
    vf bm = ninf;
    if (whole && !(P.logit_cap > 0.0f)) {
      // The common block (every row sees every key, no cap): mask_scores' operations with
      // the lanes' visibility and bad flags held in registers over the block, not reloaded
      // and stored per key vector.
      vu vis, bad = badv[j];
      std::memcpy(&vis, L.real + j * W, sizeof vis);  // real lanes only
      for (int t = 0; t < n; ++t) {
        float* p = s + size_t(t) * Rp + j * W;
        vf x = ld(p);
        const vu nf = (vu)(!(x - x == 0.0f));
        bad |= nf & vis;
        x = (vi)(nf | ~vis) != 0 ? ninf : x;
        st(p, x);
        bm = vmax(bm, x);
      }
      badv[j] = bad;
    } else {
      for (int t = 0; t < n; ++t) {
        float* p = s + size_t(t) * Rp + j * W;
        const vf x = mask_scores(P, L, ld(p), j, k0 + t, whole, cap2, badv);
        st(p, x);
        bm = vmax(bm, x);
      }
    }
    // keys t >= n weigh 0 (max(bm, -inf) is bm: no score here is NaN)
    for (int t = n; t < nt; ++t) st(s + size_t(t) * Rp + j * W, ninf);
    const vf mo = ld(m + j * W);
    const vf mn = vmax(mo, bm);
    // A lane that has seen no key yet keeps m = -inf: its weights and rescale are 0 and 1.
    const vi none = mn == ninf;
    const vf base = none ? splat(0.0f) : mn;
    const vf a = none ? splat(1.0f) : vexp2_nonpos(mo - base);
    vf sum = splat(0.0f);
    // Word 2i of a pair vector takes word i of the converted pair (w0's lane i), word 2i + 1
    // word 16 + i (w1's lane i).
    const __m512i il = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                        24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                        16, 0);
    for (int t = 0; t + 1 < nt; t += 2) {
      const vf w0 = vexp2_nonpos(ld(s + size_t(t) * Rp + j * W) - base);
      const vf w1 = vexp2_nonpos(ld(s + size_t(t + 1) * Rp + j * W) - base);
      // Both rounded to bf16, nearest even (vcvtne2ps2bf16: words 0..15 from w0, 16..31 from
      // w1), then interleaved into the pairs. The weights are 0 or normal floats in
      // [2^-126, 1] (vexp2 gives 0 below 2^-125), where the instruction's implied
      // denormal flush never applies: the same bits as rounding the integers by hand.
      const __m512i cv = (__m512i)_mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0);
      const __m512i pair = _mm512_permutexvar_epi16(il, cv);
      const __m512 r0 = _mm512_castsi512_ps(_mm512_slli_epi32(pair, 16));
      const __m512 r1 = _mm512_castsi512_ps(
          _mm512_and_si512(pair, _mm512_set1_epi32(int(0xffff0000u))));
      sum += (vf)r0;
      sum += (vf)r1;
      _mm512_storeu_si512(pb + size_t(t / 2) * Rp + j * W, pair);
    }
    st(alpha + j * W, a);
    st(l + j * W, ld(l + j * W) * a + sum);
    st(m + j * W, mn);
  }
}
#endif

// s[t][lanes j*W..] (keys t0..t0+NK, NV vectors of rows) = sum_c k[t][c] * q^T[c][lanes].
// K rows fp32, ks floats apart.
template <int NK, int NV>
static inline void qk_keys(const float* qt, int Rp, int D, const float* kr, int ks, float* s,
                           PfCursor& pf) {
  vf a[NK][NV];
  for (int k = 0; k < NK; ++k)
    for (int j = 0; j < NV; ++j) a[k][j] = splat(0.0f);
  for (int c = 0; c < D; ++c) {
    if (c % 16 == 0) pf.step();  // the next block's lines, a few at a time
    vf qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = ld(qt + size_t(c) * Rp + j * W);
    for (int k = 0; k < NK; ++k) {
      const vf kb = splat(kr[size_t(k) * ks + c]);
      for (int j = 0; j < NV; ++j) a[k][j] += kb * qv[j];
    }
  }
  for (int k = 0; k < NK; ++k)
    for (int j = 0; j < NV; ++j) st(s + size_t(k) * Rp + j * W, a[k][j]);
}

// Register blocking of qk_keys: NK keys x NV row vectors of accumulators (AVX-512 has 32
// vector registers, AVX2 and SSE 16).
constexpr int kRowsNV = 2;
constexpr int kRowsNK2 = W == 16 ? 8 : 4;   // with NV = 2
constexpr int kRowsNK1 = W == 16 ? 16 : 8;  // with NV = 1

// acc (NR rows, stride Dv) = acc * alpha + p . V over n keys, p read as p[t * ps + i]
// (the transposed weights); V rows fp32.
template <int NR>
static inline void pv_rows_t(float* acc, int Dv, const float* p, int ps, const float* alpha,
                             const float* const* vp, int n) {
  int c = 0;
  for (; c + 2 * W <= Dv; c += 2 * W) {
    vf a[NR][2];
    for (int i = 0; i < NR; ++i) {
      a[i][0] = ld(acc + size_t(i) * Dv + c) * alpha[i];
      a[i][1] = ld(acc + size_t(i) * Dv + c + W) * alpha[i];
    }
    for (int t = 0; t < n; ++t) {
      const vf x0 = ld(vp[t] + c), x1 = ld(vp[t] + c + W);
      const float* pt = p + size_t(t) * ps;
      for (int i = 0; i < NR; ++i) {
        a[i][0] += pt[i] * x0;
        a[i][1] += pt[i] * x1;
      }
    }
    for (int i = 0; i < NR; ++i) {
      st(acc + size_t(i) * Dv + c, a[i][0]);
      st(acc + size_t(i) * Dv + c + W, a[i][1]);
    }
  }
  for (; c < Dv; c += W) {
    vf a[NR];
    for (int i = 0; i < NR; ++i) a[i] = ld(acc + size_t(i) * Dv + c) * alpha[i];
    for (int t = 0; t < n; ++t) {
      const vf x = ld(vp[t] + c);
      const float* pt = p + size_t(t) * ps;
      for (int i = 0; i < NR; ++i) a[i] += pt[i] * x;
    }
    for (int i = 0; i < NR; ++i) st(acc + size_t(i) * Dv + c, a[i]);
  }
}
constexpr int kRowsPV = W == 16 ? 8 : 4;  // rows per p.V micro-tile (x 2 vectors of columns)
static inline void pv_rows_t_n(int nr, float* acc, int Dv, const float* p, int ps,
                               const float* alpha, const float* const* vp, int n) {
  switch (nr) {
#if NA_W == 16
    case 8: pv_rows_t<8>(acc, Dv, p, ps, alpha, vp, n); break;
    case 7: pv_rows_t<7>(acc, Dv, p, ps, alpha, vp, n); break;
    case 6: pv_rows_t<6>(acc, Dv, p, ps, alpha, vp, n); break;
    case 5: pv_rows_t<5>(acc, Dv, p, ps, alpha, vp, n); break;
#endif
    case 4: pv_rows_t<4>(acc, Dv, p, ps, alpha, vp, n); break;
    case 3: pv_rows_t<3>(acc, Dv, p, ps, alpha, vp, n); break;
    case 2: pv_rows_t<2>(acc, Dv, p, ps, alpha, vp, n); break;
    default: pv_rows_t<1>(acc, Dv, p, ps, alpha, vp, n); break;
  }
}

// The rows' bad lanes into the tile's row state.
static inline void lanes_bad(const vu* badv, int r0, int R1, RowState& S) {
  for (int i = 0; i < R1; ++i) S.bad[r0 + i] = S.bad[r0 + i] || badv[i / W][i % W] != 0;
}

// The fp32-accumulating many-row kernel (head dims multiples of W).
template <typename QT, typename KT>
static int rows_item(const NaProblem& P, const NaItem& it) {
  const Tile T(P, it);
  const int D = T.D, Dv = T.Dv, R1 = T.R1, nkv = T.nkv;
  const int Rp = round_up(R1, W);
  Buffers& B = tls_buffers;
  RowsBuffers& RB = tls_rows;
  if (!B.ensure(T.R, D, Dv)) return -2;
  if (!RB.ensure(size_t(nkv) * D * Rp, size_t(BK) * Rp, size_t(BK) * D, size_t(BK) * Dv,
                 size_t(3) * nkv * Rp)) {
    return -2;
  }
  float* acc = B.acc.data();
  float* m = B.m.data();
  float* l = B.l.data();
  float* qt = RB.qt.data();
  float* sT = RB.st.data();
  float* kb = RB.kb.data();
  float* vb = RB.vb.data();
  float* mL = RB.ml.data();
  float* lL = mL + size_t(nkv) * Rp;
  float* aL = lL + size_t(nkv) * Rp;
  RowState S;
  // q^T per kv head: [c][lane], scaled into log2 units (FP8's k_scale folded in), pad lanes 0.
  const float qscale = P.sm_scale * kLog2e * P.k_scale * f8_unit(P);
  std::memset(qt, 0, sizeof(float) * size_t(nkv) * D * Rp);
  float* qrow = B.q.data();  // >= D floats
  for (int r = 0; r < T.R; ++r) {
    const QT* q = start_row<QT>(P, it, T, r, S, m, l, acc + size_t(r) * Dv, Dv);
    load_row(qrow, q, D, D);
    const int gi = r / R1, lane = r % R1;
    float* qg = qt + size_t(gi) * D * Rp + lane;
    for (int c = 0; c < D; ++c) qg[size_t(c) * Rp] = qrow[c] * qscale;
  }
  for (int i = 0; i < nkv * Rp; ++i) {
    mL[i] = kNegInf;
    lL[i] = 0.0f;
  }
  // A tile has at most kMaxRows kv heads: kMaxRows rows of at least one per kv head, or a wide
  // verify tile's kMaxWideRows / 16 (kernels.h).
  RowLanes L[na::kMaxRows];
  vu badv[na::kMaxRows][na::kMaxTileRows / W + 1];
  for (int gi = 0; gi < nkv; ++gi) {
    lanes_init(P, it, S, gi * R1, R1, Rp, L[gi]);
    for (auto& x : badv[gi]) x = vu{};
  }
  // MLA (one latent row per token, its first Dv elements the value): V rows are the K rows.
  const bool mla = T.mla;
  const KT* kbase = static_cast<const KT*>(P.k);
  const KT* vbase = static_cast<const KT*>(mla ? P.k : P.v);
  const int64_t kstride = T.kstride(), vstride = T.vstride();
  // Prefetch only the tile's kv heads of each token (adjacent in the row): a tile of one or
  // two of 8 kv heads used to queue the whole row, 4-8x the lines it reads, and the cursor's
  // per-line loop then cost more instructions than the tile's vdpbf16ps (perf, tree-8).
  const KT* kpf = kbase + int64_t(it.kv_head) * D;
  const KT* vpf = vbase + int64_t(it.kv_head) * Dv;
  const int klines = int((int64_t(nkv) * D * int64_t(sizeof(KT)) + 63) / 64);
  const int vlines = mla ? 0 : int((int64_t(nkv) * Dv * int64_t(sizeof(KT)) + 63) / 64);
  const KT* kp0[BK];
  const KT* vp0[BK];
  const float* vr[BK];
  for (int t = 0; t < BK; ++t) vr[t] = vb + size_t(t) * Dv;
  const int nvt = Rp / W;
  PfCursor pf;
  pf.set_lean(P.lean_prefetch != 0);
  pf.queue_rows(T, it.k0, std::min(it.k1, it.k0 + BK), kpf, vpf, kstride, vstride, klines,
                vlines);
  pf.flush();
  for (int k0 = it.k0; k0 < it.k1; k0 += BK) {
    const int n = std::min(BK, it.k1 - k0);
    for (int t = 0; t < n; ++t) {
      const int64_t slot = T.slot(k0 + t);
      kp0[t] = kbase + slot * kstride;
      vp0[t] = vbase + slot * vstride;
    }
    {
      const int ka = k0 + BK;
      pf.queue_rows(T, ka, std::min(it.k1, ka + BK), kpf, vpf, kstride, vstride, klines,
                    vlines);
      const int nvt_ = Rp / W;
      const int tiles = nvt_ >= kRowsNV ? round_up(n, kRowsNK2) / kRowsNK2 * ((nvt_ + 1) / 2)
                                        : round_up(n, kRowsNK1) / kRowsNK1;
      pf.plan(nkv * (tiles * ((D + 15) / 16) + (R1 + kRowsPV - 1) / kRowsPV));
    }
    for (int gi = 0; gi < nkv; ++gi) {
      const RowLanes& LG = L[gi];
      const int64_t koff = int64_t(it.kv_head + gi) * D;
      const int64_t voff = int64_t(it.kv_head + gi) * Dv;
      // The block's K and V rows of this kv head widened once (bf16/fp16/FP8 -> fp32).
      for (int t = 0; t < n; ++t) {
        load_row(kb + size_t(t) * D, kp0[t] + koff, D, D);
        load_row(vb + size_t(t) * Dv, vp0[t] + voff, Dv, Dv);
      }
      const float* qg = qt + size_t(gi) * D * Rp;
      int nt = 0;
      if (nvt >= kRowsNV) {
        nt = round_up(n, kRowsNK2);
        for (int t0 = 0; t0 < nt; t0 += kRowsNK2) {
          int j = 0;
          for (; j + kRowsNV <= nvt; j += kRowsNV)
            qk_keys<kRowsNK2, kRowsNV>(qg + j * W, Rp, D, kb + size_t(t0) * D, D,
                                       sT + size_t(t0) * Rp + j * W, pf);
          for (; j < nvt; ++j)
            qk_keys<kRowsNK2, 1>(qg + j * W, Rp, D, kb + size_t(t0) * D, D,
                                 sT + size_t(t0) * Rp + j * W, pf);
        }
      } else {
        nt = round_up(n, kRowsNK1);
        for (int t0 = 0; t0 < nt; t0 += kRowsNK1)
          qk_keys<kRowsNK1, 1>(qg, Rp, D, kb + size_t(t0) * D, D, sT + size_t(t0) * Rp, pf);
      }
      const bool whole = block_seen_whole(P, LG, k0, n);
      float* mg = mL + size_t(gi) * Rp;
      float* lg = lL + size_t(gi) * Rp;
      float* ag = aL + size_t(gi) * Rp;
      rows_softmax(P, LG, sT, nt, n, k0, whole, mg, lg, ag, badv[gi]);
      if (!whole) {
        guard_values<float>(P, S.lim, S.mrow, S.bad, gi * R1, (gi + 1) * R1, k0, n, vr, Dv);
      }
      for (int i0 = 0; i0 < R1; i0 += kRowsPV) {
        pf.step();
        pv_rows_t_n(std::min(kRowsPV, R1 - i0), acc + size_t(gi * R1 + i0) * Dv, Dv, sT + i0,
                    Rp, ag + i0, vr, n);
      }
      if (!whole) {  // guard_values may have pointed rows at the zero row
        for (int t = 0; t < n; ++t) vr[t] = vb + size_t(t) * Dv;
      }
    }
  }
  for (int gi = 0; gi < nkv; ++gi) lanes_bad(badv[gi], gi * R1, R1, S);
  for (int r = 0; r < T.R; ++r) {
    m[r] = mL[size_t(r / R1) * Rp + r % R1];
    l[r] = lL[size_t(r / R1) * Rp + r % R1];
  }
  finish_rows<QT>(P, it, T, m, l, S, [&](int r) { return acc + size_t(r) * Dv; });
  return 0;
}

#ifdef NA_HAVE_BF16_PATH
// prefetcht0 / prefetcht2 as asm volatile: in this unit GCC 12 (-O3) dropped the loops below
// when written with __builtin_prefetch or _mm_prefetch (loops whose only effect is the
// prefetches; objdump showed none issued). PfCursor's loops keep theirs (they update state).
static inline void prefetch_t0(const void* p) { asm volatile("prefetcht0 (%0)" ::"r"(p)); }
static inline void prefetch_t2(const void* p) { asm volatile("prefetcht2 (%0)" ::"r"(p)); }

// PfCursor for the vdpbf16ps many-row kernel: the queued rows' lines as a flat address list,
// written once per block (queue_rows: eight addresses per store), so that step() is one load
// and one prefetch per line over a fixed count (5 instructions a line). PfCursor::step's
// per-line bookkeeping (line and row counters, a compare with the row's length: ~11
// instructions a line) held ~13% of verify-4's kernel samples with its K/V in L2 (perf,
// Round 6): 512 lines per 32-key block of a 2-kv-head tile, next to 8192 vdpbf16ps. The same
// lines in the same order, spread over the same calls.
struct PfLines {
  // Lines; a block with more issues what is queued first. 2048: a 128-row verify tile's block
  // (32 keys x 8 kv heads x 4 + 4 lines of K and V at D = 128). At 1024 such a block issued
  // its first half in one burst (the burst PfCursor avoids), which hid the wide tile's gain.
  static constexpr int kCap = 2048;
  int n = 0, i = 0, quota = 1;
  const char* a[kCap];
  void add(const void* r, int lines) {
    const char* p = static_cast<const char*>(r);
    if (n + lines > kCap) {  // full: issue what is queued first, then add what fits
      while (lines > 0) {
        if (n == kCap) {
          flush();
          n = i = 0;
        }
        const int take = std::min(lines, kCap - n);
        for (int l = 0; l < take; ++l) a[n + l] = p + 64 * l;
        n += take;
        p += 64 * take;
        lines -= take;
      }
      return;
    }
    // Eight addresses per store (a row of D = 128 bf16 is four or eight lines).
    __m512i v = _mm512_add_epi64(_mm512_set1_epi64(reinterpret_cast<long long>(p)),
                                 _mm512_setr_epi64(0, 64, 128, 192, 256, 320, 384, 448));
    int l = 0;
    for (; l + 8 <= lines; l += 8) {
      _mm512_storeu_si512(a + n + l, v);
      v = _mm512_add_epi64(v, _mm512_set1_epi64(512));
    }
    if (l < lines) _mm512_mask_storeu_epi64(a + n + l, __mmask8((1u << (lines - l)) - 1), v);
    n += lines;
  }
  // Spread the queued lines over `calls` calls of step().
  void plan(int calls) { quota = std::max(1, (n - i + calls - 1) / std::max(1, calls)); }
  void step() {
    const int e = std::min(n, i + quota);
    for (; i < e; ++i) prefetch_t2(a[i]);
  }
  void flush() {
    for (; i < n; ++i) prefetch_t2(a[i]);
  }
  // PfCursor::queue_rows: what is left of the previous queue issued, then the rows of key
  // positions pos0 .. pos1 - 1, K then V per token, in address order.
  template <typename KT>
  void queue_rows(const Tile& T, int pos0, int pos1, const KT* kbase, const KT* vbase,
                  int64_t kstride, int64_t vstride, int klines, int vlines) {
    flush();
    n = i = 0;
    queue_page_rows(*this, T, pos0, pos1, kbase, vbase, kstride, vstride, klines, vlines);
  }
};

// s[t][lanes] (NK keys from t0, NV 16-lane row vectors) = qscale * sum over column pairs cp of
// q^T pair [cp][lanes] . k[t] pair cp (a broadcast dword of the key row): vdpbf16ps.
template <int NK, int NV, typename PF>
static inline void qk_keys_bf16(const uint32_t* qp, int Rp, int D, const uint16_t* const* kr,
                                float qscale, float* s, PF& pf) {
  __m512 a[NK][NV];
  for (int k = 0; k < NK; ++k)
    for (int j = 0; j < NV; ++j) a[k][j] = _mm512_setzero_ps();
  for (int cp = 0; cp < D / 2; ++cp) {
    // The next block's lines a few at a time (a burst stalls the core: PfCursor).
    if (cp % 8 == 0) pf.step();
    __m512bh qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = as_bh(_mm512_loadu_si512(qp + size_t(cp) * Rp + j * 16));
    for (int k = 0; k < NK; ++k) {
      int32_t kk;
      std::memcpy(&kk, kr[k] + 2 * cp, sizeof kk);
      const __m512bh kb = as_bh(_mm512_set1_epi32(kk));
      for (int j = 0; j < NV; ++j) a[k][j] = _mm512_dpbf16_ps(a[k][j], qv[j], kb);
    }
  }
  const __m512 sc = _mm512_set1_ps(qscale);
  for (int k = 0; k < NK; ++k)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(s + size_t(k) * Rp + j * 16, _mm512_mul_ps(a[k][j], sc));
}

// qk_keys_bf16 on keys packed DC bf16 apart in one buffer (kp: key t0's row): every
// broadcast is one moving pointer plus a constant displacement. With 16 separate key
// pointers (qk_keys_bf16<16, 1>) GCC keeps them in vector registers and moves each one back
// (vmovq) per broadcast: 16 vector-to-integer moves per 16 vdpbf16ps, a port that issues about
// one a cycle, so the tile ran at about half the vdpbf16ps rate.
template <int NK, int NV, int DC, typename PF>
static inline void qk_keys_bf16_packed(const uint32_t* qp, int Rp, const uint16_t* kp,
                                       float qscale, float* s, PF& pf) {
  __m512 a[NK][NV];
  for (int k = 0; k < NK; ++k)
    for (int j = 0; j < NV; ++j) a[k][j] = _mm512_setzero_ps();
  for (int cp = 0; cp < DC / 2; ++cp) {
    if (cp % 8 == 0) pf.step();
    __m512bh qv[NV];
    for (int j = 0; j < NV; ++j) qv[j] = as_bh(_mm512_loadu_si512(qp + size_t(cp) * Rp + j * 16));
    for (int k = 0; k < NK; ++k) {
      int32_t kk;
      std::memcpy(&kk, kp + k * DC + 2 * cp, sizeof kk);
      const __m512bh kb = as_bh(_mm512_set1_epi32(kk));
      for (int j = 0; j < NV; ++j) a[k][j] = _mm512_dpbf16_ps(a[k][j], qv[j], kb);
    }
  }
  const __m512 sc = _mm512_set1_ps(qscale);
  for (int k = 0; k < NK; ++k)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(s + size_t(k) * Rp + j * 16, _mm512_mul_ps(a[k][j], sc));
}

// qk_keys_bf16_packed<16, 1, 128> on 16 key rows read in place, ks elements apart (a block
// whose keys are consecutive slots): four moving pointers (keys 0, 4, 8, 12) and s, 2s, 3s
// in three registers address every key as [p], [p + s], [p + 2s], [p + 3s] (GCC 12 keeps
// exactly that: 16 broadcasts from 7 registers), so the block's K rows need no copy into
// k16. In L2 the copy held ~9% of verify-4's kernel samples (Round 6).
template <typename PF>
__attribute__((always_inline)) static inline void qk16_strided(const uint32_t* qp, int Rp,
                                                              const uint16_t* kp, int64_t ks,
                                                              float qscale, float* s, PF& pf) {
  __m512 a[16];
  for (int k = 0; k < 16; ++k) a[k] = _mm512_setzero_ps();
  const int64_t sb = ks * int64_t(sizeof(uint16_t));
  const int64_t s3 = 3 * sb;
  const char* m0 = reinterpret_cast<const char*>(kp);
  const char* m1 = m0 + 4 * sb;
  const char* m2 = m0 + 8 * sb;
  const char* m3 = m0 + 12 * sb;
  for (int cp = 0; cp < 64; ++cp) {
    if (cp % 8 == 0) pf.step();
    const __m512bh qv = as_bh(_mm512_loadu_si512(qp + size_t(cp) * Rp));
    const char* const mg[4] = {m0, m1, m2, m3};
    for (int g = 0; g < 4; ++g) {
      const int64_t off[4] = {0, sb, 2 * sb, s3};
      for (int j = 0; j < 4; ++j) {
        int32_t kk;
        std::memcpy(&kk, mg[g] + off[j], sizeof kk);
        a[4 * g + j] = _mm512_dpbf16_ps(a[4 * g + j], qv, as_bh(_mm512_set1_epi32(kk)));
      }
    }
    m0 += 4;
    m1 += 4;
    m2 += 4;
    m3 += 4;
  }
  const __m512 sc = _mm512_set1_ps(qscale);
  for (int k = 0; k < 16; ++k) _mm512_storeu_ps(s + size_t(k) * Rp, _mm512_mul_ps(a[k], sc));
}

// The 32-row tile of qk_keys_bf16_packed, out of line: inlined, rows_item_bf16 grew enough
// that GCC called pv_dispatch and its pv_rows_bf16 (the 16-row verify's p.V) out of line.
[[maybe_unused]] __attribute__((noinline)) static void qk_packed_8x2(
    const uint32_t* qp, int Rp, const uint16_t* kp, float qscale, float* s, PfLines& pf) {
  qk_keys_bf16_packed<8, 2, 128>(qp, Rp, kp, qscale, s, pf);
}
// A 48-row cascade tile's third row vector (kMaxCascadeRows), out of line as qk_packed_8x2.
[[maybe_unused]] __attribute__((noinline)) static void qk_packed_8x1(
    const uint32_t* qp, int Rp, const uint16_t* kp, float qscale, float* s, PfLines& pf) {
  qk_keys_bf16_packed<8, 1, 128>(qp, Rp, kp, qscale, s, pf);
}

// V rows of npairs key pairs interleaved as pv_rows_bf16 unpacks them, once per block:
// vil[c / 32][tp] = (unpacklo, unpackhi) of rows 2tp, 2tp + 1 at columns c..c + 31, 32 dwords.
__attribute__((always_inline)) static inline void interleave_pairs(const uint16_t* const* vr,
                                                                  int npairs, int Dv,
                                                                  uint32_t* vil) {
  for (int c = 0; c < Dv; c += 32) {
    uint32_t* vc = vil + size_t(c / 32) * size_t(npairs) * 32;
    for (int tp = 0; tp < npairs; ++tp) {
      const __m512i va = _mm512_loadu_si512(vr[2 * tp] + c);
      const __m512i vb = _mm512_loadu_si512(vr[2 * tp + 1] + c);
      _mm512_storeu_si512(vc + size_t(tp) * 32, _mm512_unpacklo_epi16(va, vb));
      _mm512_storeu_si512(vc + size_t(tp) * 32 + 16, _mm512_unpackhi_epi16(va, vb));
    }
  }
}

// pv_rows_bf16 (rs = 1) on the interleaved pairs of interleave_pairs: per key pair two loads
// from one moving pointer, no unpacking, no row pointers.
template <int NR>
__attribute__((always_inline)) static inline void pv_rows_bf16_il(
    float* acc, int Dv, const uint32_t* pb, size_t ts, const float* alpha, const uint32_t* vil,
    int npairs, PfLines& pf) {
  for (int c = 0; c < Dv; c += 32) {
    pf.step();
    __m512 lo[NR], hi[NR];
    for (int i = 0; i < NR; ++i) {
      const __m512 a = _mm512_set1_ps(alpha[i]);
      lo[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + size_t(i) * Dv + c), a);
      hi[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + size_t(i) * Dv + c + 16), a);
    }
    const uint32_t* vc = vil + size_t(c / 32) * size_t(npairs) * 32;
    for (int tp = 0; tp < npairs; ++tp) {
      const __m512bh vlo = as_bh(_mm512_loadu_si512(vc + size_t(tp) * 32));
      const __m512bh vhi = as_bh(_mm512_loadu_si512(vc + size_t(tp) * 32 + 16));
      for (int i = 0; i < NR; ++i) {
        const __m512bh pp = as_bh(_mm512_set1_epi32(int(pb[size_t(i) + size_t(tp) * ts])));
        lo[i] = _mm512_dpbf16_ps(lo[i], pp, vlo);
        hi[i] = _mm512_dpbf16_ps(hi[i], pp, vhi);
      }
    }
    for (int i = 0; i < NR; ++i) {
      _mm512_storeu_ps(acc + size_t(i) * Dv + c, lo[i]);
      _mm512_storeu_ps(acc + size_t(i) * Dv + c + 16, hi[i]);
    }
  }
}
// Out of line, as qk_packed_8x2.
[[maybe_unused]] __attribute__((noinline)) static void pv_il_dispatch(
    int nr, float* acc, int Dv, const uint32_t* pb, size_t ts, const float* alpha,
    const uint32_t* vil, int npairs, PfLines& pf) {
  switch (nr) {
    case 8: pv_rows_bf16_il<8>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
    case 7: pv_rows_bf16_il<7>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
    case 6: pv_rows_bf16_il<6>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
    case 5: pv_rows_bf16_il<5>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
    case 4: pv_rows_bf16_il<4>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
    case 3: pv_rows_bf16_il<3>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
    case 2: pv_rows_bf16_il<2>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
    default: pv_rows_bf16_il<1>(acc, Dv, pb, ts, alpha, vil, npairs, pf); break;
  }
}


// The q rows of an item, prefetched before start_row reads them (its first touch of q stalled
// row by row: ~6% of prefill's time): this item's rows into L1, and for a query tile that has
// a next one in its request (prefill: the thread's next item, most likely) that tile's rows
// into L2. Addresses inside q only (tokens of the item's own request, heads of the tile).
template <typename QT>
static inline void prefetch_q_rows(const NaProblem& P, const NaItem& it, const Tile& T) {
  const int lines = int((int64_t(T.D) * int64_t(sizeof(QT)) + 63) / 64);
  const QT* q = static_cast<const QT*>(P.q);
  for (int r = 0; r < T.R; ++r) {
    const RowSrc src = row_src(P, it, T.query_of(r));
    const int64_t token = P.qo_indptr[src.req] + src.j;
    const char* row = reinterpret_cast<const char*>(q + (token * T.Hq + T.head_of(it, r)) * T.D);
    for (int c = 0; c < lines; ++c) prefetch_t0(row + 64 * c);
  }
  if (it.shared) return;
  const int qs = P.qo_indptr[it.req];
  const int q_len = P.qo_indptr[it.req + 1] - qs;
  const int j1 = std::min(q_len, it.q1 + T.nq);
  for (int j = it.q1; j < j1; ++j) {
    for (int gi = 0; gi < T.nkv; ++gi) {
      const int64_t h = int64_t(it.kv_head + gi) * T.G + it.h0;
      const char* row = reinterpret_cast<const char*>(q + ((qs + j) * int64_t(T.Hq) + h) * T.D);
      // the tile's heads of this kv head are adjacent: nh rows in one run
      for (int c = 0; c < lines * T.nh; ++c) prefetch_t2(row + 64 * c);
    }
  }
}

// The vdpbf16ps many-row kernel: bf16 q, bf16 or FP8 cache, head dims multiples of 32. K and
// V rows of a bf16 cache are read in place; FP8 rows are widened to bf16 (exact) once per
// block and kv head.
// kWide (tiles of 17-32 rows per kv head: two row vectors) adds the 32-row tiles' packed K
// and interleaved V; without it the kernel is Round 3's, compiled apart (rows_item_bf16
// below chooses): one body with both made the 16-row verify ~8% slower (GCC's code for the
// shared loops changed with the additions).
// What this thread's last many-row item (vdpbf16ps kernel) read: the K/V rows of key positions
// [k0, k1) of kv heads [kv_head, kv_head + nkv) of one request's page table. Only a hint for
// the prefetch (rows_item_bf16_impl): a stale or wrong match can cost time, never a result.
struct RowsLastRead {
  const void* k = nullptr;
  const void* v = nullptr;
  const int32_t* pages = nullptr;
  int kv_head = -1, nkv = 0, k0 = 0, k1 = 0;
};
static thread_local RowsLastRead tls_last_read;
// Bytes of an item's K/V lines counted as still in L2 for the next item (half of Zen 4/5's
// 1 MB per core: the next item's own lines, q and the buffers share it).
constexpr int64_t kRowsL2Bytes = 512 * 1024;

template <typename KT, bool kWide>
__attribute__((noinline)) static int rows_item_bf16_impl(const NaProblem& P, const NaItem& it) {
  constexpr bool f8 = !std::is_same<KT, uint16_t>::value;
  const Tile T(P, it);
  const int D = T.D, Dv = T.Dv, R1 = T.R1, nkv = T.nkv;
  const int Rp = round_up(R1, 16);
  Buffers& B = tls_buffers;
  RowsBuffers& RB = tls_rows;
  if (!B.ensure(T.R, D, Dv)) return -2;
  // st: transposed scores [BK][Rp], then the bf16 weight pairs [BK / 2][Rp] (dwords).
  if (!RB.ensure(size_t(nkv) * (D / 2) * Rp, size_t(BK) * Rp + size_t(BK / 2) * Rp,
                 size_t(BK) * D / 2 + size_t(BK) * Dv / 2 + 16, f8 ? size_t(BK) * Dv / 2 : 0,
                 size_t(3) * nkv * Rp)) {
    return -2;
  }
  float* acc = B.acc.data();
  float* m = B.m.data();
  float* l = B.l.data();
  uint32_t* qp = reinterpret_cast<uint32_t*>(RB.qt.data());
  float* sT = RB.st.data();
  uint32_t* pbT = reinterpret_cast<uint32_t*>(sT + size_t(BK) * Rp);
  // k16 (the block's K rows, bf16) 64-byte aligned, so each 256-byte row of D = 128 is four
  // cache lines (the 16 floats of room for it are in the ensure above).
  uint16_t* k16 = reinterpret_cast<uint16_t*>(
      RB.kb.data() + (64 - reinterpret_cast<uintptr_t>(RB.kb.data()) % 64) % 64 / sizeof(float));
  uint16_t* v16 = reinterpret_cast<uint16_t*>(RB.vb.data());
  // The block's V rows interleaved in key pairs (pv_rows_bf16_il), after k16's BK x D bf16.
  [[maybe_unused]] uint32_t* vil = reinterpret_cast<uint32_t*>(k16 + size_t(BK) * D);
  float* mL = RB.ml.data();
  float* lL = mL + size_t(nkv) * Rp;
  float* aL = lL + size_t(nkv) * Rp;
#ifdef NA_HAVE_AMX
  // Accumulators with a row per lane (pad lanes too): [nkv][Rp][Dv], zeroed below.
  if (!tls_amx.ensure(size_t(nkv) * Rp * Dv, na_amx::scratch_bytes(D, Dv))) return -2;
  float* accA = tls_amx.acc.data();
  na_amx::Scratch sc;
  {
    unsigned char* base = tls_amx.scratch.data();
    base += (64 - reinterpret_cast<uintptr_t>(base) % 64) % 64;
    sc.kpack = reinterpret_cast<uint16_t*>(base);
    sc.vv = reinterpret_cast<uint32_t*>(sc.kpack + size_t(na_amx::kKeys) * D);
    sc.pa = sc.vv + size_t(Dv) * na_amx::kKeys / 2;
  }
  std::memset(accA, 0, sizeof(float) * size_t(nkv) * Rp * Dv);
  // Keys consecutive in a page are this far apart in kr (FP8: the widened rows).
  const int64_t kstep = f8 ? D : T.kstride();
  const AmxTiles tiles_on;
#endif
  RowState S;
  const float qscale = P.sm_scale * kLog2e * P.k_scale * f8_unit(P);
  // q^T pairs per kv head: dword cp of row r at [cp][lane] (pad lanes 0); q stays bf16.
  prefetch_q_rows<uint16_t>(P, it, T);
  std::memset(qp, 0, sizeof(uint32_t) * size_t(nkv) * (D / 2) * Rp);
  for (int r = 0; r < T.R; ++r) {
    const uint16_t* q = start_row<uint16_t>(P, it, T, r, S, m, l, acc + size_t(r) * Dv, Dv);
    uint32_t* qg = qp + size_t(r / R1) * (D / 2) * Rp + r % R1;
    for (int cp = 0; cp < D / 2; ++cp) {
      uint32_t x;
      std::memcpy(&x, q + 2 * cp, sizeof x);
      qg[size_t(cp) * Rp] = x;
    }
  }
  for (int i = 0; i < nkv * Rp; ++i) {
    mL[i] = kNegInf;
    lL[i] = 0.0f;
  }
  RowLanes L[na::kMaxRows];
  vu badv[na::kMaxRows][na::kMaxTileRows / W + 1];
  for (int gi = 0; gi < nkv; ++gi) {
    lanes_init(P, it, S, gi * R1, R1, Rp, L[gi]);
    for (auto& x : badv[gi]) x = vu{};
  }
  // MLA (one latent row per token, its first Dv elements the value): V rows are the K rows.
  const bool mla = T.mla;
  const KT* kbase = static_cast<const KT*>(P.k);
  const KT* vbase = static_cast<const KT*>(mla ? P.k : P.v);
  const int64_t kstride = T.kstride(), vstride = T.vstride();
  // Prefetch only the tile's kv heads of each token (adjacent in the row): a tile of one or
  // two of 8 kv heads used to queue the whole row, 4-8x the lines it reads, and the cursor's
  // per-line loop then cost more instructions than the tile's vdpbf16ps (perf, tree-8).
  const KT* kpf = kbase + int64_t(it.kv_head) * D;
  const KT* vpf = vbase + int64_t(it.kv_head) * Dv;
  const int klines = int((int64_t(nkv) * D * int64_t(sizeof(KT)) + 63) / 64);
  const int vlines = mla ? 0 : int((int64_t(nkv) * Dv * int64_t(sizeof(KT)) + 63) / 64);
  const KT* kp0[BK];
  const KT* vp0[BK];
  const uint16_t* kr[BK];
  const uint16_t* vr[BK + 1];
  [[maybe_unused]] const int nvt = Rp / 16;  // unused by the AMX unit
  // Keys before pf_from are not prefetched: this thread's previous item read them (the same
  // cache, request and kv heads; few enough lines to be in this core's L2 still: prefill's
  // consecutive query tiles of one kv head), so their prefetches would only cost issue slots.
  int pf_from = it.k0;
  {
    const RowsLastRead& lr = tls_last_read;
    if (lr.k == P.k && lr.v == P.v && lr.pages == T.pages && lr.kv_head == it.kv_head &&
        lr.nkv == nkv && lr.k0 <= it.k0 &&
        int64_t(lr.k1 - lr.k0) * (klines + vlines) * 64 <= kRowsL2Bytes) {
      pf_from = std::max(it.k0, lr.k1);
    }
  }
  PfLines pf;
  pf.queue_rows(T, pf_from, std::min(it.k1, it.k0 + BK), kpf, vpf, kstride, vstride, klines,
                vlines);
  pf.flush();
  for (int k0 = it.k0; k0 < it.k1; k0 += BK) {
    const int n = std::min(BK, it.k1 - k0);
    block_rows(T, k0, n, kbase, vbase, kstride, vstride, kp0, vp0);
#ifdef NA_HAVE_AMX
    const int nk = 16;  // keys per score tile
#else
    const int nk = nvt >= 2 ? 8 : 16;
#endif
    const int nt = round_up(n, nk);
#ifndef NA_HAVE_AMX
    // 16 rows at head dim 128 over a bf16 cache, a whole block whose 32 keys are consecutive
    // slots, every one of them checked (pages of a run can be out of order in the middle of a
    // block with its two ends 31 slots apart): q.K^T reads the rows in place
    // (qk16_strided), no copy.
    bool krun = !kWide && !f8 && D == 128 && nvt == 1 && n == nt;
    for (int t = 1; krun && t < n; ++t) krun = kp0[t] == kp0[0] + int64_t(t) * kstride;
#endif
    {
      const int ka = k0 + BK;
      pf.queue_rows(T, std::max(ka, pf_from), std::min(it.k1, ka + BK), kpf, vpf, kstride,
                    vstride, klines, vlines);
#ifdef NA_HAVE_AMX
      pf.plan(nkv * (4 + (f8 ? 2 * n : 0)));  // the pf.step() calls per kv head below
#else
      const int tiles = nt / nk * (nvt >= 2 ? (nvt + 1) / 2 : 1);
      const int widen = f8 ? (mla ? 1 : 2) * n : 0;  // FP8: K (and V) rows widened per key
      pf.plan(nkv * (tiles * (D / 16) + ((R1 + 7) / 8) * (Dv / 32) + widen));
#endif
    }
    for (int gi = 0; gi < nkv; ++gi) {
      const int64_t koff = int64_t(it.kv_head + gi) * D;
      const int64_t voff = int64_t(it.kv_head + gi) * Dv;
      for (int t = 0; t < n; ++t) {
        if constexpr (f8) {
          pf.step();
          fp8_row_to_bf16(k16 + size_t(t) * D, kp0[t] + koff, D);
          kr[t] = k16 + size_t(t) * D;
          if (mla) {  // the widened latent row is the value row too
            vr[t] = kr[t];
            continue;
          }
          pf.step();
          fp8_row_to_bf16(v16 + size_t(t) * Dv, vp0[t] + voff, Dv);
          vr[t] = v16 + size_t(t) * Dv;
        } else {
          kr[t] = reinterpret_cast<const uint16_t*>(kp0[t] + koff);
          vr[t] = reinterpret_cast<const uint16_t*>(vp0[t] + voff);
        }
      }
      // Keys past the block's end read the first key's row (valid memory; masked to weight 0).
      for (int t = n; t < nt; ++t) kr[t] = kr[0];
#ifndef NA_HAVE_AMX
      // Head dim 128, one row vector of lanes (GQA verify, bf16 cache) or two to four (kWide:
      // trees, prefill, cascade tiles; an FP8 cache's rows are in k16 already, widened): the
      // block's K rows copied into k16 (n rows, each inside its cache row; rows n..nt - 1 of
      // k16 are the buffer's own memory, masked to weight 0) so that q.K^T addresses them
      // from one pointer.
      const bool packk = D == 128 && (kWide ? nvt >= 2 : !f8 && nvt == 1);
      if (packk && !f8 && !krun) {
        for (int t = 0; t < n; ++t) std::memcpy(k16 + size_t(t) * 128, kr[t], 256);
      }
#endif
      const uint32_t* qg = qp + size_t(gi) * (D / 2) * Rp;
#ifdef NA_HAVE_AMX
      pf.step();
      na_amx::qk_block(qg, Rp, D, kr, nt, kstep, sc, sT);
      {
        const __m512 scv = _mm512_set1_ps(qscale);
        for (size_t i = 0; i < size_t(nt) * Rp; i += 16) {
          _mm512_storeu_ps(sT + i, _mm512_mul_ps(_mm512_loadu_ps(sT + i), scv));
        }
      }
      pf.step();
#else
      for (int t0 = 0; t0 < nt; t0 += nk) {
        if (kWide && packk) {
          // Two row vectors at a time; a cascade tile of 48 or 64 rows (up to kMaxCascadeRows)
          // runs more on the same packed keys, the third of 48 alone.
          int j = 0;
          for (; j + 2 <= nvt; j += 2)
            qk_packed_8x2(qg + j * 16, Rp, k16 + size_t(t0) * 128, qscale,
                          sT + size_t(t0) * Rp + j * 16, pf);
          if (j < nvt)
            qk_packed_8x1(qg + j * 16, Rp, k16 + size_t(t0) * 128, qscale,
                          sT + size_t(t0) * Rp + j * 16, pf);
        } else if (nvt >= 2) {
          int j = 0;
          for (; j + 2 <= nvt; j += 2)
            qk_keys_bf16<8, 2>(qg + j * 16, Rp, D, kr + t0, qscale, sT + size_t(t0) * Rp + j * 16,
                               pf);
          for (; j < nvt; ++j)
            qk_keys_bf16<8, 1>(qg + j * 16, Rp, D, kr + t0, qscale, sT + size_t(t0) * Rp + j * 16,
                               pf);
        } else if (krun) {
          qk16_strided(qg, Rp, kr[t0], kstride, qscale, sT + size_t(t0) * Rp, pf);
        } else if (packk) {
          qk_keys_bf16_packed<16, 1, 128>(qg, Rp, k16 + size_t(t0) * 128, qscale,
                                          sT + size_t(t0) * Rp, pf);
        } else {
          qk_keys_bf16<16, 1>(qg, Rp, D, kr + t0, qscale, sT + size_t(t0) * Rp, pf);
        }
      }
#endif
      const RowLanes& LG = L[gi];
      const bool whole = block_seen_whole(P, LG, k0, n);
      float* ag = aL + size_t(gi) * Rp;
      // Weights as bf16 pairs (keys 2tp, 2tp + 1) per lane, pbT[tp][lane].
      rows_softmax_pairs(P, LG, sT, nt, n, k0, whole, mL + size_t(gi) * Rp, lL + size_t(gi) * Rp,
                         ag, badv[gi], pbT);
      const int npairs = (n + 1) / 2;
      if (!whole) {
        guard_values<uint16_t>(P, S.lim, S.mrow, S.bad, gi * R1, (gi + 1) * R1, k0, n, vr, Dv);
      }
      // An odd block's last pair reads one key past the block (weight 0): a zero row.
      if (n % 2) vr[n] = zero_row<uint16_t>();
#ifdef NA_HAVE_AMX
      {
        float* ac = accA + size_t(gi) * Rp * Dv;
        for (int i = 0; i < Rp; ++i) {  // the rescale (pad lanes: alpha 1)
          const __m512 a = _mm512_set1_ps(ag[i]);
          float* row = ac + size_t(i) * Dv;
          for (int c = 0; c < Dv; c += 16) {
            _mm512_storeu_ps(row + c, _mm512_mul_ps(_mm512_loadu_ps(row + c), a));
          }
        }
        pf.step();
        na_amx::interleave_values(vr, npairs, Dv, sc.vv);
        pf.step();
        na_amx::pv_block(ac, Rp, Dv, pbT, npairs, sc);
      }
#else
      if (kWide) {
        // Three or four 8-row groups (32-row tiles: trees, prefill): each V pair interleaved
        // once per block, not once per group. (At 16 rows, verify-4, it did not pay.)
        interleave_pairs(vr, npairs, Dv, vil);
        for (int i0 = 0; i0 < R1; i0 += 8) {
          pv_il_dispatch(std::min(8, R1 - i0), acc + size_t(gi * R1 + i0) * Dv, Dv, pbT + i0,
                         size_t(Rp), ag + i0, vil, npairs, pf);
        }
      } else {
        for (int i0 = 0; i0 < R1; i0 += 8) {
          pv_dispatch(std::min(8, R1 - i0), acc + size_t(gi * R1 + i0) * Dv, Dv, pbT + i0, 1,
                      size_t(Rp), ag + i0, vr, npairs, pf);
        }
      }
#endif
    }
  }
  tls_last_read = RowsLastRead{P.k, P.v, T.pages, it.kv_head, nkv, it.k0, it.k1};
  for (int gi = 0; gi < nkv; ++gi) lanes_bad(badv[gi], gi * R1, R1, S);
  for (int r = 0; r < T.R; ++r) {
    m[r] = mL[size_t(r / R1) * Rp + r % R1];
    l[r] = lL[size_t(r / R1) * Rp + r % R1];
  }
#ifdef NA_HAVE_AMX
  finish_rows<uint16_t>(P, it, T, m, l, S, [&](int r) {
    const float* ar = accA + (size_t(r / R1) * Rp + size_t(r % R1)) * Dv;
    return unpermute_row(B.k.data(), ar, Dv);  // B.k: >= Dv floats
  });
#else
  finish_rows<uint16_t>(P, it, T, m, l, S, [&](int r) {
    return unpermute_row(B.k.data(), acc + size_t(r) * Dv, Dv);  // B.k: >= Dv floats
  });
#endif
  return 0;
}

template <typename KT>
static int rows_item_bf16(const NaProblem& P, const NaItem& it) {
#ifdef NA_HAVE_AMX
  return rows_item_bf16_impl<KT, false>(P, it);
#else
  return Tile(P, it).R1 > 16 ? rows_item_bf16_impl<KT, true>(P, it)
                             : rows_item_bf16_impl<KT, false>(P, it);
#endif
}
#endif

}  // namespace NA_NS

#endif  // NATIVE_ATTN_ROWS_PATH_H
