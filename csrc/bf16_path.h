// AVX-512-BF16 path (kern_avx512bf16.cpp only, through kernels_impl.h; compiles alone with
// -mavx512bf16 and the AVX-512 flags):
// bf16 q with a bf16 or FP8 cache, head dims multiples of 32. K and V rows are used straight from
// the paged cache (no conversion pass): scores with vdpbf16ps on TR rows x 16 / TR keys tiles
// reduced 16 at a time, p . V with vdpbf16ps on pairs of keys (p rounded to bf16, as the
// output will be). On Zen 4 this halves the instruction count of the fp32 path, which is
// what bounds MLA decode (16 heads share every latent row).
#ifndef NATIVE_ATTN_BF16_PATH_H
#define NATIVE_ATTN_BF16_PATH_H
#if !defined(__AVX512BF16__) || !defined(__AVX512BW__)
#error "bf16_path.h needs -mavx512bf16 and the AVX-512 flags (it is the avx512bf16 unit's path)"
#endif
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "simd.h"
#include "tile.h"

// Blocks ahead the rows are prefetched. With the lines spread over the block's compute
// (PfCursor), one block ahead measured fastest here (2-thread GQA decode, B16 ctx 4096:
// 1 block 1.10x the time-per-call of 2 blocks, 1.15x of 3; bursts 4 ahead: 0.73x).
#ifndef NA_PF_AHEAD
#define NA_PF_AHEAD 1
#endif

namespace NA_NS {

static inline bool bf16_path_applies(const NaProblem& P, const NaItem&) {
  return P.head_dim % 32 == 0 && P.v_head_dim % 32 == 0;
}

// FP8 caches take this path too (bf16 q), the rows widened to bf16 exactly (both FP8
// formats fit in bf16; e4m3fn as 2^-8 x its value, like ld_fp8, see kF8Unit):
// - GQA/MHA: inside the tile loads (ld_bh): each K/V chunk of the block is converted once in
//   registers, as a score tile or a p.V chunk reads it; nothing is written back.
// - MLA: the block's first row of score tiles widens each latent row as it loads it, into a
//   per-thread buffer that the later tiles and p.V read like cache rows (16 heads read
//   every row 4 times in score tiles and twice in p.V: one conversion instead of six).
static inline bool fp8_path_applies(const NaProblem& P) {
  return (P.kv_dtype == NA_E4M3 || P.kv_dtype == NA_E5M2) && P.head_dim % 32 == 0 &&
         P.v_head_dim % 32 == 0;
}
static thread_local std::vector<uint16_t> tls_fp8_rows;

// FP8 -> bf16 bits of a magnitude (the byte without its sign), computed at compile time:
// the 128-entry tables of Fp8Lut. Subnormals are normalised (bf16 has fp32's exponent range,
// so every FP8 value is a normal bf16, never a denormal that vdpbf16ps would flush); e4m3fn
// S.1111.111 is NaN (0x7fc0, as fp8_to_f32 gives); e5m2 exponent 31 is inf / NaN with its
// mantissa kept (as fp8_to_f32 gives).
template <typename F8>
constexpr uint16_t fp8_mag_to_bf16(unsigned m) {
  constexpr bool e4 = std::is_same<F8, e4m3>::value;
  constexpr unsigned mbits = e4 ? 3 : 2, ebias = e4 ? 7 : 15;
  // e4m3fn loads as 2^-8 x its value on this unit (kF8Unit): the scales undo it.
  constexpr int unit_log2 = e4 ? 8 : 0;
  static_assert(!e4 || kF8Unit == 256.0f, "e4m3fn table assumes the 2^8 unit of ld_fp8");
  const unsigned e = m >> mbits, mant = m & ((1u << mbits) - 1);
  if (e4 && m == 0x7f) return 0x7fc0;
  if (!e4 && e == 31) return uint16_t(0x7f80 | (mant << (7 - mbits)));
  if (m == 0) return 0;
  int E = 0;          // unbiased exponent of the value
  unsigned frac = 0;  // its 7 fraction bits in bf16
  if (e != 0) {
    E = int(e) - int(ebias);
    frac = mant << (7 - mbits);
  } else {  // subnormal: mant x 2^(1 - bias - mbits), normalised
    int h = 0;
    while ((mant >> (h + 1)) != 0) ++h;
    E = h + 1 - int(ebias) - int(mbits);
    frac = (mant << (7 - h)) & 0x7fu;
  }
  E -= unit_log2;
  return uint16_t(unsigned(E + 127) << 7 | frac);
}
template <typename F8>
struct Fp8Table {
  alignas(64) uint16_t bits[128];
  constexpr Fp8Table() : bits() {
    for (unsigned m = 0; m < 128; ++m) bits[m] = fp8_mag_to_bf16<F8>(m);
  }
};
template <typename F8>
inline constexpr Fp8Table<F8> kFp8Table{};
static_assert(fp8_mag_to_bf16<e5m2>(0x3c) == 0x3f80, "e5m2 1.0");
static_assert(fp8_mag_to_bf16<e5m2>(0x01) == 0x3780, "e5m2 2^-16");
static_assert(fp8_mag_to_bf16<e5m2>(0x03) == 0x3840, "e5m2 1.5 x 2^-15");
static_assert(fp8_mag_to_bf16<e5m2>(0x7c) == 0x7f80, "e5m2 inf");
static_assert(fp8_mag_to_bf16<e4m3>(0x38) == 0x3b80, "e4m3 1.0 x 2^-8");
static_assert(fp8_mag_to_bf16<e4m3>(0x01) == 0x3700, "e4m3 2^-9 x 2^-8");
static_assert(fp8_mag_to_bf16<e4m3>(0x7e) == 0x3fe0, "e4m3 448 x 2^-8");

// The 128-entry magnitude table of one FP8 format in four zmm registers (loaded once per
// item, kept in registers through the tile loops). For bf16 rows: nothing.
template <typename RT>
struct Fp8Lut {
  explicit Fp8Lut() {}
};
template <typename F8>
struct Fp8LutF8 {
  __m512i t0, t1, t2, t3;
  Fp8LutF8()
      : t0(_mm512_load_si512(kFp8Table<F8>.bits)),
        t1(_mm512_load_si512(kFp8Table<F8>.bits + 32)),
        t2(_mm512_load_si512(kFp8Table<F8>.bits + 64)),
        t3(_mm512_load_si512(kFp8Table<F8>.bits + 96)) {}
};
template <>
struct Fp8Lut<e4m3> : Fp8LutF8<e4m3> {};
template <>
struct Fp8Lut<e5m2> : Fp8LutF8<e5m2> {};

// 32 cache elements as 32 bf16 lanes. bf16 rows: one load. FP8: the bytes sign-extended to
// words (the low 6 bits index a 64-entry half, bit 6 picks the half, bit 15 is the sign), two
// vpermt2w lookups, a blend on bit 6 and the sign ORed back: 6 ops, every code exact
// (subnormals, NaN, e5m2 inf), no branch.
static inline __m512i ld_bh(const uint16_t* p, const Fp8Lut<uint16_t>&) {
  return _mm512_loadu_si512(p);
}
template <typename F8>
static inline __m512i ld_bh(const F8* p, const Fp8LutF8<F8>& L) {
  const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  const __mmask32 upper = _mm512_test_epi16_mask(x, _mm512_set1_epi16(0x40));
  const __m512i lo = _mm512_permutex2var_epi16(L.t0, x, L.t1);
  const __m512i hi = _mm512_permutex2var_epi16(L.t2, x, L.t3);
  const __m512i mag = _mm512_mask_blend_epi16(upper, lo, hi);
  // mag | (x & 0x8000): imm 0xF8 = A | (B & C)
  return _mm512_ternarylogic_epi32(mag, x, _mm512_set1_epi16(short(0x8000)), 0xF8);
}

// The same magnitude tables split into the bf16 values' low and high bytes, for vpermi2b.
template <typename F8>
struct Fp8ByteTable {
  alignas(64) uint8_t lo[128], hi[128];
  constexpr Fp8ByteTable() : lo(), hi() {
    for (unsigned m = 0; m < 128; ++m) {
      lo[m] = uint8_t(kFp8Table<F8>.bits[m] & 0xff);
      hi[m] = uint8_t(kFp8Table<F8>.bits[m] >> 8);
    }
  }
};
template <typename F8>
inline constexpr Fp8ByteTable<F8> kFp8Bytes{};

// AVX-512 VBMI (Ice Lake and later, Zen 4 and 5; Cooper Lake has BF16 without it), read once;
// NATIVE_ATTN_NO_VBMI (set) turns its use off (tests of the fallback, comparisons).
static inline bool use_vbmi() {
  static const bool v =
      __builtin_cpu_supports("avx512vbmi") && std::getenv("NATIVE_ATTN_NO_VBMI") == nullptr;
  return v;
}

// 64 codes per step: a vpermb puts the bytes in the order the two byte unpacks below undo,
// two vpermi2b lookups (7-bit magnitude index into 128-byte tables) give each bf16's low and
// high byte, the sign is ORed into the high byte, and the unpacks interleave them into 2 x 32
// words: 7 ops per 64 values, against 2 x 6 for ld_bh's word lookups. Same tables: exact.
// unpacklo of 128-bit lane L takes bytes 16L..16L+7, unpackhi bytes 16L+8..16L+15: the vpermb
// index that puts codes 8L..8L+7 at the former and 32+8L..32+8L+7 at the latter.
struct VbmiOrder {
  alignas(64) uint8_t idx[64];
  constexpr VbmiOrder() : idx() {
    for (int L = 0; L < 4; ++L) {
      for (int j = 0; j < 8; ++j) {
        idx[16 * L + j] = uint8_t(8 * L + j);
        idx[16 * L + 8 + j] = uint8_t(32 + 8 * L + j);
      }
    }
  }
};
inline constexpr VbmiOrder kVbmiOrder{};

template <typename F8>
__attribute__((target("avx512vbmi"), noinline)) static void fp8_row_to_bf16_vbmi(uint16_t* dst,
                                                                                   const F8* src,
                                                                                   int n) {
  const __m512i lo0 = _mm512_load_si512(kFp8Bytes<F8>.lo);
  const __m512i lo1 = _mm512_load_si512(kFp8Bytes<F8>.lo + 64);
  const __m512i hi0 = _mm512_load_si512(kFp8Bytes<F8>.hi);
  const __m512i hi1 = _mm512_load_si512(kFp8Bytes<F8>.hi + 64);
  const __m512i perm = _mm512_load_si512(kVbmiOrder.idx);
  const __m512i sign = _mm512_set1_epi8(char(0x80));
  int c = 0;
  for (; c + 64 <= n; c += 64) {
    const __m512i x = _mm512_permutexvar_epi8(perm, _mm512_loadu_si512(src + c));
    const __m512i lo = _mm512_permutex2var_epi8(lo0, x, lo1);
    // hi | (x & 0x80): imm 0xF8 = A | (B & C)
    const __m512i hi = _mm512_ternarylogic_epi32(_mm512_permutex2var_epi8(hi0, x, hi1), x, sign,
                                                 0xF8);
    _mm512_storeu_si512(dst + c, _mm512_unpacklo_epi8(lo, hi));
    _mm512_storeu_si512(dst + c + 32, _mm512_unpackhi_epi8(lo, hi));
  }
  if (c < n) {  // n is a multiple of 32: one more half step
    const Fp8Lut<F8> L;
    _mm512_storeu_si512(dst + c, ld_bh(src + c, L));
  }
}

// A whole row (n a multiple of 32) widened to bf16 into dst: the many-row path's block
// buffers (rows_path.h).
template <typename F8>
static inline void fp8_row_to_bf16(uint16_t* dst, const F8* src, int n) {
  if (use_vbmi()) return fp8_row_to_bf16_vbmi(dst, src, n);
  const Fp8Lut<F8> L;
  for (int c = 0; c < n; c += 32) {
    _mm512_storeu_si512(dst + c, ld_bh(src + c, L));
  }
}

// reduce16's lane indices: level L merges vectors holding 16/w groups of w lanes (w = 16 >> L)
// into ones holding 32/w groups of w/2 lanes; lane j takes (first half + second half, the
// latter at +half: hi = 1) of its source group, from x (< 16) or y (>= 16).
constexpr int reduce16_lane(int level, int j, int hi) {
  const int w = 16 >> level, k = 16 / w, half = w / 2, g = j / half;
  return (g < k ? 0 : 16) + (g % k) * w + j % half + hi * half;
}
struct Reduce16Lanes {
  int32_t a[4][16], b[4][16];
};
constexpr Reduce16Lanes reduce16_lanes() {
  Reduce16Lanes t{};
  for (int level = 0; level < 4; ++level) {
    for (int j = 0; j < 16; ++j) {
      t.a[level][j] = reduce16_lane(level, j, 0);
      t.b[level][j] = reduce16_lane(level, j, 1);
    }
  }
  return t;
}
alignas(64) static constexpr Reduce16Lanes kReduce16 = reduce16_lanes();
static_assert(kReduce16.a[0][8] == 16 && kReduce16.b[3][15] == 31, "reduce16 lanes");
template <int L>
__attribute__((always_inline)) static inline void reduce16_level(__m512* v) {
  const __m512i ia = _mm512_load_si512(kReduce16.a[L]);
  const __m512i ib = _mm512_load_si512(kReduce16.b[L]);
  for (int i = 0; i < (8 >> L); ++i) {
    const __m512 x = v[2 * i], y = v[2 * i + 1];
    v[i] = _mm512_add_ps(_mm512_permutex2var_ps(x, ia, y), _mm512_permutex2var_ps(x, ib, y));
  }
}

// Lane i of the result is the sum of the lanes of v[i]. Indices are compile-time constants
// and every loop has a constant count, so a caller's v[16] stays in registers. (Built once
// into a function-local static, the indices cost a guard check per call, and the score
// tiles' 16 accumulators went through the stack: a reload after the tile loop held ~9% of
// the tiny-shape decode's samples.)
__attribute__((always_inline)) static inline __m512 reduce16(__m512* v) {
  reduce16_level<0>(v);
  reduce16_level<1>(v);
  reduce16_level<2>(v);
  reduce16_level<3>(v);
  return v[0];
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// acc[r] (NR rows, permuted lane order, see bf16_item) += p[r] . V over npairs key pairs.
// Row i's weight pair tp is pb[i * rs + tp * ts] (rs = BK / 2, ts = 1 in bf16_item; the
// many-row path keeps them transposed: rs = 1, ts = its lane count).
// pv_rows_bf16 and pv_dispatch always inlined: left to GCC's unit-growth limits, the decode
// kernel's call went out of line (to a copy for any rs and ts) as soon as the many-row kernel
// grew (measured with its packed-K and interleaved-V variants, Round 4).
template <int NR, typename RT = uint16_t, typename PF = PfCursor>
__attribute__((always_inline)) static inline void pv_rows_bf16(
    float* acc, int Dv, const uint32_t* pb, size_t rs, size_t ts, const float* alpha,
    const RT* const* vp, int npairs, PF& pf, const Fp8Lut<RT>& lut = Fp8Lut<RT>()) {
  for (int c = 0; c < Dv; c += 32) {
    pf.step();
    __m512 lo[NR], hi[NR];
    for (int i = 0; i < NR; ++i) {
      const __m512 a = _mm512_set1_ps(alpha[i]);
      lo[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + size_t(i) * Dv + c), a);
      hi[i] = _mm512_mul_ps(_mm512_loadu_ps(acc + size_t(i) * Dv + c + 16), a);
    }
    for (int tp = 0; tp < npairs; ++tp) {
      const __m512i va = ld_bh(vp[2 * tp] + c, lut);
      const __m512i vb = ld_bh(vp[2 * tp + 1] + c, lut);
      const __m512bh vlo = as_bh(_mm512_unpacklo_epi16(va, vb));
      const __m512bh vhi = as_bh(_mm512_unpackhi_epi16(va, vb));
      for (int i = 0; i < NR; ++i) {
        const __m512bh pp = as_bh(_mm512_set1_epi32(int(pb[size_t(i) * rs + size_t(tp) * ts])));
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

template <typename RT = uint16_t, typename PF = PfCursor>
__attribute__((always_inline)) static inline void pv_dispatch(
    int nr, float* acc, int Dv, const uint32_t* pb, size_t rs, size_t ts, const float* alpha,
    const RT* const* vp, int npairs, PF& pf, const Fp8Lut<RT>& lut = Fp8Lut<RT>()) {
  switch (nr) {
    case 8: pv_rows_bf16<8, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
    case 7: pv_rows_bf16<7, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
    case 6: pv_rows_bf16<6, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
    case 5: pv_rows_bf16<5, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
    case 4: pv_rows_bf16<4, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
    case 3: pv_rows_bf16<3, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
    case 2: pv_rows_bf16<2, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
    default: pv_rows_bf16<1, RT, PF>(acc, Dv, pb, rs, ts, alpha, vp, npairs, pf, lut); break;
  }
}

// Undo the lane order of the pair accumulation (pv_rows_bf16) into row: in each 32-column
// chunk, lane j of the first 16 holds column (j / 4) * 8 + j % 4 and lane j of the second 16
// that plus 4.
static inline const float* unpermute_row(float* row, const float* ar, int Dv) {
  const __m512i un0 = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i un1 =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int c = 0; c < Dv; c += 32) {
    const __m512 lo = _mm512_loadu_ps(ar + c), hi = _mm512_loadu_ps(ar + c + 16);
    _mm512_storeu_ps(row + c, _mm512_permutex2var_ps(lo, un0, hi));
    _mm512_storeu_ps(row + c + 16, _mm512_permutex2var_ps(lo, un1, hi));
  }
  return row;
}

// The rows of a decode score tile for R1 rows per kv head (see bf16_item_impl).
static inline int decode_tile_rows(int R1) {
  if (R1 == 1) return 1;
  return R1 % 4 == 2 ? 2 : 4;
}

// The block's scores of one kv head's rows: TR-row x TK-key tiles, each 16 vdpbf16ps sums
// reduced at once (reduce16), scaled by qscale into Sg (row r at Sg + r * BK). qg holds Rp1
// bf16 rows of q (rows past R1 are 0), kp[t] the block's key rows (nt <= BK of them, those
// past the block's end a real row whose scores are dropped later). FP8 MLA (convert): the
// first row tile widens each key row into f8rows as it loads it, for the later tiles and p.V.
template <int TR, typename KT, typename RT, typename PF>
__attribute__((always_inline)) static inline void score_tiles(
    const uint16_t* qg, int D, int Rp1, int R1, int nt, const RT* const* kp, bool widen,
    const KT* const* kcur, uint16_t* f8rows, const Fp8Lut<RT>& lut, const Fp8Lut<KT>& lut8,
    float qscale, float* Sg, PF& pf) {
  constexpr int TK = 16 / TR;
  for (int r0 = 0; r0 < Rp1; r0 += TR) {
    for (int t0 = 0; t0 < nt; t0 += TK) {
      __m512 a[16];
      for (int i = 0; i < 16; ++i) a[i] = _mm512_setzero_ps();
      const bool convert = widen && r0 == 0;
      for (int c = 0; c < D; c += 32) {
        pf.step();
        __m512bh qv[TR];
        for (int i = 0; i < TR; ++i) {
          qv[i] = as_bh(_mm512_loadu_si512(qg + size_t(r0 + i) * D + c));
        }
        // One key row at a time, used by every row of the tile (16 accumulators, TR q
        // vectors and one key vector stay in registers for any TR).
        for (int j = 0; j < TK; ++j) {
          __m512i kx;
          if (convert) {
            kx = ld_bh(kcur[t0 + j] + c, lut8);
            _mm512_storeu_si512(f8rows + size_t(t0 + j) * D + c, kx);
          } else {
            kx = ld_bh(kp[t0 + j] + c, lut);
          }
          for (int i = 0; i < TR; ++i) {
            a[TK * i + j] = _mm512_dpbf16_ps(a[TK * i + j], qv[i], as_bh(kx));
          }
        }
      }
      alignas(64) float s16[16];
      _mm512_store_ps(s16, _mm512_mul_ps(reduce16(a), _mm512_set1_ps(qscale)));
      for (int i = 0; i < TR && r0 + i < R1; ++i) {
        std::memcpy(Sg + size_t(r0 + i) * BK + t0, s16 + TK * i, TK * sizeof(float));
      }
    }
  }
}

// KT: the cache's element type; RT: what the tiles read, the cache rows themselves (bf16, or
// FP8 widened inside the loads) or, when they differ (FP8 MLA), the bf16 double buffer.
template <typename KT, typename RT>
static int bf16_item_impl(const NaProblem& P, const NaItem& it) {
  constexpr bool widen = !std::is_same<KT, RT>::value;  // FP8 MLA: rows widened per block
  const Fp8Lut<RT> lut;   // the tiles' loads
  const Fp8Lut<KT> lut8;  // FP8 MLA: the cache rows' (widened into the buffer)
  const Tile T(P, it);
  const int D = T.D, Dv = T.Dv, R1 = T.R1, nkv = T.nkv, R = T.R;
  // Score tiles are TR rows x 16 / TR keys (16 sums, one reduce16): 4 x 4 where the rows
  // per kv head are a multiple of 4; 2 x 8 (GQA groups of 2, 6, ...) and 1 x 16 (MHA decode),
  // where 4-row tiles were half or three quarters padding. Padded rows have q = 0.
  const int TR = decode_tile_rows(R1);
  const int Rp1 = (R1 + TR - 1) / TR * TR;
  const int Rp = nkv * Rp1;
  Buffers& B = tls_buffers;
  // q as bf16 (Rp x D / 2 floats of room), scores, bf16 weights (R x BK / 2 floats).
  if (!B.ensure(Rp, D / 2 + W, Dv)) return -2;
  try {
    if (B.v.size() < size_t(R) * (BK / 2) + W) B.v.resize(size_t(R) * (BK / 2) + W);
    if (B.k.size() < size_t(Dv)) B.k.resize(size_t(Dv));
    if (widen && tls_fp8_rows.size() < size_t(BK) * D) tls_fp8_rows.resize(size_t(BK) * D);
  } catch (const std::bad_alloc&) {
    return -2;
  }
  uint16_t* qb = reinterpret_cast<uint16_t*>(B.q.data());
  float* Sc = B.s.data();
  float* acc = B.acc.data();
  float* m = B.m.data();
  float* l = B.l.data();
  uint32_t* pb = reinterpret_cast<uint32_t*>(B.v.data());
  RowState S;
  float* alpha = S.alpha;
  int* lim = S.lim;
  bool* bad = S.bad;
  const uint8_t** mrow = S.mrow;
  const float qscale = P.sm_scale * kLog2e * P.k_scale * f8_unit(P);
  // The shared row prologue; q stays bf16 (vdpbf16ps reads it), the scale applies to scores.
  for (int gi = 0; gi < nkv; ++gi) {
    for (int lr = 0; lr < Rp1; ++lr) {
      uint16_t* qr = qb + size_t(gi * Rp1 + lr) * D;
      if (lr >= R1) {
        std::memset(qr, 0, sizeof(uint16_t) * size_t(D));
        continue;
      }
      const int r = gi * R1 + lr;
      const uint16_t* qrow = start_row<uint16_t>(P, it, T, r, S, m, l, acc + size_t(r) * Dv, Dv);
      std::memcpy(qr, qrow, sizeof(uint16_t) * size_t(D));
    }
  }
  const bool mla = T.mla;
  const KT* kbase = static_cast<const KT*>(P.k);
  const KT* vbase = static_cast<const KT*>(mla ? P.k : P.v);
  uint16_t* f8rows = widen ? tls_fp8_rows.data() : nullptr;
  const int64_t kstride = T.kstride(), vstride = T.vstride();  // elements between tokens
  const RT* kp0[BK];
  const RT* vp0[BK];
  const RT* kp[BK];
  const RT* vp[BK];
  const RT* kpn[BK];
  const RT* vpn[BK];
  const KT* kraw[BK];  // FP8 MLA: the next block's latent rows in the cache
  const KT* kcur[BK];  // and this block's
  int nn = 0;          // tokens in the next block
  auto next_block = [&](int k0) {
    nn = std::max(0, std::min(BK, it.k1 - k0));
    if constexpr (widen) {  // MLA only: one latent row serves as K and V
      block_rows(T, k0, nn, kbase, kbase, kstride, kstride, kraw, kraw);
    } else {
      block_rows(T, k0, nn, kbase, vbase, kstride, vstride, kpn, vpn);
    }
  };
  next_block(it.k0);
  // Prefetch the tile's kv heads of each token only (a tile of 2 of 8 kv heads used to
  // queue the whole row: 4x the lines it reads).
  const KT* kpf = kbase + (mla ? 0 : int64_t(it.kv_head) * D);
  const KT* vpf = vbase + (mla ? 0 : int64_t(it.kv_head) * Dv);
  const int klines = int(((mla ? kstride : int64_t(T.nkv) * D) * int64_t(sizeof(KT)) + 63) / 64);
  const int vlines = mla ? 0 : int((int64_t(T.nkv) * Dv * int64_t(sizeof(KT)) + 63) / 64);
  // FP8 rows are half the bytes, yet 2 blocks ahead measured no faster for them (0.67-0.75x
  // bf16's time against 0.63-0.71x at 1 block, GQA decode, 1 thread).
  constexpr int pf_ahead = NA_PF_AHEAD;
  // The first blocks, which the in-loop prefetch (pf_ahead blocks ahead) never covers: at
  // once, as nothing else can run before them.
  PfCursor pf;
  pf.set_lean(P.lean_prefetch != 0);
  pf.queue_rows(T, it.k0, std::min(it.k1, it.k0 + pf_ahead * BK), kpf, vpf, kstride,
                vstride, klines, vlines);
  pf.flush();
  for (int k0 = it.k0; k0 < it.k1; k0 += BK) {
    const int n = std::min(BK, it.k1 - k0);
    if constexpr (widen) {
      // This block's rows, prefetched during the last block's compute, are widened by its
      // first row of score tiles, as it loads them, into buffer row t (padded keys: the first
      // key's row again); the later tiles and p.V read the buffer. (Widened a block ahead,
      // before its prefetch, every line stalled: 1.27x bf16's time; in a pass of its own at
      // the block's start, 1.08-1.18x.)
      for (int t = 0; t < BK; ++t) {
        kcur[t] = kraw[t < n ? t : 0];
        kpn[t] = vpn[t] = f8rows + size_t(t) * D;
      }
    }
    for (int t = 0; t < BK; ++t) {
      // Keys past the block's end reuse the first key's row (valid memory); their scores
      // are masked below, so their weights are exactly 0.
      kp0[t] = kpn[t < n ? t : 0];
      vp0[t] = vpn[t < n ? t : 0];
    }
    next_block(k0 + BK);
    const int TK = 16 / TR;
    const int nt = (n + TK - 1) / TK * TK;  // <= BK: keys past n reuse the first key's row
    // Rows to prefetch: NA_PF_AHEAD blocks ahead, the tile's heads of each token in address order,
    // issued a few lines per compute step (score tile, value chunk) over this block.
    {
      const int ka = k0 + pf_ahead * BK;
      pf.queue_rows(T, ka, std::min(it.k1, ka + BK), kpf, vpf, kstride, vstride, klines,
                    vlines);
      const int calls = nkv * ((Rp1 / TR) * (nt / TK) * (D / 32) + ((R1 + 7) / 8) * (Dv / 32));
      pf.plan(calls);
    }
    // kv heads innermost: the block's tokens are read whole (every head), in address order.
    for (int gi = 0; gi < nkv; ++gi) {
      const int64_t koff = mla ? 0 : int64_t(it.kv_head + gi) * D;
      const int64_t voff = mla ? 0 : int64_t(it.kv_head + gi) * Dv;
      for (int t = 0; t < BK; ++t) {
        kp[t] = kp0[t] + koff;
        vp[t] = vp0[t] + voff;
      }
      const uint16_t* qg = qb + size_t(gi * Rp1) * D;
      float* Sg = Sc + size_t(gi * R1) * BK;
      switch (TR) {
        case 1:
          score_tiles<1>(qg, D, Rp1, R1, nt, kp, widen, kcur, f8rows, lut, lut8, qscale, Sg, pf);
          break;
        case 2:
          score_tiles<2>(qg, D, Rp1, R1, nt, kp, widen, kcur, f8rows, lut, lut8, qscale, Sg, pf);
          break;
        default:
          score_tiles<4>(qg, D, Rp1, R1, nt, kp, widen, kcur, f8rows, lut, lut8, qscale, Sg, pf);
          break;
      }
      for (int r = gi * R1; r < (gi + 1) * R1; ++r) {
        float* sr = Sc + size_t(r) * BK;
        if (post_scores(P, sr, n, k0, lim[r], mrow[r])) bad[r] = true;
        const __m512 s0 = _mm512_loadu_ps(sr), s1 = _mm512_loadu_ps(sr + 16);
        const float bm = _mm512_reduce_max_ps(_mm512_max_ps(s0, s1));
        const float mn = std::max(m[r], bm);
        uint32_t* pr = pb + size_t(r) * (BK / 2);
        if (mn == kNegInf) {  // every key so far masked for this row
          std::memset(pr, 0, sizeof(uint32_t) * (BK / 2));
          alpha[r] = 1.0f;
          continue;
        }
        alpha[r] = std::exp2(m[r] - mn);
        const __m512 p0 = vexp2(s0 - mn), p1 = vexp2(s1 - mn);
        const __m512i pbh = (__m512i)_mm512_cvtne2ps_pbh(p1, p0);
        _mm512_storeu_si512(pr, pbh);
        // The normaliser sums the rounded weights that the accumulation uses.
        const __m512 w0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm512_castsi512_si256(pbh)), 16));
        const __m512 w1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
            _mm512_extracti64x4_epi64(pbh, 1)), 16));
        l[r] = l[r] * alpha[r] + _mm512_reduce_add_ps(_mm512_add_ps(w0, w1));
        m[r] = mn;
      }
      guard_values<RT>(P, lim, mrow, bad, gi * R1, (gi + 1) * R1, k0, n, vp, Dv);
      // An odd block's last pair reads one key past the block (weight 0): a zero row, so a
      // non-finite value there cannot reach any row.
      if (n % 2) vp[n] = zero_row<RT>();
      const int npairs = (n + 1) / 2;
      for (int r0 = gi * R1; r0 < (gi + 1) * R1; r0 += 8) {
        const int nr = std::min(8, (gi + 1) * R1 - r0);
        pv_dispatch<RT>(nr, acc + size_t(r0) * Dv, Dv, pb + size_t(r0) * (BK / 2), BK / 2, 1,
                        alpha + r0, vp, npairs, pf, lut);
      }
    }
  }
  finish_rows<uint16_t>(P, it, T, m, l, S, [&](int r) {
    return unpermute_row(B.k.data(), acc + size_t(r) * Dv, Dv);  // B.k: >= Dv floats
  });
  return 0;
}

// bf16 q with a bf16 or FP8 cache (head dims multiples of 32).
template <typename KT = uint16_t>
static int bf16_item(const NaProblem& P, const NaItem& it) {
  if constexpr (std::is_same<KT, uint16_t>::value) {
    return bf16_item_impl<KT, KT>(P, it);
  } else {
    return P.kind == NA_MLA ? bf16_item_impl<KT, uint16_t>(P, it) : bf16_item_impl<KT, KT>(P, it);
  }
}

}  // namespace NA_NS

#endif  // NATIVE_ATTN_BF16_PATH_H
