// AMX tile micro-kernels of the many-row path (kern_amx.cpp only, through rows_path.h):
// q.K^T and p.V of one 32-key block of one kv head with tdpbf16ps on 16 x 64-byte tiles.
// Compiles alone with -mamx-tile -mamx-bf16, or with NA_AMX_EMULATE, where the four tile
// instructions used here are plain C++ following their documented semantics (the layout
// test, tests/backends/native/test_amx.py, runs them on any CPU).
//
// Layouts (the rows path's own, so nothing is repacked twice):
//   q.K^T computes the scores TRANSPOSED, C[key][lane] = K[key][D] . Q^T[D][lane]: the A tile
//   is 16 keys x 32 bf16 columns of K, read from the cache in place when the 16 keys are
//   consecutive slots of one page (constant stride), else packed into a local buffer (a
//   block tail, a page edge); the B tile is 16 column pairs x 16 lanes of the q^T pairs the
//   rows path already keeps ([D / 2][Rp] dwords: exactly the VNNI layout tdpbf16ps reads).
//   C lands in the rows path's s[key][lane] order.
//   p.V accumulates acc[lane][Dv] += P[lane][keys] . V[keys][Dv]: the A tile is the weight
//   pairs of 16 lanes (the transposed pairs of the rows path, transposed back), the B tiles
//   the block's V rows interleaved in key pairs, in the column order of pv_rows_bf16 (each
//   32 columns: the unpacklo then the unpackhi dwords), so the rows finish with the same
//   unpermute_row.
// Tile config: all 8 tiles 16 rows x 64 bytes, loaded at the start of each item
// (ldtilecfg is per thread, and other code on the thread, oneDNN's, may change it) and
// released at its end.
#ifndef NATIVE_ATTN_AMX_PATH_H
#define NATIVE_ATTN_AMX_PATH_H
#if !defined(NA_AMX_EMULATE) && (!defined(__AMX_TILE__) || !defined(__AMX_BF16__))
#error "amx_path.h needs -mamx-tile -mamx-bf16 (it is the amx unit's path), or NA_AMX_EMULATE"
#endif
#include <cstddef>
#include <cstdint>
#include <cstring>
#ifndef NA_AMX_EMULATE
#include <immintrin.h>
#endif

namespace na_amx {

// Keys per block the micro-kernels take (the rows path's kBlockKeys), lanes per tile row.
constexpr int kKeys = 32;
constexpr int kLanes = 16;

struct alignas(64) TileConfig {
  uint8_t palette_id;
  uint8_t start_row;
  uint8_t reserved[14];
  uint16_t colsb[16];
  uint8_t rows[16];
};

static inline TileConfig full_config() {
  TileConfig c;
  std::memset(&c, 0, sizeof c);
  c.palette_id = 1;
  for (int t = 0; t < 8; ++t) {
    c.colsb[t] = 64;
    c.rows[t] = 16;
  }
  return c;
}

#ifdef NA_AMX_EMULATE
// The tile registers of this thread, emulated: rows x colsb bytes each.
struct EmuTiles {
  uint8_t rows[8];
  uint16_t colsb[8];
  alignas(64) unsigned char d[8][16][64];
};
inline thread_local EmuTiles emu;

static inline float emu_bf16(uint16_t x) {
  const uint32_t u = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
static inline void tile_config(const TileConfig* c) {
  for (int t = 0; t < 8; ++t) {
    emu.rows[t] = c->rows[t];
    emu.colsb[t] = c->colsb[t];
  }
  std::memset(emu.d, 0, sizeof emu.d);
}
static inline void tile_release() { std::memset(&emu, 0, sizeof emu); }
static inline void emu_load(int t, const void* base, long stride) {
  for (int r = 0; r < emu.rows[t]; ++r) {
    std::memcpy(emu.d[t][r], static_cast<const unsigned char*>(base) + r * stride, emu.colsb[t]);
  }
}
static inline void emu_store(int t, void* base, long stride) {
  for (int r = 0; r < emu.rows[t]; ++r) {
    std::memcpy(static_cast<unsigned char*>(base) + r * stride, emu.d[t][r], emu.colsb[t]);
  }
}
static inline void emu_zero(int t) { std::memset(emu.d[t], 0, sizeof emu.d[t]); }
// tdpbf16ps: C[m][n] (fp32) += sum over k of A[m] bf16 pair k . B[k] bf16 pair n, the two
// products added in order (as the instruction's pseudo-code does).
static inline void emu_dp(int c, int a, int b) {
  for (int m = 0; m < emu.rows[c]; ++m) {
    for (int n = 0; n < emu.colsb[c] / 4; ++n) {
      float acc;
      std::memcpy(&acc, emu.d[c][m] + 4 * n, sizeof acc);
      for (int k = 0; k < emu.colsb[a] / 4; ++k) {
        uint16_t a0, a1, b0, b1;
        std::memcpy(&a0, emu.d[a][m] + 4 * k, 2);
        std::memcpy(&a1, emu.d[a][m] + 4 * k + 2, 2);
        std::memcpy(&b0, emu.d[b][k] + 4 * n, 2);
        std::memcpy(&b1, emu.d[b][k] + 4 * n + 2, 2);
        acc += emu_bf16(a0) * emu_bf16(b0);
        acc += emu_bf16(a1) * emu_bf16(b1);
      }
      std::memcpy(emu.d[c][m] + 4 * n, &acc, sizeof acc);
    }
  }
}
#define NA_TILE_LOAD(t, p, s) ::na_amx::emu_load(t, p, long(s))
#define NA_TILE_STORE(t, p, s) ::na_amx::emu_store(t, p, long(s))
#define NA_TILE_ZERO(t) ::na_amx::emu_zero(t)
#define NA_TILE_DP(c, a, b) ::na_amx::emu_dp(c, a, b)
#else
// GCC's (12) tileloadd and ldtilecfg are asm statements that do not tell the compiler they
// read memory (only tilestored has the "memory" clobber): without a compiler barrier on each
// side, stores that fill a buffer could be moved past the load that reads it, or the next
// refill moved before it. The barriers emit no instruction.
#define NA_COMPILER_BARRIER() __asm__ volatile("" ::: "memory")
static inline void tile_config(const TileConfig* c) {
  NA_COMPILER_BARRIER();
  _tile_loadconfig(c);
  NA_COMPILER_BARRIER();
}
static inline void tile_release() { _tile_release(); }
#define NA_TILE_LOAD(t, p, s)        \
  do {                               \
    NA_COMPILER_BARRIER();           \
    _tile_loadd(t, p, long(s));      \
    NA_COMPILER_BARRIER();           \
  } while (0)
#define NA_TILE_STORE(t, p, s) _tile_stored(t, p, long(s))
#define NA_TILE_ZERO(t) _tile_zero(t)
#define NA_TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#endif

// Per-thread scratch of the micro-kernels (sized for head dims D, Dv).
struct Scratch {
  uint16_t* kpack;  // kKeys x D bf16: keys that cannot be read in place
  uint32_t* vv;     // Dv / 32 chunks x 2 halves x 16 pairs x 16 dwords: interleaved V
  uint32_t* pa;     // 16 lanes x 16 pairs: weight pairs of one lane group
};
static inline size_t scratch_bytes(int D, int Dv) {
  return sizeof(uint16_t) * size_t(kKeys) * size_t(D) +
         sizeof(uint32_t) * (size_t(Dv) * kKeys / 2 + size_t(kLanes) * kKeys / 2) + 64;
}

// Scores of one block: s[t][lane] for t < nt (16 or 32 keys), lanes < Rp (16 or 32)
// = sum over c < D (a multiple of 32) of k_t[c] q_lane[c], unscaled. qp: q^T pairs [D / 2][Rp]
// dwords. kr[t]: key t's bf16 row (D elements, every t < nt valid memory); kstride: the
// elements between consecutive slots of a page (the in-place load's row step).
static inline void qk_block(const uint32_t* qp, int Rp, int D, const uint16_t* const* kr, int nt,
                            int64_t kstride, const Scratch& sc, float* s) {
  const uint16_t* kb[2] = {nullptr, nullptr};
  int64_t kbytes[2] = {0, 0};
  for (int g = 0; g < nt / kLanes; ++g) {
    const uint16_t* const* k = kr + kLanes * g;
    bool direct = true;
    const uintptr_t first = reinterpret_cast<uintptr_t>(k[0]);
    for (int i = 1; i < kLanes && direct; ++i) {
      direct = reinterpret_cast<uintptr_t>(k[i]) ==
               first + uintptr_t(i) * uintptr_t(kstride) * sizeof(uint16_t);
    }
    if (direct) {
      kb[g] = k[0];
      kbytes[g] = kstride * int64_t(sizeof(uint16_t));
    } else {
      uint16_t* dst = sc.kpack + size_t(g) * kLanes * size_t(D);
      for (int i = 0; i < kLanes; ++i) {
        std::memcpy(dst + size_t(i) * D, k[i], sizeof(uint16_t) * size_t(D));
      }
      kb[g] = dst;
      kbytes[g] = int64_t(D) * int64_t(sizeof(uint16_t));
    }
  }
  const bool two_keys = nt > kLanes, two_lanes = Rp > kLanes;
  const int64_t qbytes = int64_t(Rp) * 4;
  NA_TILE_ZERO(0);
  NA_TILE_ZERO(1);
  NA_TILE_ZERO(2);
  NA_TILE_ZERO(3);
  for (int c = 0; c < D; c += 32) {
    const uint32_t* qc = qp + size_t(c / 2) * Rp;
    NA_TILE_LOAD(4, kb[0] + c, kbytes[0]);
    NA_TILE_LOAD(6, qc, qbytes);
    NA_TILE_DP(0, 4, 6);
    if (two_lanes) {
      NA_TILE_LOAD(7, qc + kLanes, qbytes);
      NA_TILE_DP(1, 4, 7);
    }
    if (two_keys) {
      NA_TILE_LOAD(5, kb[1] + c, kbytes[1]);
      NA_TILE_DP(2, 5, 6);
      if (two_lanes) NA_TILE_DP(3, 5, 7);
    }
  }
  NA_TILE_STORE(0, s, qbytes);
  if (two_lanes) NA_TILE_STORE(1, s + kLanes, qbytes);
  if (two_keys) {
    NA_TILE_STORE(2, s + size_t(kLanes) * Rp, qbytes);
    if (two_lanes) NA_TILE_STORE(3, s + size_t(kLanes) * Rp + kLanes, qbytes);
  }
}

// The block's V rows (vr[0 .. 2 npairs), Dv bf16 each) interleaved in key pairs for the B
// tiles: chunk c / 32, half h, pair tp, dword j = (v[2 tp][col], v[2 tp + 1][col]) with
// col = c + (j / 4) * 8 + 4 h + j % 4 (pv_rows_bf16's unpacklo / unpackhi order); pairs past
// npairs are zero.
static inline void interleave_values(const uint16_t* const* vr, int npairs, int Dv,
                                     uint32_t* vv) {
  for (int c = 0; c < Dv; c += 32) {
    uint32_t* lo = vv + size_t(c / 32) * 2 * kLanes * kLanes;
    uint32_t* hi = lo + kLanes * kLanes;
    for (int tp = 0; tp < kKeys / 2; ++tp) {
      if (tp >= npairs) {
        std::memset(lo + tp * kLanes, 0, sizeof(uint32_t) * kLanes);
        std::memset(hi + tp * kLanes, 0, sizeof(uint32_t) * kLanes);
        continue;
      }
      const uint16_t* a = vr[2 * tp] + c;
      const uint16_t* b = vr[2 * tp + 1] + c;
#if defined(__AVX512BW__) && !defined(NA_AMX_EMULATE)
      const __m512i va = _mm512_loadu_si512(a), vb = _mm512_loadu_si512(b);
      _mm512_storeu_si512(lo + tp * kLanes, _mm512_unpacklo_epi16(va, vb));
      _mm512_storeu_si512(hi + tp * kLanes, _mm512_unpackhi_epi16(va, vb));
#else
      for (int j = 0; j < kLanes; ++j) {
        const int col = (j / 4) * 8 + j % 4;
        lo[tp * kLanes + j] = uint32_t(a[col]) | uint32_t(b[col]) << 16;
        hi[tp * kLanes + j] = uint32_t(a[col + 4]) | uint32_t(b[col + 4]) << 16;
      }
#endif
    }
  }
}

// acc[lane][Dv] (Rp lanes, row stride Dv floats, pv_rows_bf16's column order) += the block's
// p . V: pb = weight pairs [tp][Rp] dwords (pair tp of lane i at pb[tp * Rp + i], tp < npairs);
// vv: interleave_values of the block. Every lane's row of acc is read and written (pad lanes
// too: acc must have Rp rows).
static inline void pv_block(float* acc, int Rp, int Dv, const uint32_t* pb, int npairs,
                            const Scratch& sc) {
  const int64_t abytes = int64_t(Dv) * 4;
  for (int g = 0; g < Rp / kLanes; ++g) {
    uint32_t* pa = sc.pa;
    for (int i = 0; i < kLanes; ++i) {
      for (int tp = 0; tp < kKeys / 2; ++tp) {
        pa[i * (kKeys / 2) + tp] = tp < npairs ? pb[size_t(tp) * Rp + g * kLanes + i] : 0u;
      }
    }
    NA_TILE_LOAD(4, pa, kKeys / 2 * 4);
    float* ag = acc + size_t(g) * kLanes * Dv;
    for (int c = 0; c < Dv; c += 32) {
      const uint32_t* lo = sc.vv + size_t(c / 32) * 2 * kLanes * kLanes;
      NA_TILE_LOAD(0, ag + c, abytes);
      NA_TILE_LOAD(1, ag + c + kLanes, abytes);
      NA_TILE_LOAD(5, lo, kLanes * 4);
      NA_TILE_LOAD(6, lo + kLanes * kLanes, kLanes * 4);
      NA_TILE_DP(0, 4, 5);
      NA_TILE_DP(1, 4, 6);
      NA_TILE_STORE(0, ag + c, abytes);
      NA_TILE_STORE(1, ag + c + kLanes, abytes);
    }
  }
}

}  // namespace na_amx

#endif  // NATIVE_ATTN_AMX_PATH_H
