// Plain C ABI of the native CPU attention kernels (loaded from Python with ctypes).
// Every pointer is host memory. na_plan_create validates the batch (every index it will
// follow) and keeps private copies of it; na_run checks each call's tensors (shape, strides,
// dtype, pages) against the config and the plan before any load, so the kernels only ever
// read memory inside the tensors they are given.
//
// The library never trusts a pointer handed back by the caller: runners (one per backend
// object, holding its config) and plans live in tables owned by the library and are named by
// opaque 64-bit ids that are never reused (a freed id stays dead). Each plan is bound to the
// runner that made it; na_run looks both up and refuses an unknown, freed or foreign id.
#ifndef NATIVE_ATTN_H
#define NATIVE_ATTN_H
#include <stdint.h>

#if defined(__GNUC__)
#define NA_API __attribute__((visibility("default")))
#else
#define NA_API
#endif

// The one definition of the ABI version: na_abi_version() returns it; Python reads it from the
// library (never a second literal) and checks each struct it mirrors with na_struct_size.
// Bump it with any change to a struct, an entry point's arguments or their meaning.
#define NA_ABI_VERSION 11

#ifdef __cplusplus
extern "C" {
#endif

// FP8 codes are cache dtypes only (q is one of the first three).
enum { NA_F32 = 0, NA_BF16 = 1, NA_F16 = 2, NA_E4M3 = 3, NA_E5M2 = 4 };
enum { NA_MHA = 0, NA_MLA = 1 };

// What one backend object serves (fixed at bind): checked again by na_run.
typedef struct {
  int32_t kind, q_dtype, kv_dtype;
  int32_t num_q_heads, num_kv_heads, head_dim, v_head_dim, page_size;
  int32_t window_left;   // -1: full attention; else a query at p sees keys p-window_left ..= p
  float logit_cap;       // 0: off; else s = cap * tanh(s / cap) after scaling
  int32_t causal;        // 1: bottom-right causal (without a custom mask); 0: every key
  int32_t chunk_size;    // 0: off; else a query at p sees keys (p / chunk) * chunk ..= p
  int32_t cascade;       // 1: requests whose page tables start with the same pages read them
                         // once (a plan property: na_run does not compare it)
} NaConfig;

// Why na_plan_create refused a batch: `field` (NA_E_*), the request (-1: none) and values.
// The codes are listed once, here (X-macros): the enum below and na_codes() are built from
// the same list, and Python's mirror (NaField) is compared with na_codes() at load.
#define NA_ERROR_FIELDS(X)                                                                  \
  X(NA_E_NONE, 0)                                                                           \
  X(NA_E_CONFIG, 1)      /* the NaPlanArgs themselves: a NULL array, a negative count */   \
  X(NA_E_QO_INDPTR, 2)                                                                      \
  X(NA_E_KV_INDPTR, 3)                                                                      \
  X(NA_E_KV_LENS, 4)                                                                        \
  X(NA_E_KV_INDICES, 5)                                                                     \
  X(NA_E_DECODE_QLEN, 6)                                                                    \
  X(NA_E_MASK, 7)                                                                           \
  X(NA_E_TOO_LARGE, 8)                                                                      \
  X(NA_E_NO_MEMORY, 9)                                                                      \
  X(NA_E_INTERNAL, 10)   /* the planner's own invariant failed (a bug, never the input) */
#define NA_ENUM_ITEM_(name, value) name = value,
enum { NA_ERROR_FIELDS(NA_ENUM_ITEM_) };
typedef struct {
  int32_t field, request;
  int64_t a, b;
} NaError;

typedef struct {
  int64_t num_tokens, num_requests, max_page, num_items, num_merges, scratch_rows;
  // Cascade: groups of requests sharing leading pages, the requests in them, and the shared
  // keys (summed over groups) read once per group instead of once per request.
  int64_t cascade_groups, cascade_requests, cascade_keys;
} NaPlanInfo;

// One batch to plan. qo_indptr, kv_indptr [B+1], kv_lens [B], kv_indices [num_indices],
// mask (bytes, NULL: causal) [mask_len]. decode: every request has one query. split_target:
// split-KV aims for at least this many work items.
typedef struct {
  int32_t num_requests, decode, split_target, reserved;
  const int32_t* qo_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_indices;
  int64_t num_indices;
  const int32_t* kv_lens;
  const uint8_t* mask;
  int64_t mask_len;
} NaPlanArgs;

// One layer call. Each tensor is described as torch holds it: its data, shape and strides (in
// elements) and its dtype (an NA_* code, -1 for any other), and whether it is host memory.
// na_run checks every description against the runner's config and the plan before any load,
// and refuses (NA_BAD_ARGS) a call whose tensors do not fit:
//   q [T, Hq, D] in the config's q dtype, T the plan's rows; its last two dims dense (stride
//     D and 1), its rows at any stride >= 0 (a column slice of a fused QKV projection: its
//     rows are copied into a buffer of the calling thread, packed);
//   k [k_pages, ps, Hkv, D] (MLA: [k_pages, ps, D], k_shape[3] = k_stride[3] = 0), v
//     [v_pages, ps, Hkv, Dv] (MLA: unused, NULL), both contiguous in the cache dtype, with
//     more pages than the plan's largest page index;
//   out [T, Hq, Dv] contiguous in q's dtype: out_numel its element count, exactly T*Hq*Dv.
// A stride of a dim of size 1 is not compared (torch leaves it free). The kernels never index
// past the tensors so described, whatever the plan says.
// sinks: NULL or float32 [sinks_numel >= Hq] (one logit per q head, joins the softmax
// denominator only). k_scale / v_scale: FP8 caches' dequantisation factors (1 otherwise; MLA
// uses k_scale for the latent, V included).
// lse: NULL or float32 [lse_numel == T * Hq]: each row's natural log of the sum of exp of its
// scores (sink included), -inf for a row that saw no key, NaN for a NaN row.
typedef struct {
  const void* q;
  const void* k;
  const void* v;
  void* out;
  const float* sinks;
  float* lse;
  int64_t q_shape[3], q_stride[3];
  int64_t k_shape[4], k_stride[4];
  int64_t v_shape[4], v_stride[4];
  int64_t out_numel, sinks_numel, lse_numel;
  int32_t q_dtype, k_dtype, v_dtype;  // NA_* codes of the tensors' dtypes; -1: another
  int32_t host;                       // 1: q, k, v and out are host (CPU) memory
  float sm_scale, k_scale, v_scale;
  int32_t num_threads;
} NaRunArgs;

// One KV cache write (na_kv_write): the rows of key and value for each slot of a slot
// mapping, into a K and a V cache of contract pages. Each tensor is described as torch holds
// it (data, shape and strides in elements, dtype code), like NaRunArgs:
//   key, value [T, H, D] with T >= num_slots (the first num_slots rows are written), any
//     strides >= 0 (a column slice of a fused QKV projection: rows far apart);
//   k_cache, v_cache [pages, ps, H, D], contiguous, of the same shape;
//   all four of one dtype: NA_F32, NA_BF16 or NA_F16 (FP8 caches are written by the caller);
//   slots [num_slots] int64 at stride slots_stride >= 0: slot s >= 0 is token row s % ps of
//     block s / ps, whose K row is page (s / ps) * page_step of k_cache, row s % ps (its V
//     row the same of v_cache); a negative slot is padding (that token is not written).
// page_step >= 1: 1 for caches of one page per block; 2 for K and V pages interleaved in one
// layer's memory (vLLM's CPU layout seen as pages: v_cache is k_cache shifted by one page).
typedef struct {
  // What changes per call: the tokens' rows and their slots.
  const void* key;
  const void* value;
  const int64_t* slots;
  int64_t key_shape[3], key_stride[3];
  int64_t value_shape[3], value_stride[3];
  int64_t num_slots, slots_stride;
  int32_t key_dtype, value_dtype;  // NA_* codes; -1: another dtype
  int32_t host;                    // 1: key, value and slots are host (CPU) memory
  int32_t reserved;
  // The caches (a caller may pack this half once per cache and reuse it).
  void* k_cache;
  void* v_cache;
  int64_t k_shape[4], k_stride[4];
  int64_t v_shape[4], v_stride[4];
  int64_t page_step;
  int32_t k_dtype, v_dtype;  // NA_* codes; -1: another dtype
  int32_t cache_host;        // 1: both caches are host (CPU) memory
  int32_t reserved2;
} NaKvWriteArgs;

// One serving step's batch index arrays (na_step_index), from the engine's own tensors as
// vLLM hands them: request i's query rows are query_start_loc[i] .. query_start_loc[i+1],
// it holds seq_lens[i] tokens (cached and new), in blocks block_table[i][0 ..] of block_size
// tokens. Each tensor is described as torch holds it (data, shape and strides in elements,
// dtype code: 0 int32, 1 int64; any other is refused):
//   query_start_loc [R + 1] (R >= 0), seq_lens [R], block_table [rows >= R, cols].
// A step is taken only when every rule holds (else NA_BAD_ARGS and nothing is said about
// why: the caller's own checks name the problem):
//   query_start_loc[0] >= 0 and never decreasing; seq_lens[i] >= its query length;
//   a request with a query token reads need = ceil(seq_lens[i] / block_size) <= cols blocks,
//   each id in [0, 2^30) (its pages 2b and 2b + 1 stay int32); one without reads none;
//   every value of the arrays below fits int32.
// out (int32, out_capacity elements) receives, for all R requests, qo_indptr [R + 1] (query
// offsets from 0) | kv_indptr [R + 1] (running sum of the blocks read) | kv_lens [R] |
// kv_indices [num_pages] (2 * block id: the K page of each block read, V the next page);
// out_used = 3R + 2 + num_pages. A buffer shorter than that gets NA_SHORT_BUFFER with
// out_used filled and nothing else promised: call again with that many.
typedef struct {
  const void* query_start_loc;
  const void* seq_lens;
  const void* block_table;
  int32_t* out;
  int64_t qsl_numel, qsl_stride;
  int64_t seq_numel, seq_stride;
  int64_t bt_shape[2], bt_stride[2];
  int64_t block_size, out_capacity;
  int32_t qsl_dtype, seq_dtype, bt_dtype;  // 0: int32, 1: int64; -1: another
  int32_t host;                            // 1: the three tensors are host (CPU) memory
} NaStepArgs;

// What na_step_index found: the first query row (query_start_loc[0]), the query rows in all
// (query_start_loc[R] - query_start_loc[0]), the shortest and longest query, the longest
// sequence, the smallest seq_lens[i] - query length (0 without requests), the blocks read.
typedef struct {
  int64_t num_requests, first_token, num_tokens, min_q, max_q, max_kv, min_cached;
  int64_t num_pages, out_used;
} NaStepInfo;

// Return codes of the entry points below (listed once, like NA_ERROR_FIELDS; Python's
// NaStatus is compared with na_codes() at load).
#define NA_RETURN_CODES(X)                                                                   \
  X(NA_OK, 0)                                                                                \
  X(NA_BAD_ARGS, -1)       /* a tensor that does not fit the config or the plan */        \
  X(NA_NO_MEMORY, -2)      /* a per-thread buffer could not be allocated */                  \
  X(NA_UNKNOWN_PLAN, -3)   /* never issued, or freed */                                      \
  X(NA_FOREIGN_PLAN, -4)   /* a live plan of another runner */                               \
  X(NA_UNKNOWN_RUNNER, -5) /* never created, or freed */                                     \
  X(NA_BAD_CONFIG, -6)     /* na_runner_create: the config is refused */                     \
  X(NA_BAD_THREADS, -7)    /* na_run: num_threads < 1 */                                    \
  X(NA_SHORT_BUFFER, -8)   /* na_step_index: out holds fewer than out_used elements */
enum { NA_RETURN_CODES(NA_ENUM_ITEM_) };

// A runner: one backend object's config, kept by the library. *runner receives its id.
NA_API int na_runner_create(const NaConfig* cfg, uint64_t* runner);
// Frees the runner and every plan it still has; an unknown id is ignored.
NA_API void na_runner_free(uint64_t runner);

// Validates and plans one batch for `runner`. Returns NA_OK with *plan and *info filled,
// NA_UNKNOWN_RUNNER, NA_NO_MEMORY, or NA_BAD_ARGS with *err naming the refused field.
NA_API int na_plan_create(uint64_t runner, const NaPlanArgs* args, uint64_t* plan,
                          NaPlanInfo* info, NaError* err);
// Frees a plan of `runner`: NA_OK, or NA_UNKNOWN_PLAN / NA_FOREIGN_PLAN (nothing freed).
NA_API int na_plan_free(uint64_t runner, uint64_t plan);

// Runs one layer with a live plan of `runner`. Returns NA_OK or a code above. Calls on
// different runners (or plans) from different threads run concurrently: the id tables are
// read under a shared lock, and each caller gets worker threads of its own.
NA_API int na_run(uint64_t runner, uint64_t plan, const NaRunArgs* args);

// Writes key and value rows at their slots (NaKvWriteArgs). Every description and every slot
// is checked before the first byte is written: NA_OK, or NA_BAD_ARGS with nothing written and
// *bad_slot (when not NULL) the index of the first slot outside the caches (its page index
// past the last page), or -1 when the tensors themselves do not fit (shape, strides, dtype,
// host, page_step).
NA_API int na_kv_write(const NaKvWriteArgs* args, int64_t* bad_slot);

// One step's batch index arrays (NaStepArgs): NA_OK with out and *info filled,
// NA_SHORT_BUFFER (info->out_used says how many elements out needs), or NA_BAD_ARGS (a rule
// above broken; nothing promised about out or *info).
NA_API int na_step_index(const NaStepArgs* args, NaStepInfo* info);

// Instruction-set path: name of the one in use, and forcing one ("generic", "avx2",
// "avx512", "avx512bf16"); returns 0 when set, -1 when this CPU/build lacks it.
NA_API const char* na_isa(void);
NA_API int na_set_isa(const char* name);
NA_API const char* na_isa_list(void);  // comma-separated paths this CPU and build can run
NA_API int32_t na_abi_version(void);  // NA_ABI_VERSION
// sizeof the named struct of this header ("NaConfig", "NaError", "NaPlanInfo", "NaPlanArgs",
// "NaRunArgs", "NaKvWriteArgs", "NaStepArgs", "NaStepInfo"); -1 for a name
// this library does not have. The Python mirror refuses a library whose sizes differ from its.
NA_API int64_t na_struct_size(const char* name);
// Every code of NA_RETURN_CODES and NA_ERROR_FIELDS as "NAME=value" pairs joined by commas,
// in the order listed: what the Python mirror checks its enums against at load.
NA_API const char* na_codes(void);
// From now on, run work items on the library's own pool, never on an OpenMP team found in the
// process. The library does this by itself in a child forked after it was loaded (an OpenMP
// team does not survive fork: its threads are gone, and waiting on them hangs); a loader that
// knows the process was forked before the library was loaded calls this first.
NA_API void na_use_own_pool(void);

#ifdef __cplusplus
}
#endif
#endif
