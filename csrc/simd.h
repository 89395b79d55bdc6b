// SIMD layer of the native kernels: vector types of the unit's native width, loads that
// widen every cache dtype (bf16, fp16, FP8) to fp32 in registers, stores that round back,
// reductions, exp2 and the logit cap. No attention logic: tile.h builds on it.
//
// Compiled once per instruction set inside the namespace NA_NS (each kern_<isa>.cpp defines
// it, and NA_W, before including kernels_impl.h). Compiles alone: without NA_NS it uses a
// namespace of its own, and without NA_W the width follows the -m flags of the unit.
#ifndef NATIVE_ATTN_SIMD_H
#define NATIVE_ATTN_SIMD_H
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

#include "kernels.h"

#ifndef NA_NS
#define NA_NS na_standalone
#endif
// Vector width in floats: 16 for AVX-512, 8 for AVX2, 4 for the portable build (SSE2 on
// x86-64, NEON on aarch64). Wider-than-native vectors would be split by the compiler into
// slow sequences, so each translation unit uses its own native width.
#ifndef NA_W
#if defined(__AVX512F__)
#define NA_W 16
#elif defined(__AVX2__)
#define NA_W 8
#else
#define NA_W 4
#endif
#endif

namespace NA_NS {

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
// x - 0 is x for every x (-0 included), so GCC emits a bare broadcast, folded into the
// FMA's memory operand ({1to16}); 0 + x is not (0 + -0 = +0): that form cost a vaddss and a
// register vbroadcastss per use, on the FP pipes the FMAs need (the fp32 q.K^T loop).
static inline vf splat(float x) { return x - vf{}; }
static inline vf vmax(vf a, vf b) { return a > b ? a : b; }
// bf16 -> fp32 is a 16-bit left shift of the bit pattern: done in registers.
// (The intrinsics: GCC's code for the generic form was two 8-lane zero-extensions, an extract
// and an insert before the shift, 6 ops for 16 lanes on AVX-512: the fp32 many-row kernel
// widens every K/V row of a block with it.)
static inline vf ld_bf16(const uint16_t* p) {
#if defined(__AVX512F__) && NA_W == 16
  return (vf)_mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
#elif defined(__AVX2__) && NA_W == 8
  return (vf)_mm256_castsi256_ps(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  vh h;
  std::memcpy(&h, p, sizeof h);
  vu w = __builtin_convertvector(h, vu) << 16;
  vf f;
  std::memcpy(&f, &w, sizeof f);
  return f;
#endif
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
// Always inlined: out of line it cost a call, spills and reloads of its constants per vector
// in the softmax loops (~9% of the many-row kernel's samples, perf).
__attribute__((always_inline)) static inline vf vexp2(vf x) {
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

// A cache row's W elements widened to fp32 (the fused kernels' loads).
static inline vf ldk(const float* p) { return ld(p); }
static inline vf ldk(const uint16_t* p) { return ld_bf16(p); }
static inline vf ldk(const f16* p) { return ld_f16(p); }
static inline vf ldk(const e4m3* p) { return ld_fp8(p); }
static inline vf ldk(const e5m2* p) { return ld_fp8(p); }

}  // namespace NA_NS

#endif  // NATIVE_ATTN_SIMD_H
