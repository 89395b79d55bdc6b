// Internal: the per-instruction-set kernel tables and the tiling constants shared by the
// planner (plan.cpp) and the kernels (kernels_impl.h, compiled once per ISA).
#ifndef NATIVE_ATTN_KERNELS_H
#define NATIVE_ATTN_KERNELS_H
#include <algorithm>

#include "native_attn.h"

// One work item: a tile of rows (query tokens x heads of one kv head) against a key range.
// slot < 0: write the output directly; slot >= 0: write a partial result (normalised
// output + log2-sum-exp) at scratch row `slot`, merged afterwards.
// Rows are ordered (kv head, query, head): r = (g - kv_head) * nq * nh + jj * nh + hh. A
// decode tile spans every kv head of its request, so each page is read whole, in order.
// shared = 1: a cascade tile over a group's shared leading pages (those of request `req`):
// its queries q0..q1 index the group's cascade tokens (ctoks[cbase + q]), from several
// requests, and row (token c, head h) writes its partial result at scratch row slot + c * Hq + h.
typedef struct {
  int32_t req, kv_head, q0, q1, h0, h1, k0, k1, slot, kv_head_end, shared, cbase;
} NaItem;

// Merge of the `nsplit` partial results of one tile; split s lives at rows slot0 + s * rows.
// A cascade member also merges `nshared` shared-prefix partials: split s of query jj, head h
// at row shared0 + s * shared_stride + jj * Hq + h.
typedef struct {
  int32_t req, kv_head, q0, q1, h0, h1, nsplit, slot0, kv_head_end, nshared, shared0,
      shared_stride;
} NaMerge;

// One layer's call as the kernels see it: the plan's (validated, private) metadata plus
// this call's tensors and the calling thread's own scratch.
typedef struct {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int32_t q_dtype, kv_dtype, kind;
  int32_t num_q_heads, num_kv_heads, head_dim, v_head_dim, page_size;
  float sm_scale;
  int32_t window_left;  // -1: off (causal rows only; a custom mask has the window folded in)
  float logit_cap;      // 0: off
  const float* sinks;   // NULL or [Hq], natural-log units
  float k_scale, v_scale;
  int32_t causal;  // 1: bottom-right causal (or every key: noncausal); 0: custom mask
  int32_t noncausal;   // without a mask: every row sees keys [0, kv_len)
  int32_t chunk_size;  // 0: off (causal rows only; a custom mask has the chunk folded in)
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_lens;
  const uint8_t* mask;
  const int64_t* mask_indptr;
  float* scratch;  // rows * Dv partial outputs, then rows log2-sum-exp values
  int64_t scratch_rows;
  float* lse;            // NULL, or [T, Hq] natural-log sums of the rows (sinks included)
  const int32_t* ctoks;  // cascade tokens: (request, query index) pairs
  // 1: the call's K/V is small enough to be in cache (na::kLeanPrefetchBytes): the prefetch
  // cursor takes its lean step (tile.h, PfCursor).
  int32_t lean_prefetch;
} NaProblem;

namespace na {

// A call whose K/V (every request's keys, K and V rows of every kv head) is at most this many
// bytes may be served from cache, where the prefetch cursor's per-line bookkeeping is what
// costs (PfCursor's lean step: the vLLM tiny model's decode, 655 KB a layer, 0.80-0.91x the
// time); a larger one streams from DRAM, where the paced step measured faster (2 threads:
// lean was 1.02-1.07x the time of GQA decode at 67-268 MB). A quarter of the 32 MB L3 of
// the AMD EPYC it was measured on.
constexpr int64_t kLeanPrefetchBytes = int64_t(8) << 20;
// Keys per block: the softmax statistics are updated once per block.
constexpr int kBlockKeys = 32;
// Rows (query tokens x heads) per work item: bounds the per-thread accumulator to
// kMaxRows x Dv floats so it stays in L2.
constexpr int kMaxRows = 32;
// Rows per kv head of a cascade tile (a group's shared keys): up to twice kMaxRows, so that a
// group of 16 decode requests of GQA 4 heads reads each shared key once, not once per 32-row
// half (bench/native_notes.md, "Cascade"). Only the vdpbf16ps many-row kernel takes such a
// tile whole; every other kernel runs it as consecutive tiles of at most kMaxRows rows.
constexpr int kMaxCascadeRows = 64;
// A tile of exactly 16 rows per kv head (a 4-token verify chain of GQA groups of 4, groups
// of 8 verifying 2 tokens, ...) takes up to kMaxWideRows rows: every kv head of a token, up to
// 8 at 16 rows, so that each key block is read as whole token rows, as decode reads them (a
// tile of 2 of 8 kv heads read a quarter of each row, which one core fetched at 7 GB/s against
// decode's 16.5: bench/native_notes.md, "Verify tiles over every kv head"). The many-row
// kernels (vdpbf16ps and fp32) take such a tile whole; the decode kernels and the amx unit run
// it as tiles of at most kMaxRows rows, a few kv heads each (kernels_impl.h, item).
// A request of at most kWideTokens query tokens whose tiles hold kMaxRows rows per kv head (a
// tree of 8 over GQA groups of 4) takes kMaxWideRows / kMaxRows kv heads per tile the same way:
// 0.96-0.99x the time of one kv head per tile in 16 of 18 rows, even in the other two (GQA
// 32/8 trees of 8 and 16 on the avx512bf16, avx512 and avx2 paths, 1 and 2 threads, both plans
// in one process; bench/native_notes.md, "Tree tiles over 4 kv heads").
constexpr int kMaxWideRows = 128;
constexpr int kWideTokens = 16;
// The most rows any item has (per-item row arrays are sized by it).
constexpr int kMaxTileRows = std::max({kMaxWideRows, kMaxCascadeRows, kMaxRows});
// Split-KV never cuts a tile into chunks shorter than this many keys: below it the
// merge costs more than the parallelism gains.
constexpr int kMinSplitKeys = 256;
// Cascade: a group shares at least this many leading keys, or it runs as private tiles.
constexpr int kMinCascadeKeys = 64;
// Rows per kv head (q heads of one kv head x query tokens) from which an item takes the
// many-row tile path (rows_path.h) instead of the decode-shaped kernels. Measured (single
// thread CPU time, AMD EPYC Zen 5, bench/native_notes.md "Many-row tile path, round 2"):
// avx512bf16, GQA 32/8 verify-4 (16 rows per kv head): 7.5 ms on the many-row path against
// 11.2 ms on the decode kernels (B8 ctx 2048), so bf16 moves from 32 to 16 rows; on the fp32
// paths 16 rows was even then (avx512: 16.4 vs 15.6 ms, avx2: 17-21 vs 21-22 ms), so they
// stayed at 32 until the measurement below. Decode (GQA: group-size rows, 4 for 32/8) stays
// on the decode kernels.
// The fp32 paths measured again with the kernels of 2026-12-04 (AMD EPYC, CPU family 25 model
// 17, single thread, GQA B8 ctx 2048, shuffled pages; bench/native_notes.md "The fp32 paths
// from 16 rows"): 16-28 rows per kv head now run faster on the many-row kernel on avx512
// (0.67-0.91x the decode kernels' time: bf16 and e4m3 caches, bf16 and fp32 q) and about as
// fast on avx2 (0.89-1.02x), so both take it from 16 rows; generic is even at 16 (43.5 vs
// 44.4 ms) and keeps 32.
constexpr int kRowsMinBf16 = 16;
constexpr int kRowsMinFp8Bf16 = 16;
constexpr int kRowsMinF32 = 16;
constexpr int kRowsMinGeneric = 32;
// The planner's wide tiles (kMaxWideRows rows of kRowsMinBf16 per kv head) hold at most
// kMaxRows kv heads, the bound of the kernels' per-head arrays (rows_path.h).
static_assert(kMaxWideRows / kRowsMinBf16 <= kMaxRows, "a wide tile's kv heads");
// MLA (one latent row of 576 for 16 q heads) takes the many-row path from one token's 16
// heads, decode included: on AVX-512 BF16 (bf16 q, bf16 or FP8 cache) and on AVX-512's fp32
// kernel (16 lanes); AVX2 and generic keep the decode kernel (rows_min_mla). Measured in
// bench/native_notes.md, "MLA on the many-row path": avx512bf16 verify-4 0.66-0.76 of the
// roofline against 0.51-0.62, decode 0.78-0.92x the time; avx512 0.67-0.84x the time.
constexpr int kRowsMinMlaBf16 = 16;
constexpr int kRowsMinMlaF32 = 16;
// The amx unit (bf16 q with a bf16 or FP8 cache): from one tile's 16 rows (GQA 4 heads x a
// 4-token verify chain). NOT measured on an AMX machine yet (bench/native_notes.md), and
// the amx path is never the default: only NATIVE_ATTN_ISA=amx / na_set_isa select it.
constexpr int kRowsMinAmx = 16;
// Widest head dims the kernels accept (per-thread buffers are sized from them).
constexpr int kMaxHeadDim = 2048;

struct Kernels {
  const char* name;
  // Returns 0, or -2 when a per-thread buffer could not be allocated.
  int (*item)(const NaProblem* p, const NaItem* it);
  int (*merge)(const NaProblem* p, const NaMerge* m);
};

}  // namespace na

extern "C" {
extern const na::Kernels na_kernels_generic;
#if defined(__x86_64__) || defined(_M_X64)
extern const na::Kernels na_kernels_avx2;
extern const na::Kernels na_kernels_avx512;
extern const na::Kernels na_kernels_avx512bf16;
#ifdef NA_HAVE_AMX_UNIT  // setup.py: the compiler built kern_amx.cpp
extern const na::Kernels na_kernels_amx;
#endif
#endif
}

#endif
