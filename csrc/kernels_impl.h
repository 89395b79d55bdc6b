// Kernel bodies, compiled once per instruction set: each kern_<isa>.cpp defines NA_NS and
// NA_TABLE and includes this file with its own -m flags. The code uses GCC/Clang vector
// extensions (16 floats), which the compiler lowers to zmm, ymm pairs, xmm quads or NEON
// depending on the flags of the including translation unit: one source, portable, with
// the fast paths chosen at run time by native_attn.cpp.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "kernels.h"

namespace NA_NS {

// Vector width in floats: 16 for AVX-512, 8 for AVX2, 4 for the portable build (SSE2 on
// x86-64, NEON on aarch64). Wider-than-native vectors would be split by the compiler into
// slow sequences, so each translation unit uses its own native width.
#ifndef NA_W
#define NA_W 16
#endif
constexpr int W = NA_W;
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint32_t vu __attribute__((vector_size(W * 4)));
typedef uint16_t vh __attribute__((vector_size(W * 2)));
typedef float vf4 __attribute__((vector_size(16)));
constexpr int BK = na::kBlockKeys;
static_assert(BK % W == 0, "a key block is a whole number of vectors");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kLog2e = 1.4426950408889634f;

static inline vf ld(const float* p) {
  vf v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
static inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof v); }
static inline vf splat(float x) { return vf{} + x; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// bf16 -> fp32 is a 16-bit left shift of the bit pattern: done in registers.
static inline vf ld_bf16(const uint16_t* p) {
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu w = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &w, sizeof f);
  return f;
}
// fp16 -> fp32: F16C's vcvtph2ps where the unit has it, else the compiler's conversion.
typedef _Float16 f16;
static inline vf ld_f16(const f16* p) {
#if defined(__AVX512F__) && NA_W == 16
  return (vf)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__F16C__) && NA_W == 8
  return (vf)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  vf f;
  for (int i = 0; i < W; ++i) f[i] = float(p[i]);
  return f;
#endif
}
// FP8 caches: distinct one-byte types so the kernels' templates tell the formats apart.
enum class e4m3 : uint8_t {};
enum class e5m2 : uint8_t {};
typedef uint8_t vb8 __attribute__((vector_size(W)));
static inline vf as_vf(vu u) {
  vf f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// FP8 -> fp32 in registers: bytes widened to 32-bit lanes, the exponent rebiased with one
// add, subnormals (exponent 0) through an int -> float convert and a power-of-two scale
// (never a denormal float, so FTZ/DAZ modes cannot change them), the specials selected.
// e4m3fn: bias 7, no inf, S.1111.111 is NaN. e5m2: bias 15, IEEE inf/NaN (exponent 31).
static inline vf fp8_to_f32(vu b, e4m3) {
  const vu u = b & 0x7fu;
  const vu sign = (b & 0x80u) << 24;
  const vu normal = (u << 20) + (120u << 23);
  const vf sub = __builtin_convertvector((vi)(u & 7u), vf) * 0x1p-9f;
  const vu is_sub = (vu)((u >> 3) == 0u);
  const vu is_nan = (vu)(u == 0x7fu);
  vu bits;
  std::memcpy(&bits, &sub, sizeof bits);
  bits = (is_sub & bits) | (~is_sub & normal);
  bits = (is_nan & 0x7fc00000u) | (~is_nan & bits);
  return as_vf(bits | sign);
}
static inline vf fp8_to_f32(vu b, e5m2) {
  const vu u = b & 0x7fu;
  const vu sign = (b & 0x80u) << 24;
  const vu normal = (u << 21) + (112u << 23);
  const vf sub = __builtin_convertvector((vi)(u & 3u), vf) * 0x1p-16f;
  const vu is_sub = (vu)((u >> 2) == 0u);
  const vu is_special = (vu)((u >> 2) == 31u);
  const vu special = 0x7f800000u | ((u & 3u) << 21);
  vu bits;
  std::memcpy(&bits, &sub, sizeof bits);
  bits = (is_sub & bits) | (~is_sub & normal);
  bits = (is_special & special) | (~is_special & bits);
  return as_vf(bits | sign);
}
#if (defined(__AVX512F__) && NA_W == 16) || (defined(__F16C__) && NA_W == 8)
// With F16C the conversion goes through fp16, whose vcvtph2ps widens subnormals exactly:
// e5m2 is the top byte of an fp16; e4m3fn sign-extended and shifted by 7 is an fp16 with the
// exponent bias 8 too high (bit 14, a copy of the sign, cleared), undone by one multiply.
// 3 (e5m2) / 8 (e4m3fn) integer ops per vector instead of the 12 of the portable form.
#if NA_W == 16
typedef __m256i hvec;
static inline hvec load_bytes_u16(const void* p, bool sign_extend) {
  const __m128i b = _mm_loadu_si128(static_cast<const __m128i*>(p));
  return sign_extend ? _mm256_cvtepi8_epi16(b) : _mm256_cvtepu8_epi16(b);
}
static inline vf half_to_f32(hvec h) { return (vf)_mm512_cvtph_ps(h); }
static inline hvec h_or(hvec a, hvec b) { return _mm256_or_si256(a, b); }
static inline hvec h_and(hvec a, hvec b) { return _mm256_and_si256(a, b); }
#define NA_H(op) _mm256_##op
#else
typedef __m128i hvec;
static inline hvec load_bytes_u16(const void* p, bool sign_extend) {
  const __m128i b = _mm_loadl_epi64(static_cast<const __m128i*>(p));
  return sign_extend ? _mm_cvtepi8_epi16(b) : _mm_cvtepu8_epi16(b);
}
static inline vf half_to_f32(hvec h) { return (vf)_mm256_cvtph_ps(h); }
static inline hvec h_or(hvec a, hvec b) { return _mm_or_si128(a, b); }
static inline hvec h_and(hvec a, hvec b) { return _mm_and_si128(a, b); }
#define NA_H(op) _mm_##op
#endif
static inline vf ld_fp8(const e5m2* p) {
  return half_to_f32(NA_H(slli_epi16)(load_bytes_u16(p, false), 8));
}
static inline vf ld_fp8(const e4m3* p) {
  hvec h = NA_H(slli_epi16)(load_bytes_u16(p, true), 7);
  h = h_and(h, NA_H(set1_epi16)(short(0xbfff)));  // bit 14: a copy of the sign
  // S.1111.111 (NaN, either sign): 0x3f80 | sign after the shift; all-ones is an fp16 NaN.
  const hvec nan = NA_H(cmpeq_epi16)(h_or(h, NA_H(set1_epi16)(short(0x8000))),
                                     NA_H(set1_epi16)(short(0xbf80)));
  h = h_or(h, nan);
  return half_to_f32(h);  // 2^-8 x the value: kF8Unit folds the 2^8 into the scales
}
constexpr float kF8Unit = 256.0f;
#undef NA_H
#else
template <typename F8>
static inline vf ld_fp8(const F8* p) {
  vb8 b;
  std::memcpy(&b, p, sizeof b);
  return fp8_to_f32(__builtin_convertvector(b, vu), F8{});
}
constexpr float kF8Unit = 1.0f;
#endif
// What an e4m3fn value loads as, times this, is its value (a power of two: exact); k_scale
// and v_scale absorb it once per call instead of a multiply per vector.
static inline float f8_unit(const NaProblem& P) {
  return P.kv_dtype == NA_E4M3 ? kF8Unit : 1.0f;
}
template <typename F8>
static inline float fp8_scalar(F8 x) {
  vu b = vu{} + uint32_t(uint8_t(x));
  const float f = fp8_to_f32(b, F8{})[0];
  return std::is_same<F8, e4m3>::value ? f * (1.0f / kF8Unit) : f;  // as ld_fp8 loads it
}

static inline float hsum(vf v) {
#if NA_W == 16
  typedef float vf8 __attribute__((vector_size(32)));
  vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
          __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
#elif NA_W == 8
  vf4 b = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#else
  vf4 b = v;
#endif
  return (b[0] + b[2]) + (b[1] + b[3]);
}
static inline float hmax(vf v) {
  float m = v[0];
  for (int i = 1; i < W; ++i) m = v[i] > m ? v[i] : m;
  return m;
}
// 2^x for x <= 0 (softmax weights): round-to-nearest range reduction, degree-7 Taylor
// polynomial on [-0.5, 0.5] (error ~5e-9 relative), exponent added in the bits.
// Inputs below -125 (including -inf of masked keys) give exactly 0.
static inline vf vexp2(vf x) {
  vi under = x < -125.0f;
  x = x < -125.0f ? splat(-125.0f) : x;
  x = x > 125.0f ? splat(125.0f) : x;
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

static inline float bf2f(uint16_t h) {
  uint32_t u = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static inline uint16_t f2bf(float f) {  // round to nearest even, NaN stays NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}
static inline int round_up(int x, int m) { return (x + m - 1) / m * m; }

// Copy n elements as fp32 into dst and zero it up to np (a multiple of W).
static inline void load_row(float* dst, const float* src, int n, int np) {
  std::memcpy(dst, src, sizeof(float) * size_t(n));
  for (int i = n; i < np; ++i) dst[i] = 0.0f;
}
static inline void load_row(float* dst, const uint16_t* src, int n, int np) {
  int i = 0;
  for (; i + W <= n; i += W) st(dst + i, ld_bf16(src + i));
  for (; i < n; ++i) dst[i] = bf2f(src[i]);
  for (; i < np; ++i) dst[i] = 0.0f;
}
static inline void load_row(float* dst, const f16* src, int n, int np) {
  int i = 0;
  for (; i + W <= n; i += W) st(dst + i, ld_f16(src + i));
  for (; i < n; ++i) dst[i] = float(src[i]);
  for (; i < np; ++i) dst[i] = 0.0f;
}
template <typename F8, typename = std::enable_if_t<std::is_enum<F8>::value>>
static inline void load_row(float* dst, const F8* src, int n, int np) {
  int i = 0;
  for (; i + W <= n; i += W) st(dst + i, ld_fp8(src + i));
  for (; i < n; ++i) dst[i] = fp8_scalar(src[i]);
  for (; i < np; ++i) dst[i] = 0.0f;
}
static inline void store_row(f16* dst, const float* src, float s, int n) {
  for (int i = 0; i < n; ++i) dst[i] = f16(src[i] * s);
}
// A row whose query holds NaN or inf: its output is NaN (as the reference's softmax gives).
template <typename T>
static inline bool row_not_finite(const T* src, int n) {
  unsigned any = 0;
  for (int i = 0; i < n; ++i) {
    const float x = float(src[i]);
    any |= unsigned(!(x - x == 0.0f));
  }
  return any != 0;
}
static inline bool row_not_finite(const uint16_t* src, int n) {  // bf16 bit patterns
  unsigned any = 0;  // no early exit: the loop vectorises
  for (int i = 0; i < n; ++i) any |= unsigned((src[i] & 0x7f80u) == 0x7f80u);
  return any != 0;
}
static inline bool row_not_finite(const e4m3* src, int n) {  // S.1111.111 is NaN
  unsigned any = 0;
  for (int i = 0; i < n; ++i) any |= unsigned((uint8_t(src[i]) & 0x7fu) == 0x7fu);
  return any != 0;
}
static inline bool row_not_finite(const e5m2* src, int n) {  // exponent 31: inf or NaN
  unsigned any = 0;
  for (int i = 0; i < n; ++i) any |= unsigned((uint8_t(src[i]) & 0x7cu) == 0x7cu);
  return any != 0;
}
// A row of zeros in every element type (all-zero bits are +0 in each): what a key that some
// row of a tile may not see contributes in place of its value row when that row is not
// finite (p = 0 times NaN or inf would still be NaN).
alignas(64) static const unsigned char kZeroRow[size_t(na::kMaxHeadDim) * sizeof(float)] = {};
template <typename T>
static inline const T* zero_row() {
  return reinterpret_cast<const T*>(kZeroRow);
}
static inline void fill_nan(float* dst, int n) {
  std::fill(dst, dst + n, std::numeric_limits<float>::quiet_NaN());
}
static inline void fill_nan(uint16_t* dst, int n) { std::fill(dst, dst + n, uint16_t(0x7fc0)); }
static inline void fill_nan(f16* dst, int n) {
  std::fill(dst, dst + n, f16(std::numeric_limits<float>::quiet_NaN()));
}
static inline void store_row(float* dst, const float* src, float s, int n) {
  for (int i = 0; i < n; ++i) dst[i] = src[i] * s;
}
// Round to nearest even, NaN stays NaN: f2bf on W lanes at once (the scalar form is a branch
// per element, which cost ~0.4 us per 128-wide output row).
static inline void store_row(uint16_t* dst, const float* src, float s, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    const vf x = ld(src + i) * s;
    vu u;
    std::memcpy(&u, &x, sizeof u);
    const vu rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu nan = (vu)((u & 0x7fffffffu) > 0x7f800000u);
    const vu r = (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);
    const vh h = __builtin_convertvector(r, vh);
    std::memcpy(dst + i, &h, sizeof h);
  }
  for (; i < n; ++i) dst[i] = f2bf(src[i] * s);
}

// Per-thread buffers, grown on demand and kept for the life of the thread.
struct Buffers {
  std::vector<float> q, k, v, s, acc, m, l;
  void ensure(int rows, int dp, int dvp) {
    auto grow = [](std::vector<float>& b, size_t n) {
      if (b.size() < n) b.resize(n);
    };
    grow(q, size_t(rows) * dp);
    grow(k, size_t(BK) * dp);
    grow(v, size_t(BK) * dvp);
    grow(s, size_t(rows) * BK);
    grow(acc, size_t(rows) * dvp);
    grow(m, size_t(rows));
    grow(l, size_t(rows));
  }
};
static thread_local Buffers tls_buffers;

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

// Writes row r of a finished tile: the output (direct) or a partial result and its
// log2-sum-exp (split-KV, cascade). A NaN row stays NaN through the merge.
template <typename OT>
static inline void finish_row(const NaProblem& P, const NaItem& it, int r, int R1, int nh, int G,
                              const float* row, float inv, float m, float l, bool bad, OT* out) {
  const int Hq = P.num_q_heads, Dv = P.v_head_dim;
  const float vscale = P.v_scale * f8_unit(P);
  inv *= vscale;  // FP8: V's dequantisation factor, applied once per output row
  // A value row the row read held NaN or inf (invisible keys never reach acc: guard_values).
  bad = bad || row_not_finite(row, Dv);
  const int gi = r / R1, jj = (r % R1) / nh, hh = r % nh;
  const int head = (it.kv_head + gi) * G + it.h0 + hh;
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

// Soft-cap (s = cap * tanh(s / cap), here in log2 units) on W lanes: tanh from one exp2 of
// -2|x| (no overflow), the sign put back in the bits.
static inline vf vcap(vf s, float cap2) {
  const vf x = s * (1.0f / cap2);
  vu xb;
  std::memcpy(&xb, &x, sizeof xb);
  const vu sign = xb & 0x80000000u;
  const vf ax = as_vf(xb & 0x7fffffffu);
  const vf t = vexp2(ax * (-2.0f * kLog2e));
  const vf th = (1.0f - t) / (1.0f + t);
  vu tb;
  std::memcpy(&tb, &th, sizeof tb);
  return as_vf(tb | sign) * cap2;
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

#ifdef NA_HAVE_BF16_PATH
#include "bf16_path.h"
#endif

static inline vf ldk(const float* p) { return ld(p); }
static inline vf ldk(const uint16_t* p) { return ld_bf16(p); }
static inline vf ldk(const f16* p) { return ld_f16(p); }
static inline vf ldk(const e4m3* p) { return ld_fp8(p); }
static inline vf ldk(const e5m2* p) { return ld_fp8(p); }

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

// The prologue both item kernels share: each row's q (scaled into log2 units, where an FP8
// cache's k_scale also folds in), whether it holds a NaN/inf, its causal limit and mask row,
// and a fresh softmax state.
template <typename QT>
static void init_rows(const NaProblem& P, const NaItem& it, int R, int R1, int nh, int G, int Dp,
                      int Dvp, float* qb, float* m, float* l, float* acc, int* lim, bool* bad,
                      const uint8_t** mrow) {
  const int Hq = P.num_q_heads, D = P.head_dim;
  const float qscale = P.sm_scale * kLog2e * P.k_scale * f8_unit(P);
  const QT* qbase = static_cast<const QT*>(P.q);
  for (int r = 0; r < R; ++r) {
    const int gi = r / R1, jj = (r % R1) / nh, hh = r % nh;
    const RowSrc src = row_src(P, it, jj);
    const int qs = P.qo_indptr[src.req];
    const int q_len = P.qo_indptr[src.req + 1] - qs;
    const int kv_len = P.kv_lens[src.req];
    const int64_t token = qs + src.j;
    const int head = (it.kv_head + gi) * G + it.h0 + hh;
    float* qr = qb + size_t(r) * Dp;
    load_row(qr, qbase + (token * Hq + head) * D, D, Dp);
    bad[r] = row_not_finite(qbase + (token * Hq + head) * D, D);
    for (int c = 0; c < Dp; ++c) qr[c] *= qscale;
    lim[r] = P.noncausal ? kv_len - 1 : kv_len - q_len + src.j;
    mrow[r] = P.causal ? nullptr : P.mask + P.mask_indptr[src.req] + int64_t(src.j) * kv_len;
    m[r] = kNegInf;
    l[r] = 0.0f;
    std::memset(acc + size_t(r) * Dvp, 0, sizeof(float) * size_t(Dvp));
  }
}

// The fast fp32-accumulating path (AVX2, AVX-512 without BF16, fp16/fp32 caches): head dims
// multiples of the vector width. No conversion pass: K and V are read straight from the
// paged cache and widened in registers, 4 rows x 2 keys per score tile, 4 rows per p.V
// chunk, and whole rows prefetched two blocks ahead in address order.
template <typename QT, typename KT>
static int fused_item(const NaProblem& P, const NaItem& it) {
  const int Hq = P.num_q_heads, Hkv = P.num_kv_heads, D = P.head_dim, Dv = P.v_head_dim;
  const int ps = P.page_size;
  const bool mla = P.kind == NA_MLA;
  const int G = Hq / Hkv;
  const int Dp = D, Dvp = Dv;
  const int nh = it.h1 - it.h0, nq = it.q1 - it.q0, R1 = nh * nq;
  const int nkv = it.kv_head_end - it.kv_head, R = nkv * R1;
  const int req = it.req;
  const int32_t* pages = P.kv_indices + P.kv_indptr[req];
  Buffers& B = tls_buffers;
  try {
    B.ensure(R, Dp, Dvp);
  } catch (const std::bad_alloc&) {
    return -2;
  }
  float* qb = B.q.data();
  float* S = B.s.data();
  float* acc = B.acc.data();
  float* m = B.m.data();
  float* l = B.l.data();
  float alpha[na::kMaxRows];
  int lim[na::kMaxRows];
  bool bad[na::kMaxRows];
  const uint8_t* mrow[na::kMaxRows];
  init_rows<QT>(P, it, R, R1, nh, G, Dp, Dvp, qb, m, l, acc, lim, bad, mrow);
  const KT* kbase = static_cast<const KT*>(P.k);
  const KT* vbase = static_cast<const KT*>(mla ? P.k : P.v);
  const int64_t kstride = mla ? D : int64_t(Hkv) * D;
  const int64_t vstride = mla ? D : int64_t(Hkv) * Dv;
  const int klines = int((kstride * int64_t(sizeof(KT)) + 63) / 64);
  const int vlines = mla ? 0 : int((vstride * int64_t(sizeof(KT)) + 63) / 64);
  const KT* kp0[BK];
  const KT* vp0[BK];
  const KT* kp[BK + 1];
  const KT* vp[BK];
  const KT* kpa[BK];
  const KT* vpa[BK];
  const float* kf[BK + 1];
  const float* vf_[BK];
  float* kb = B.k.data();
  float* vb = B.v.data();
  // The first two blocks, which the in-loop prefetch (two blocks ahead) never covers.
  for (int pos = it.k0; pos < std::min(it.k1, it.k0 + 2 * BK); ++pos) {
    const int64_t slot = int64_t(pages[pos / ps]) * ps + pos % ps;
    const char* kr = reinterpret_cast<const char*>(kbase + slot * kstride);
    for (int i = 0; i < klines; ++i) __builtin_prefetch(kr + 64 * i, 0, 1);
    const char* vr = reinterpret_cast<const char*>(vbase + slot * vstride);
    for (int i = 0; i < vlines; ++i) __builtin_prefetch(vr + 64 * i, 0, 1);
  }
  for (int k0 = it.k0; k0 < it.k1; k0 += BK) {
    const int n = std::min(BK, it.k1 - k0);
    for (int t = 0; t < n; ++t) {
      const int pos = k0 + t;
      const int64_t slot = int64_t(pages[pos / ps]) * ps + pos % ps;
      kp0[t] = kbase + slot * kstride;
      vp0[t] = vbase + slot * vstride;
    }
    const int ka = k0 + 2 * BK;
    const int na_ = std::max(0, std::min(BK, it.k1 - ka));
    for (int t = 0; t < na_; ++t) {
      const int pos = ka + t;
      const int64_t slot = int64_t(pages[pos / ps]) * ps + pos % ps;
      kpa[t] = kbase + slot * kstride;
      vpa[t] = vbase + slot * vstride;
    }
    for (int gi = 0; gi < nkv; ++gi) {
      const int64_t koff = mla ? 0 : int64_t(it.kv_head + gi) * D;
      const int64_t voff = mla ? 0 : int64_t(it.kv_head + gi) * Dv;
      for (int t = 0; t < n; ++t) {
        kp[t] = kp0[t] + koff;
        vp[t] = vp0[t] + voff;
      }
      kp[n] = kp[0];  // an odd block's last pair reads a real row; that score is dropped
      // Rows two blocks ahead, whole (every head), in address order, a slice per head: one
      // head's rows are 2 KB apart and pages lie at random places, which the hardware
      // prefetchers do not follow.
      for (int t = gi * na_ / nkv; t < (gi + 1) * na_ / nkv; ++t) {
        const char* kr = reinterpret_cast<const char*>(kpa[t]);
        for (int i = 0; i < klines; ++i) __builtin_prefetch(kr + 64 * i, 0, 1);
        const char* vr = reinterpret_cast<const char*>(vpa[t]);
        for (int i = 0; i < vlines; ++i) __builtin_prefetch(vr + 64 * i, 0, 1);
      }
      const int rb = gi * R1;
      // Many rows per head (prefill, MLA): widen the block's rows once into fp32 buffers
      // that every 4-row group reuses; few rows (GQA decode): widen inside the loads.
      const bool widen = !std::is_same<KT, float>::value && R1 > 4;
      if (widen) {
        for (int t = 0; t < n; ++t) {
          load_row(kb + size_t(t) * Dp, kp[t], D, Dp);
          kf[t] = kb + size_t(t) * Dp;
          if (!mla) {
            load_row(vb + size_t(t) * Dvp, vp[t], Dv, Dvp);
            vf_[t] = vb + size_t(t) * Dvp;
          } else {
            vf_[t] = kf[t];
          }
        }
        kf[n] = kf[0];
      }
      for (int r0 = 0; r0 < R1; r0 += 4) {
        const int nr = std::min(4, R1 - r0);
        const float* qg = qb + size_t(rb + r0) * Dp;
        float* sg = S + size_t(rb + r0) * BK;
        if (widen) {
          for (int t = 0; t < n; t += 2) qk_rows(nr, qg, Dp, D, kf[t], kf[t + 1], sg + t);
        } else {
          for (int t = 0; t < n; t += 2) qk_rows(nr, qg, Dp, D, kp[t], kp[t + 1], sg + t);
        }
      }
      for (int r = rb; r < rb + R1; ++r) {
        float* sr = S + size_t(r) * BK;
        if (post_scores(P, sr, n, k0, lim[r], mrow[r])) bad[r] = true;
        vf mv = ld(sr);
        for (int t = W; t < BK; t += W) mv = vmax(mv, ld(sr + t));
        const float mn = std::max(m[r], hmax(mv));
        if (mn == kNegInf) {  // every key so far masked for this row
          std::memset(sr, 0, sizeof(float) * BK);
          alpha[r] = 1.0f;
          continue;
        }
        alpha[r] = std::exp2(m[r] - mn);
        vf psum = splat(0.0f);
        for (int t = 0; t < BK; t += W) {
          const vf p = vexp2(ld(sr + t) - mn);
          psum += p;
          st(sr + t, p);
        }
        l[r] = l[r] * alpha[r] + hsum(psum);
        m[r] = mn;
      }
      if (widen) {
        guard_values<float>(P, lim, mrow, bad, rb, rb + R1, k0, n, vf_, Dv);
      } else {
        guard_values<KT>(P, lim, mrow, bad, rb, rb + R1, k0, n, vp, Dv);
      }
      for (int r0 = 0; r0 < R1; r0 += 4) {
        const int nr = std::min(4, R1 - r0);
        if (widen) {
          pv_rows(nr, acc + size_t(rb + r0) * Dvp, Dvp, Dv, S + size_t(rb + r0) * BK,
                  alpha + rb + r0, vf_, n);
        } else {
          pv_rows(nr, acc + size_t(rb + r0) * Dvp, Dvp, Dv, S + size_t(rb + r0) * BK,
                  alpha + rb + r0, vp, n);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    finish_row(P, it, r, R1, nh, G, acc + size_t(r) * Dvp, inv, m[r], l[r], bad[r],
               static_cast<QT*>(P.out));
  }
  return 0;
}

template <typename QT, typename KT>
static int item_impl(const NaProblem& P, const NaItem& it) {
  const int Hq = P.num_q_heads, Hkv = P.num_kv_heads, D = P.head_dim, Dv = P.v_head_dim;
  const int ps = P.page_size;
  const bool mla = P.kind == NA_MLA;
  const int G = Hq / Hkv;
  const int Dp = round_up(D, W), Dvp = round_up(Dv, W);
  const int nh = it.h1 - it.h0, nq = it.q1 - it.q0, R1 = nh * nq;
  const int nkv = it.kv_head_end - it.kv_head, R = nkv * R1;
  const int req = it.req;
  const int32_t* pages = P.kv_indices + P.kv_indptr[req];
  Buffers& B = tls_buffers;
  try {
    B.ensure(R, Dp, Dvp);
  } catch (const std::bad_alloc&) {
    return -2;
  }
  float* qb = B.q.data();
  float* kb = B.k.data();
  float* vb = B.v.data();
  float* S = B.s.data();
  float* acc = B.acc.data();
  float* m = B.m.data();
  float* l = B.l.data();
  int lim[na::kMaxRows];
  bool bad[na::kMaxRows];
  const uint8_t* mrow[na::kMaxRows];
  init_rows<QT>(P, it, R, R1, nh, G, Dp, Dvp, qb, m, l, acc, lim, bad, mrow);
  const KT* kbase = static_cast<const KT*>(P.k);
  const KT* vbase = static_cast<const KT*>(P.v);
  for (int k0 = it.k0; k0 < it.k1; k0 += BK) {
    const int n = std::min(BK, it.k1 - k0);
    // kv heads innermost: the block's tokens are read whole (all heads), in address order.
    for (int gi = 0; gi < nkv; ++gi) {
    const int g = it.kv_head + gi;
    // Gather and convert the block's rows once; every row of the tile reuses them.
    for (int t = 0; t < n; ++t) {
      const int pos = k0 + t;
      const int64_t slot = int64_t(pages[pos / ps]) * ps + pos % ps;
      if (mla) {
        load_row(kb + size_t(t) * Dp, kbase + slot * D, D, Dp);
      } else {
        load_row(kb + size_t(t) * Dp, kbase + (slot * Hkv + g) * D, D, Dp);
        load_row(vb + size_t(t) * Dvp, vbase + (slot * Hkv + g) * Dv, Dv, Dvp);
      }
    }
    // MLA: V is the first Dv columns of the same converted latent rows (read once).
    const float* V = mla ? kb : vb;
    const int vstride = mla ? Dp : Dvp;
    for (int r = gi * R1; r < (gi + 1) * R1; ++r) {
      const float* qr = qb + size_t(r) * Dp;
      float* sr = S + size_t(r) * BK;
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
      if (post_scores(P, sr, n, k0, lim[r], mrow[r])) bad[r] = true;
    }
    const float* vrows[BK];
    for (int t = 0; t < n; ++t) vrows[t] = V + size_t(t) * vstride;
    guard_values<float>(P, lim, mrow, bad, gi * R1, (gi + 1) * R1, k0, n, vrows, Dv);
    // Online softmax: one max/rescale per row per block, then acc += p . V.
    for (int r = gi * R1; r < (gi + 1) * R1; ++r) {
      float* sr = S + size_t(r) * BK;
      vf mv = ld(sr);
      for (int t = W; t < BK; t += W) mv = vmax(mv, ld(sr + t));
      const float mn = std::max(m[r], hmax(mv));
      if (mn == kNegInf) continue;  // every key so far masked for this row
      const float alpha = std::exp2(m[r] - mn);
      vf ps = splat(0.0f);
      for (int t = 0; t < BK; t += W) {
        const vf p = vexp2(ld(sr + t) - mn);
        ps += p;
        st(sr + t, p);
      }
      l[r] = l[r] * alpha + hsum(ps);
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
  // Finish: normalise; rows that saw no key at all give zeros, never NaN.
  for (int r = 0; r < R; ++r) {
    const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
    const float* ar = acc + size_t(r) * Dvp;
    finish_row(P, it, r, R1, nh, G, ar, inv, m[r], l[r], bad[r], static_cast<QT*>(P.out));
  }
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
  try {
    B.ensure(1, W, round_up(Dv, W));
  } catch (const std::bad_alloc&) {
    return -2;
  }
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

template <typename QT>
static int item_q(const NaProblem* p, const NaItem* it) {
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

static int item(const NaProblem* p, const NaItem* it) {
#ifdef NA_HAVE_BF16_PATH
  if (p->q_dtype == NA_BF16 && p->kv_dtype == NA_BF16 && bf16_path_applies(*p, *it)) {
    return bf16_item(*p, *it);
  }
  if (p->q_dtype == NA_BF16 && fp8_mla_path_applies(*p)) {
    return p->kv_dtype == NA_E4M3 ? bf16_item<e4m3>(*p, *it) : bf16_item<e5m2>(*p, *it);
  }
#endif
  switch (p->q_dtype) {
    case NA_BF16: return item_q<uint16_t>(p, it);
    case NA_F16: return item_q<f16>(p, it);
    default: return item_q<float>(p, it);
  }
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
