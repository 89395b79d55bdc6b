// Internal: the per-instruction-set kernel tables and the tiling constants shared by the
// planner (native_attn.cpp) and the kernels (kernels_impl.h, compiled once per ISA).
#ifndef NATIVE_ATTN_KERNELS_H
#define NATIVE_ATTN_KERNELS_H
#include "native_attn.h"

namespace na {

// Keys per block: the softmax statistics are updated once per block.
constexpr int kBlockKeys = 32;
// Rows (query tokens x heads) per work item: bounds the per-thread accumulator to
// kMaxRows x Dv floats so it stays in L2.
constexpr int kMaxRows = 32;
// Split-KV never cuts a tile into chunks shorter than this many keys: below it the
// merge costs more than the parallelism gains.
constexpr int kMinSplitKeys = 256;
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
#endif
}

#endif
