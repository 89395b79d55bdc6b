// Kernel bodies, compiled once per instruction set: each kern_<isa>.cpp defines NA_NS,
// NA_TABLE, NA_ISA_NAME (and NA_W where the width is not the flags' widest) and includes this
// file with its own -m flags. The code uses GCC/Clang vector extensions, which the compiler
// lowers to zmm, ymm, xmm or NEON depending on the flags of the including translation unit:
// one source, portable, with the fast paths chosen at run time by native_attn.cpp.
//
// Layers: simd.h (vectors, loads, conversions) -> tile.h (tile geometry and prologue,
// masks, finish) -> bf16_path.h (AVX-512-BF16 only) -> this file (the fp32 item kernels,
// the merge, the table). Each header compiles alone.
#ifndef NATIVE_ATTN_KERNELS_IMPL_H
#define NATIVE_ATTN_KERNELS_IMPL_H
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "tile.h"
#ifdef NA_HAVE_BF16_PATH
#include "bf16_path.h"
#endif
#include "rows_path.h"

#ifndef NA_TABLE
#define NA_TABLE na_kernels_standalone
#endif
#ifndef NA_ISA_NAME
#define NA_ISA_NAME "standalone"
#endif

namespace NA_NS {

// Scores of NR query rows (fp32, pre-scaled, row stride Dp) against two keys, the cache rows
// widened to fp32 inside the loads: each key chunk is loaded once for all NR rows.
template <int NR, typename KT>
static inline void qk_pair(const float* q, int Dp, int D, const KT* k0, const KT* k1, float* s) {
  vf a[NR][2];
  for (int i = 0; i < NR; ++i) a[i][0] = a[i][1] = splat(0.0f);
  for (int c = 0; c < D; c += W) {
    const vf x0 = ldk(k0 + c), x1 = ldk(k1 + c);
    for (int i = 0; i < NR; ++i) {
      const vf qv = ld(q + size_t(i) * Dp + c);
      a[i][0] += qv * x0;
      a[i][1] += qv * x1;
    }
  }
#if NA_W == 8 && defined(__AVX2__)
  if constexpr (NR == 4) {
    // 8 horizontal sums at once (3 levels of hadd and one lane swap instead of 8 x 5 ops):
    // lanes of the result: (r0k0, r0k1, r1k0, r1k1, r2k0, r2k1, r3k0, r3k1).
    const __m256 h0 = _mm256_hadd_ps((__m256)a[0][0], (__m256)a[0][1]);
    const __m256 h1 = _mm256_hadd_ps((__m256)a[1][0], (__m256)a[1][1]);
    const __m256 h2 = _mm256_hadd_ps((__m256)a[2][0], (__m256)a[2][1]);
    const __m256 h3 = _mm256_hadd_ps((__m256)a[3][0], (__m256)a[3][1]);
    const __m256 g0 = _mm256_hadd_ps(h0, h1);  // per 128-bit lane: r0k0 r0k1 r1k0 r1k1
    const __m256 g1 = _mm256_hadd_ps(h2, h3);
    const __m256 lo = _mm256_permute2f128_ps(g0, g1, 0x20);
    const __m256 hi = _mm256_permute2f128_ps(g0, g1, 0x31);
    alignas(32) float r[8];
    _mm256_store_ps(r, _mm256_add_ps(lo, hi));
    for (int i = 0; i < 4; ++i) {
      s[size_t(i) * BK] = r[2 * i];
      s[size_t(i) * BK + 1] = r[2 * i + 1];
    }
    return;
  }
#endif
  for (int i = 0; i < NR; ++i) {
    s[size_t(i) * BK] = hsum(a[i][0]);
    s[size_t(i) * BK + 1] = hsum(a[i][1]);
  }
}

// acc (NR rows, stride Dvp) = acc * alpha + p . V over n keys; each V chunk is loaded (and
// widened) once for all NR rows.
template <int NR, typename KT>
static inline void pv_tile(float* acc, int Dvp, int Dv, const float* p, const float* alpha,
                           const KT* const* vp, int n) {
  int c = 0;
  for (; c + 2 * W <= Dv; c += 2 * W) {
    vf a[NR][2];
    for (int i = 0; i < NR; ++i) {
      a[i][0] = ld(acc + size_t(i) * Dvp + c) * alpha[i];
      a[i][1] = ld(acc + size_t(i) * Dvp + c + W) * alpha[i];
    }
    for (int t = 0; t < n; ++t) {
      const vf x0 = ldk(vp[t] + c), x1 = ldk(vp[t] + c + W);
      for (int i = 0; i < NR; ++i) {
        const float pi = p[size_t(i) * BK + t];
        a[i][0] += pi * x0;
        a[i][1] += pi * x1;
      }
    }
    for (int i = 0; i < NR; ++i) {
      st(acc + size_t(i) * Dvp + c, a[i][0]);
      st(acc + size_t(i) * Dvp + c + W, a[i][1]);
    }
  }
  for (; c < Dv; c += W) {
    vf a[NR];
    for (int i = 0; i < NR; ++i) a[i] = ld(acc + size_t(i) * Dvp + c) * alpha[i];
    for (int t = 0; t < n; ++t) {
      const vf x = ldk(vp[t] + c);
      for (int i = 0; i < NR; ++i) a[i] += p[size_t(i) * BK + t] * x;
    }
    for (int i = 0; i < NR; ++i) st(acc + size_t(i) * Dvp + c, a[i]);
  }
}

template <typename KT>
static inline void qk_rows(int nr, const float* q, int Dp, int D, const KT* k0, const KT* k1,
                           float* s) {
  switch (nr) {
    case 4: qk_pair<4>(q, Dp, D, k0, k1, s); break;
    case 3: qk_pair<3>(q, Dp, D, k0, k1, s); break;
    case 2: qk_pair<2>(q, Dp, D, k0, k1, s); break;
    default: qk_pair<1>(q, Dp, D, k0, k1, s); break;
  }
}

template <typename KT>
static inline void pv_rows(int nr, float* acc, int Dvp, int Dv, const float* p,
                           const float* alpha, const KT* const* vp, int n) {
  switch (nr) {
    case 4: pv_tile<4>(acc, Dvp, Dv, p, alpha, vp, n); break;
    case 3: pv_tile<3>(acc, Dvp, Dv, p, alpha, vp, n); break;
    case 2: pv_tile<2>(acc, Dvp, Dv, p, alpha, vp, n); break;
    default: pv_tile<1>(acc, Dvp, Dv, p, alpha, vp, n); break;
  }
}

// The fast fp32-accumulating path (AVX2, AVX-512 without BF16, fp16/fp32 caches): head dims
// multiples of the vector width. No conversion pass: K and V are read straight from the
// paged cache and widened in registers, 4 rows x 2 keys per score tile, 4 rows per p.V
// chunk, and the next block's whole rows prefetched in address order, a few lines per step.
template <typename QT, typename KT>
static int fused_item(const NaProblem& P, const NaItem& it) {
  const Tile T(P, it);
  const int Dp = T.D, Dvp = T.Dv;
  Buffers& B = tls_buffers;
  if (!B.ensure(T.R, Dp, Dvp)) return -2;
  float* qb = B.q.data();
  float* Sc = B.s.data();
  float* acc = B.acc.data();
  float* m = B.m.data();
  float* l = B.l.data();
  RowState S;
  init_rows<QT>(P, it, T, Dp, Dvp, qb, m, l, acc, S);
  const KT* kbase = static_cast<const KT*>(P.k);
  const KT* vbase = static_cast<const KT*>(T.mla ? P.k : P.v);
  const int64_t kstride = T.kstride(), vstride = T.vstride();
  // Prefetch the tile's kv heads of each token only (not the whole row: a tile of 2 of 8
  // kv heads used to queue 4x the lines it reads).
  const KT* kpf = kbase + (T.mla ? 0 : int64_t(it.kv_head) * Dp);
  const KT* vpf = vbase + (T.mla ? 0 : int64_t(it.kv_head) * Dvp);
  const int klines =
      int(((T.mla ? kstride : int64_t(T.nkv) * Dp) * int64_t(sizeof(KT)) + 63) / 64);
  const int vlines = T.mla ? 0 : int((int64_t(T.nkv) * Dvp * int64_t(sizeof(KT)) + 63) / 64);
  const KT* kp0[BK];
  const KT* vp0[BK];
  const KT* kp[BK + 1];
  const KT* vp[BK];
  const float* kf[BK + 1];
  const float* vf_[BK];
  float* kb = B.k.data();
  float* vb = B.v.data();
  // One block ahead, spread over the block's compute (PfCursor): measured faster than 2 or 3
  // blocks on both the AVX-512 and the AVX2 path (1.02-1.06x).
  constexpr int pf_ahead = 1;
  // The first blocks, which the in-loop prefetch (pf_ahead blocks ahead) never covers: at
  // once, as nothing else can run before them.
  PfCursor pf;
  pf.set_lean(P.lean_prefetch != 0);
  pf.queue_rows(T, it.k0, std::min(it.k1, it.k0 + pf_ahead * BK), kpf, vpf, kstride,
                vstride, klines, vlines);
  pf.flush();
  for (int k0 = it.k0; k0 < it.k1; k0 += BK) {
    const int n = std::min(BK, it.k1 - k0);
    for (int t = 0; t < n; ++t) {
      const int pos = k0 + t;
      const int64_t slot = T.slot(pos);
      kp0[t] = kbase + slot * kstride;
      vp0[t] = vbase + slot * vstride;
    }
    // Rows pf_ahead blocks ahead, whole (every head), in address order, a few lines per
    // score pair and value chunk over this block (see PfCursor).
    {
      const int ka = k0 + pf_ahead * BK;
      pf.queue_rows(T, ka, std::min(it.k1, ka + BK), kpf, vpf, kstride, vstride, klines,
                    vlines);
      const int groups = (T.R1 + 3) / 4;
      pf.plan(T.nkv * groups * ((n + 1) / 2 + 1));
    }
    for (int gi = 0; gi < T.nkv; ++gi) {
      const int64_t koff = T.mla ? 0 : int64_t(it.kv_head + gi) * T.D;
      const int64_t voff = T.mla ? 0 : int64_t(it.kv_head + gi) * T.Dv;
      for (int t = 0; t < n; ++t) {
        kp[t] = kp0[t] + koff;
        vp[t] = vp0[t] + voff;
      }
      kp[n] = kp[0];  // an odd block's last pair reads a real row; that score is dropped
      const int rb = gi * T.R1;
      // Many rows per head (prefill, MLA): widen the block's rows once into fp32 buffers
      // that every 4-row group reuses; few rows (GQA decode): widen inside the loads.
      const bool widen = !std::is_same<KT, float>::value && T.R1 > 4;
      if (widen) {
        for (int t = 0; t < n; ++t) {
          load_row(kb + size_t(t) * Dp, kp[t], T.D, Dp);
          kf[t] = kb + size_t(t) * Dp;
          if (!T.mla) {
            load_row(vb + size_t(t) * Dvp, vp[t], T.Dv, Dvp);
            vf_[t] = vb + size_t(t) * Dvp;
          } else {
            vf_[t] = kf[t];
          }
        }
        kf[n] = kf[0];
      }
      for (int r0 = 0; r0 < T.R1; r0 += 4) {
        const int nr = std::min(4, T.R1 - r0);
        const float* qg = qb + size_t(rb + r0) * Dp;
        float* sg = Sc + size_t(rb + r0) * BK;
        if (widen) {
          for (int t = 0; t < n; t += 2) {
            pf.step();
            qk_rows(nr, qg, Dp, T.D, kf[t], kf[t + 1], sg + t);
          }
        } else {
          for (int t = 0; t < n; t += 2) {
            pf.step();
            qk_rows(nr, qg, Dp, T.D, kp[t], kp[t + 1], sg + t);
          }
        }
      }
      for (int r = rb; r < rb + T.R1; ++r) {
        float* sr = Sc + size_t(r) * BK;
        if (post_scores(P, sr, n, k0, S.lim[r], S.mrow[r])) S.bad[r] = true;
        vf mv = ld(sr);
        for (int t = W; t < BK; t += W) mv = vmax(mv, ld(sr + t));
        const float mn = std::max(m[r], hmax(mv));
        if (mn == kNegInf) {  // every key so far masked for this row
          std::memset(sr, 0, sizeof(float) * BK);
          S.alpha[r] = 1.0f;
          continue;
        }
        S.alpha[r] = std::exp2(m[r] - mn);
        vf psum = splat(0.0f);
        for (int t = 0; t < BK; t += W) {
          const vf p = vexp2(ld(sr + t) - mn);
          psum += p;
          st(sr + t, p);
        }
        l[r] = l[r] * S.alpha[r] + hsum(psum);
        m[r] = mn;
      }
      if (widen) {
        guard_values<float>(P, S.lim, S.mrow, S.bad, rb, rb + T.R1, k0, n, vf_, T.Dv);
      } else {
        guard_values<KT>(P, S.lim, S.mrow, S.bad, rb, rb + T.R1, k0, n, vp, T.Dv);
      }
      for (int r0 = 0; r0 < T.R1; r0 += 4) {
        const int nr = std::min(4, T.R1 - r0);
        pf.step();
        if (widen) {
          pv_rows(nr, acc + size_t(rb + r0) * Dvp, Dvp, T.Dv, Sc + size_t(rb + r0) * BK,
                  S.alpha + rb + r0, vf_, n);
        } else {
          pv_rows(nr, acc + size_t(rb + r0) * Dvp, Dvp, T.Dv, Sc + size_t(rb + r0) * BK,
                  S.alpha + rb + r0, vp, n);
        }
      }
    }
  }
  finish_rows<QT>(P, it, T, m, l, S, [&](int r) { return acc + size_t(r) * Dvp; });
  return 0;
}

template <typename QT, typename KT>
static int item_impl(const NaProblem& P, const NaItem& it) {
  const Tile T(P, it);
  const int Dp = round_up(T.D, W), Dvp = round_up(T.Dv, W);
  Buffers& B = tls_buffers;
  if (!B.ensure(T.R, Dp, Dvp)) return -2;
  float* qb = B.q.data();
  float* kb = B.k.data();
  float* vb = B.v.data();
  float* Sc = B.s.data();
  float* acc = B.acc.data();
  float* m = B.m.data();
  float* l = B.l.data();
  RowState S;
  init_rows<QT>(P, it, T, Dp, Dvp, qb, m, l, acc, S);
  const KT* kbase = static_cast<const KT*>(P.k);
  const KT* vbase = static_cast<const KT*>(P.v);
  for (int k0 = it.k0; k0 < it.k1; k0 += BK) {
    const int n = std::min(BK, it.k1 - k0);
    // kv heads innermost: the block's tokens are read whole (all heads), in address order.
    for (int gi = 0; gi < T.nkv; ++gi) {
    const int g = it.kv_head + gi;
    // Gather and convert the block's rows once; every row of the tile reuses them.
    for (int t = 0; t < n; ++t) {
      const int pos = k0 + t;
      const int64_t slot = T.slot(pos);
      if (T.mla) {
        load_row(kb + size_t(t) * Dp, kbase + slot * T.D, T.D, Dp);
      } else {
        load_row(kb + size_t(t) * Dp, kbase + (slot * T.Hkv + g) * T.D, T.D, Dp);
        load_row(vb + size_t(t) * Dvp, vbase + (slot * T.Hkv + g) * T.Dv, T.Dv, Dvp);
      }
    }
    // MLA: V is the first T.Dv columns of the same converted latent rows (read once).
    const float* V = T.mla ? kb : vb;
    const int vstride = T.mla ? Dp : Dvp;
    for (int r = gi * T.R1; r < (gi + 1) * T.R1; ++r) {
      const float* qr = qb + size_t(r) * Dp;
      float* sr = Sc + size_t(r) * BK;
      int t = 0;
      for (; t + 4 <= n; t += 4) {
        const float* k0p = kb + size_t(t) * Dp;
        vf a0 = splat(0.0f), a1 = a0, a2 = a0, a3 = a0;
        for (int c = 0; c < Dp; c += W) {
          const vf qv = ld(qr + c);
          a0 += qv * ld(k0p + c);
          a1 += qv * ld(k0p + Dp + c);
          a2 += qv * ld(k0p + 2 * Dp + c);
          a3 += qv * ld(k0p + 3 * Dp + c);
        }
        sr[t] = hsum(a0);
        sr[t + 1] = hsum(a1);
        sr[t + 2] = hsum(a2);
        sr[t + 3] = hsum(a3);
      }
      for (; t < n; ++t) {
        const float* kp = kb + size_t(t) * Dp;
        vf a = splat(0.0f);
        for (int c = 0; c < Dp; c += W) a += ld(qr + c) * ld(kp + c);
        sr[t] = hsum(a);
      }
      if (post_scores(P, sr, n, k0, S.lim[r], S.mrow[r])) S.bad[r] = true;
    }
    const float* vrows[BK];
    for (int t = 0; t < n; ++t) vrows[t] = V + size_t(t) * vstride;
    guard_values<float>(P, S.lim, S.mrow, S.bad, gi * T.R1, (gi + 1) * T.R1, k0, n, vrows, T.Dv);
    // Online softmax: one max/rescale per row per block, then acc += p . V.
    for (int r = gi * T.R1; r < (gi + 1) * T.R1; ++r) {
      float* sr = Sc + size_t(r) * BK;
      vf mv = ld(sr);
      for (int t = W; t < BK; t += W) mv = vmax(mv, ld(sr + t));
      const float mn = std::max(m[r], hmax(mv));
      if (mn == kNegInf) continue;  // every key so far masked for this row
      const float alpha = std::exp2(m[r] - mn);
      vf psum = splat(0.0f);
      for (int t = 0; t < BK; t += W) {
        const vf p = vexp2(ld(sr + t) - mn);
        psum += p;
        st(sr + t, p);
      }
      l[r] = l[r] * alpha + hsum(psum);
      m[r] = mn;
      float* ar = acc + size_t(r) * Dvp;
      int c = 0;
      for (; c + 2 * W <= Dvp; c += 2 * W) {
        vf a0 = ld(ar + c) * alpha, a1 = ld(ar + c + W) * alpha;
        for (int t = 0; t < n; ++t) {
          const float* vp = vrows[t] + c;
          a0 += sr[t] * ld(vp);
          a1 += sr[t] * ld(vp + W);
        }
        st(ar + c, a0);
        st(ar + c + W, a1);
      }
      for (; c < Dvp; c += W) {
        vf a = ld(ar + c) * alpha;
        for (int t = 0; t < n; ++t) a += sr[t] * ld(vrows[t] + c);
        st(ar + c, a);
      }
    }
    }  // kv heads
  }
  finish_rows<QT>(P, it, T, m, l, S, [&](int r) { return acc + size_t(r) * Dvp; });
  return 0;
}

template <typename QT>
static int merge_impl(const NaProblem& P, const NaMerge& mg) {
  const int Hq = P.num_q_heads, Hkv = P.num_kv_heads, Dv = P.v_head_dim;
  const int G = Hq / Hkv;
  const int nh = mg.h1 - mg.h0, nq = mg.q1 - mg.q0, R1 = nh * nq;
  const int R = (mg.kv_head_end - mg.kv_head) * R1;
  const float* lse = P.scratch + P.scratch_rows * Dv;
  const int qs = P.qo_indptr[mg.req];
  const int nparts = mg.nsplit + mg.nshared;
  Buffers& B = tls_buffers;
  if (!B.ensure(1, W, round_up(Dv, W))) return -2;
  float* tmp = B.acc.data();
  for (int r = 0; r < R; ++r) {
    const int gi = r / R1, jj = (r % R1) / nh, hh = r % nh;
    const int64_t token = qs + mg.q0 + jj;
    const int head = (mg.kv_head + gi) * G + mg.h0 + hh;
    // Part p's scratch row: the tile's own splits, then the cascade group's shared splits.
    auto part_row = [&](int p) -> int64_t {
      if (p < mg.nsplit) return int64_t(mg.slot0) + int64_t(p) * R + r;
      return int64_t(mg.shared0) + int64_t(p - mg.nsplit) * mg.shared_stride +
             int64_t(jj) * Hq + head;
    };
    QT* o = static_cast<QT*>(P.out) + (token * Hq + head) * Dv;
    float* lse_out = P.lse != nullptr ? P.lse + token * Hq + head : nullptr;
    float mx = kNegInf;
    bool bad = false;
    for (int p = 0; p < nparts; ++p) {
      const float x = lse[part_row(p)];
      bad |= x != x;
      mx = std::max(mx, x);
    }
    // The sink joins the denominator once, here (the parts' partials have none).
    const float sk = P.sinks != nullptr ? P.sinks[head] * kLog2e : kNegInf;
    if (bad || sk != sk) {  // a NaN part or a NaN sink: a NaN row (the rule of finish_row)
      fill_nan(o, Dv);
      if (lse_out != nullptr) *lse_out = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    std::fill(tmp, tmp + Dv, 0.0f);
    float wsum = 0.0f;
    mx = std::max(mx, sk);
    float lse2 = mx;  // +inf (a +inf sink: the row is 0) or -inf (no key, no sink)
    if (sk == -kNegInf) mx = kNegInf;
    if (mx != kNegInf) {
      if (P.sinks != nullptr) wsum = std::exp2(sk - mx);
      for (int p = 0; p < nparts; ++p) {
        const int64_t row = part_row(p);
        const float w = std::exp2(lse[row] - mx);  // 0 for a part that saw no key
        if (w == 0.0f) continue;
        wsum += w;
        const float* src = P.scratch + row * Dv;
        for (int c = 0; c < Dv; ++c) tmp[c] += w * src[c];
      }
      if (wsum > 0.0f) lse2 = mx + std::log2(wsum);
    }
    const float inv = wsum > 0.0f ? 1.0f / wsum : 0.0f;
    store_row(o, tmp, inv, Dv);
    if (lse_out != nullptr) *lse_out = lse2 * kLn2;
  }
  return 0;
}

// The many-row path (rows_path.h) for items with at least rows_min rows per kv head
// (kernels.h: 16 on avx512bf16, avx512 and avx2, 32 on generic, measured in
// bench/native_notes.md);
// decode-shaped items (few rows per kv head: one query token) keep the kernels below,
// whose score tiles are fed by several kv heads at once. MLA: rows_min_mla (its 16 heads
// share each latent row, so even decode is many rows).
static inline bool rows_path_applies(const NaProblem& P, const NaItem& it) {
  if (P.head_dim % W != 0 || P.v_head_dim % W != 0) return false;
  const int rows = (it.h1 - it.h0) * (it.q1 - it.q0);
  return rows >= (P.kind == NA_MLA ? rows_min_mla(P.kv_dtype, P.q_dtype)
                                   : rows_min(P.kv_dtype, P.q_dtype));
}

template <typename QT>
static int rows_q(const NaProblem* p, const NaItem* it) {
  switch (p->kv_dtype) {
    case NA_BF16: return rows_item<QT, uint16_t>(*p, *it);
    case NA_F16: return rows_item<QT, f16>(*p, *it);
    case NA_E4M3: return rows_item<QT, e4m3>(*p, *it);
    case NA_E5M2: return rows_item<QT, e5m2>(*p, *it);
    default: return rows_item<QT, float>(*p, *it);
  }
}

template <typename QT>
static int item_q(const NaProblem* p, const NaItem* it) {
  if (rows_path_applies(*p, *it)) return rows_q<QT>(p, it);
  if (p->head_dim % W == 0 && p->v_head_dim % W == 0) {
    switch (p->kv_dtype) {
      case NA_BF16: return fused_item<QT, uint16_t>(*p, *it);
      case NA_F16: return fused_item<QT, f16>(*p, *it);
      case NA_E4M3: return fused_item<QT, e4m3>(*p, *it);
      case NA_E5M2: return fused_item<QT, e5m2>(*p, *it);
      default: return fused_item<QT, float>(*p, *it);
    }
  }
  switch (p->kv_dtype) {
    case NA_BF16: return item_impl<QT, uint16_t>(*p, *it);
    case NA_F16: return item_impl<QT, f16>(*p, *it);
    case NA_E4M3: return item_impl<QT, e4m3>(*p, *it);
    case NA_E5M2: return item_impl<QT, e5m2>(*p, *it);
    default: return item_impl<QT, float>(*p, *it);
  }
}

#ifdef NA_HAVE_BF16_PATH
// The vdpbf16ps many-row kernel (rows_item_bf16): bf16 q over a bf16 or FP8 cache; fp16 /
// fp32 caches take the fp32 many-row kernel (item_q).
static inline bool bf16_rows_applies(const NaProblem& P, const NaItem& it) {
  return bf16_tile_dtypes(P.kv_dtype, P.q_dtype) && P.head_dim % 32 == 0 &&
         P.v_head_dim % 32 == 0 && rows_path_applies(P, it);
}
#endif

static int item_one(const NaProblem* p, const NaItem* it) {
#ifdef NA_HAVE_BF16_PATH
  if (bf16_rows_applies(*p, *it)) {
    switch (p->kv_dtype) {
      case NA_E4M3: return rows_item_bf16<e4m3>(*p, *it);
      case NA_E5M2: return rows_item_bf16<e5m2>(*p, *it);
      default: return rows_item_bf16<uint16_t>(*p, *it);
    }
  }
  if (p->q_dtype == NA_BF16 && p->kv_dtype == NA_BF16 && bf16_path_applies(*p, *it)) {
    return bf16_item(*p, *it);
  }
  if (p->q_dtype == NA_BF16 && fp8_path_applies(*p)) {
    return p->kv_dtype == NA_E4M3 ? bf16_item<e4m3>(*p, *it) : bf16_item<e5m2>(*p, *it);
  }
#endif
  switch (p->q_dtype) {
    case NA_BF16: return item_q<uint16_t>(p, it);
    case NA_F16: return item_q<f16>(p, it);
    default: return item_q<float>(p, it);
  }
}

// A cascade tile of more than kMaxRows rows per kv head (up to kMaxCascadeRows, the
// planner's bound) runs whole on the vdpbf16ps many-row kernel with a bf16 or FP8 cache (four
// row vectors: each block's K rows packed and V pairs interleaved once for all of them); on
// every other kernel (and in the amx unit, whose tiles hold 32 rows) as consecutive tiles of
// at most kMaxRows rows, the tiles the planner made before: a cascade tile's scratch rows are
// per token and head, so the same rows and the same results.
// A wide verify tile (kv heads x 16 or 32 rows, up to kMaxWideRows) runs whole on the many-row
// kernels (vdpbf16ps and fp32) and, on the decode kernels and in the amx unit, as tiles of at
// most kMaxRows rows, a few kv heads each: a split's partial rows are the tile's row r at
// slot + r, so the tile of its kv heads a.. writes from slot + a x its rows per kv head.
static int item(const NaProblem* p, const NaItem* it) {
  const int nh = it->h1 - it->h0;
  const int r1 = nh * (it->q1 - it->q0);
  const int nkv = it->kv_head_end - it->kv_head;
  if (!it->shared && nkv * r1 > na::kMaxRows) {
#ifndef NA_HAVE_AMX
    if (rows_path_applies(*p, *it)) return item_one(p, it);
#endif
    const int per = std::max(1, na::kMaxRows / r1);
    NaItem sub = *it;
    for (int a = 0; a < nkv; a += per) {
      sub.kv_head = it->kv_head + a;
      sub.kv_head_end = it->kv_head + std::min(nkv, a + per);
      if (it->slot >= 0) sub.slot = it->slot + a * r1;
      if (const int rc = item_one(p, &sub)) return rc;
    }
    return 0;
  }
  if (!it->shared || r1 <= na::kMaxRows) return item_one(p, it);
#if defined(NA_HAVE_BF16_PATH) && !defined(NA_HAVE_AMX)
  if (bf16_rows_applies(*p, *it)) return item_one(p, it);
#endif
  const int step = std::max(1, na::kMaxRows / nh);
  NaItem sub = *it;
  for (int q0 = it->q0; q0 < it->q1; q0 += step) {
    sub.q0 = q0;
    sub.q1 = std::min(it->q1, q0 + step);
    if (const int rc = item_one(p, &sub)) return rc;
  }
  return 0;
}

static int merge(const NaProblem* p, const NaMerge* m) {
  switch (p->q_dtype) {
    case NA_BF16: return merge_impl<uint16_t>(*p, *m);
    case NA_F16: return merge_impl<f16>(*p, *m);
    default: return merge_impl<float>(*p, *m);
  }
}

}  // namespace NA_NS

extern "C" {
extern const na::Kernels NA_TABLE;
const na::Kernels NA_TABLE = {NA_ISA_NAME, NA_NS::item, NA_NS::merge};
}

#endif  // NATIVE_ATTN_KERNELS_IMPL_H