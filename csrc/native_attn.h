// Plain C ABI of the native CPU attention kernels (loaded from Python with ctypes).
// Every pointer is host memory; Python validates shapes, dtypes and index ranges first,
// the kernels trust what they are given.
#ifndef NATIVE_ATTN_H
#define NATIVE_ATTN_H
#include <stdint.h>

#if defined(__GNUC__)
#define NA_API __attribute__((visibility("default")))
#else
#define NA_API
#endif

#ifdef __cplusplus
extern "C" {
#endif

enum { NA_F32 = 0, NA_BF16 = 1 };
enum { NA_MHA = 0, NA_MLA = 1 };

// One work item: a tile of rows (query tokens x heads of one kv head) against a key range.
// slot < 0: write the output directly; slot >= 0: write a partial result (normalised
// output + log2-sum-exp) at scratch row `slot`, merged afterwards.
typedef struct {
  int32_t req, kv_head, q0, q1, h0, h1, k0, k1, slot, pad;
} NaItem;

// Merge of the `nsplit` partial results of one tile; split s lives at rows slot0 + s * rows.
typedef struct {
  int32_t req, kv_head, q0, q1, h0, h1, nsplit, slot0;
} NaMerge;

typedef struct {
  // tensors (contiguous, see DESIGN.md): q [T, Hq, D], k [P, ps, Hkv, D] (MLA: [P, ps, D]),
  // v [P, ps, Hkv, Dv] (MLA: NULL, V = first Dv columns of k), out [T, Hq, Dv]
  const void* q;
  const void* k;
  const void* v;
  void* out;
  int32_t q_dtype, kv_dtype, kind;
  int32_t num_q_heads, num_kv_heads, head_dim, v_head_dim, page_size;
  float sm_scale;
  int32_t causal;  // 1: bottom-right causal; 0: custom mask
  // batch metadata (host)
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  const int32_t* kv_lens;
  const uint8_t* mask;
  const int64_t* mask_indptr;
  // plan
  const NaItem* items;
  int32_t num_items;
  const NaMerge* merges;
  int32_t num_merges;
  float* scratch;  // rows * Dv partial outputs, then rows log2-sum-exp values
  int64_t scratch_rows;
  int32_t num_threads;
} NaProblem;

// Plan: fill up to `cap_items` / `cap_merges` entries; returns 0 and sets the needed counts
// (call again with more room when they exceed the capacity).
NA_API int na_plan(int32_t num_requests, const int32_t* qo_indptr, const int32_t* kv_lens,
            int32_t kind, int32_t num_q_heads, int32_t num_kv_heads, int32_t causal,
            int32_t split_target, NaItem* items, int64_t cap_items, NaMerge* merges,
            int64_t cap_merges, int64_t* num_items, int64_t* num_merges,
            int64_t* scratch_rows);

// Run attention for one layer; returns 0 on success, a negative code on bad arguments.
NA_API int na_run(const NaProblem* problem);

// Instruction-set path: name of the one in use, and forcing one ("generic", "avx2",
// "avx512", "avx512bf16"); returns 0 when set, -1 when this CPU/build lacks it.
NA_API const char* na_isa(void);
NA_API int na_set_isa(const char* name);
NA_API const char* na_isa_list(void);  // comma-separated paths this CPU and build can run
NA_API int32_t na_abi_version(void);

#ifdef __cplusplus
}
#endif
#endif
