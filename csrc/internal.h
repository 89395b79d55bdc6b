// Internal: what the library's own files share. One concept per file:
//   pool.cpp  - running work items on torch's OpenMP team or a pool of our own (fork-aware)
//   isa.cpp   - the run-time instruction-set choice (and its C entry points)
//   plan.cpp  - config and batch validation, cascade grouping and the work split
//   api.cpp   - the runner/plan id tables and the remaining C entry points
#ifndef NATIVE_ATTN_INTERNAL_H
#define NATIVE_ATTN_INTERNAL_H
#include <cstdint>
#include <functional>
#include <vector>

#include "kernels.h"
#include "native_attn.h"

// One planned batch: private copies of every index array the kernels follow, the work items
// and merges, and what NaPlanInfo reports. Immutable once issued (shared between callers).
struct NaPlan {
  NaConfig cfg;
  int32_t split_target = 1;
  int32_t causal = 1;
  int32_t num_requests = 0;
  int64_t num_tokens = 0, max_page = -1, scratch_rows = 0;
  std::vector<int32_t> qo, kvp, idx, lens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> mask_indptr;
  std::vector<NaItem> items;
  std::vector<NaMerge> merges;
  std::vector<int32_t> ctoks;  // cascade tokens: (request, query index) pairs, by group
  int64_t cascade_groups = 0, cascade_requests = 0, cascade_keys = 0;
  int64_t kv_keys = 0;  // the requests' keys (sum of lens): a call's K/V bytes per key row
};

namespace na {

// pool.cpp: runs body(0) .. body(count - 1) on up to `threads` threads (the caller's among
// them) and returns when all have finished: 0, or the last non-zero code a body returned.
// Every item runs whatever another returned.
int parallel_items(int threads, int count, const std::function<int(int)>& body);

// isa.cpp: the kernel table in use (chosen at the first call, or pinned by na_set_isa).
const Kernels* kernels();

// plan.cpp: whether a runner may hold this config.
bool config_ok(const NaConfig& c);
// plan.cpp: fills P (whose cfg is set) from the batch: validates every index it will follow,
// copies it, and splits the work. Returns 0, or the NA_E_* code also written to *err.
int build_plan(NaPlan& P, const NaPlanArgs& args, NaError* err);

}  // namespace na

#endif
