// The C entry points: the runner and plan id tables, planning and running one layer.
#include <pthread.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "internal.h"

namespace {

// The library's tables of live runners and plans. Ids are a 64-bit counter passed through a
// bijective mixer keyed per process, so they are never reused (a freed id stays dead) and
// not guessable from one another. The maps are leaked on purpose: no destructor runs at exit
// while another thread may still be inside na_run.
//
// Read-mostly: na_run (once per layer) only looks ids up, under a shared lock, so calls from
// several threads never wait for each other there; creating and freeing runners and plans
// (once per forward) take the lock exclusively, for a few map operations only (a plan is
// built before the lock is taken and destroyed after it is released).
struct PlanEntry {
  std::shared_ptr<const NaPlan> plan;
  uint64_t runner;
};
std::shared_mutex* g_table_mu = new std::shared_mutex();
// fork() while another thread holds the table lock would leave the child's copy locked
// forever: hold it across fork, so the tables are copied whole and unchanged. The parent
// unlocks it; the child takes a fresh lock instead (a reader-writer lock records its writer's
// thread id, which the forking thread no longer has in the child: unlocking it there would
// release a read lock it never took, and the next caller would wait forever).
const int g_table_atfork = pthread_atfork([] { g_table_mu->lock(); },
                                          [] { g_table_mu->unlock(); },
                                          [] { g_table_mu = new std::shared_mutex(); });
auto* g_runners = new std::unordered_map<uint64_t, NaConfig>();
auto* g_plans = new std::unordered_map<uint64_t, PlanEntry>();
uint64_t g_next_id = 0, g_id_key = 0;

uint64_t mix64(uint64_t x) {  // splitmix64's finaliser: a bijection on 64-bit values
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

uint64_t new_id_locked() {
  if (g_id_key == 0) {
    std::random_device rd;
    g_id_key = (uint64_t(rd()) << 32 | rd()) ^ uint64_t(reinterpret_cast<uintptr_t>(&g_next_id));
  }
  for (;;) {
    const uint64_t id = mix64(++g_next_id ^ g_id_key);
    if (id != 0 && !g_runners->count(id) && !g_plans->count(id)) return id;
  }
}

// The calling thread's scratch for split-KV partial results: each call has its own, so
// threads sharing one plan never share it.
thread_local std::vector<float> tls_scratch;
// The calling thread's copy of a q whose rows are strided (a column slice of a fused QKV
// projection), rows packed: the kernels read q's rows Hq * D apart.
thread_local std::vector<unsigned char> tls_q;

// q as the kernels read it: itself when its T rows of `row` elements are packed (or there is
// at most one), else the rows copied into tls_q (a few hundred bytes per token: far cheaper
// than the copy torch makes). NULL when that buffer cannot be had.
const void* gathered_q(const void* q, int64_t row_stride, int64_t T, int64_t row, size_t elem) {
  if (T <= 1 || row_stride == row) return q;
  const size_t bytes = size_t(row) * elem;
  try {
    if (tls_q.size() < size_t(T) * bytes) tls_q.resize(size_t(T) * bytes);
  } catch (const std::bad_alloc&) {
    return nullptr;
  }
  const auto* src = static_cast<const unsigned char*>(q);
  for (int64_t t = 0; t < T; ++t) {
    std::memcpy(tls_q.data() + size_t(t) * bytes, src + size_t(t * row_stride) * elem, bytes);
  }
  return tls_q.data();
}

// One dim of a described tensor: its size, and its stride unless the size is 1 (free in torch).
bool dim_is(int64_t size, int64_t stride, int64_t want_size, int64_t want_stride) {
  return size == want_size && (size == 1 || stride == want_stride);
}

// The call's tensors, as described, fit the runner's config and the plan: q [T, Hq, D] with
// dense heads and rows at a stride >= 0, k (and v) contiguous caches with more pages than the
// plan's largest page index, out exactly T * Hq * Dv elements, every dtype the config's, all
// host memory. Every later index of the kernels stays inside what these describe.
bool tensors_fit(const NaRunArgs& a, const NaConfig& c, const NaPlan& plan) {
  const bool mla = c.kind == NA_MLA;
  const int64_t T = plan.num_tokens, Hq = c.num_q_heads, D = c.head_dim, Dv = c.v_head_dim;
  const int64_t ps = c.page_size, Hkv = mla ? 1 : c.num_kv_heads;
  if (a.host != 1) return false;
  if (a.q_dtype != c.q_dtype || a.k_dtype != c.kv_dtype) return false;
  if (!mla && a.v_dtype != c.kv_dtype) return false;
  // q: [T, Hq, D], heads and dims dense, rows at any stride >= 0 (an empty q: any strides).
  if (a.q_shape[0] != T || a.q_shape[1] != Hq || a.q_shape[2] != D) return false;
  if (T > 0 && (a.q_stride[0] < 0 || !dim_is(Hq, a.q_stride[1], Hq, D) ||
                !dim_is(D, a.q_stride[2], D, 1))) {
    return false;
  }
  if (a.out_numel != T * Hq * Dv) return false;
  // A cache: [pages, ps, Hkv, width] (MLA: [pages, ps, width]), contiguous, pages > max_page.
  auto cache_ok = [&](const int64_t* shape, const int64_t* stride, int64_t width) {
    const int64_t pages = shape[0];
    if (pages < 0 || pages <= plan.max_page) return false;
    if (pages == 0) {  // empty (so contiguous whatever its strides): the plan reads no page
      return shape[1] == ps && (mla ? shape[2] == width && shape[3] == 0
                                    : shape[2] == Hkv && shape[3] == width);
    }
    if (mla) {
      return shape[3] == 0 && stride[3] == 0 && dim_is(shape[2], stride[2], width, 1) &&
             dim_is(shape[1], stride[1], ps, width) && dim_is(pages, stride[0], pages, ps * width);
    }
    return dim_is(shape[3], stride[3], width, 1) && dim_is(shape[2], stride[2], Hkv, width) &&
           dim_is(shape[1], stride[1], ps, Hkv * width) &&
           dim_is(pages, stride[0], pages, ps * Hkv * width);
  };
  if (!cache_ok(a.k_shape, a.k_stride, D)) return false;
  if (!mla && (!cache_ok(a.v_shape, a.v_stride, Dv) || a.v_shape[0] != a.k_shape[0])) return false;
  return true;
}

// A KV write's tensors, as described, fit one another (see NaKvWriteArgs): key and value
// [>= num_slots, H, D] with strides >= 0, both caches contiguous [pages, ps, H, D] of one
// shape, one 16- or 32-bit float dtype everywhere, host memory, page_step >= 1. Every row the
// write then reads or writes lies inside what these describe.
bool kv_write_fits(const NaKvWriteArgs& a) {
  if (a.host != 1 || a.cache_host != 1 || a.num_slots < 0 || a.slots_stride < 0 || a.page_step < 1) return false;
  const int32_t dt = a.k_dtype;
  if (dt != NA_F32 && dt != NA_BF16 && dt != NA_F16) return false;
  if (a.key_dtype != dt || a.value_dtype != dt || a.v_dtype != dt) return false;
  for (int i = 0; i < 4; ++i) {
    if (a.k_shape[i] < 0 || a.v_shape[i] != a.k_shape[i]) return false;
  }
  const int64_t pages = a.k_shape[0], ps = a.k_shape[1], H = a.k_shape[2], D = a.k_shape[3];
  if (ps < 1) return false;  // a slot's block is s / ps
  for (const int64_t* st : {a.k_stride, a.v_stride}) {
    if (!dim_is(D, st[3], D, 1) || !dim_is(H, st[2], H, D) || !dim_is(ps, st[1], ps, H * D) ||
        !dim_is(pages, st[0], pages, ps * H * D)) {
      return false;
    }
  }
  const int64_t* shapes[2] = {a.key_shape, a.value_shape};
  const int64_t* strides[2] = {a.key_stride, a.value_stride};
  for (int t = 0; t < 2; ++t) {
    if (shapes[t][0] < a.num_slots || shapes[t][1] != H || shapes[t][2] != D) return false;
    for (int i = 0; i < 3; ++i) {
      if (strides[t][i] < 0) return false;
    }
  }
  if (a.num_slots > 0 && (a.slots == nullptr || a.key == nullptr || a.value == nullptr)) {
    return false;
  }
  if (pages > 0 && (a.k_cache == nullptr || a.v_cache == nullptr)) return false;
  return true;
}

// Element i of a 1-D integer tensor (int32 or int64, checked by the caller) at a stride.
inline int64_t step_value(const void* data, int32_t dtype, int64_t offset) {
  return dtype == 0 ? int64_t(static_cast<const int32_t*>(data)[offset])
                    : static_cast<const int64_t*>(data)[offset];
}

constexpr int64_t kStepInt32Max = 2147483647;
constexpr int64_t kStepMaxBlockId = int64_t(1) << 30;  // pages 2b and 2b + 1 stay int32

// One token's [H, D] rows from a tensor at the given strides into a contiguous row.
void copy_token_row(unsigned char* dst, const unsigned char* src, const int64_t* stride,
                    int64_t H, int64_t D, size_t elem) {
  if (stride[2] == 1 || D == 1) {
    if (stride[1] == D || H == 1) {
      std::memmove(dst, src, size_t(H * D) * elem);
      return;
    }
    for (int64_t h = 0; h < H; ++h) {
      std::memmove(dst + size_t(h * D) * elem, src + size_t(h * stride[1]) * elem,
                   size_t(D) * elem);
    }
    return;
  }
  for (int64_t h = 0; h < H; ++h) {
    for (int64_t d = 0; d < D; ++d) {
      std::memmove(dst + size_t(h * D + d) * elem,
                   src + size_t(h * stride[1] + d * stride[2]) * elem, elem);
    }
  }
}

}  // namespace

extern "C" {

int32_t na_abi_version(void) { return NA_ABI_VERSION; }

int64_t na_struct_size(const char* name) {
  if (name == nullptr) return -1;
  if (std::strcmp(name, "NaConfig") == 0) return int64_t(sizeof(NaConfig));
  if (std::strcmp(name, "NaError") == 0) return int64_t(sizeof(NaError));
  if (std::strcmp(name, "NaPlanInfo") == 0) return int64_t(sizeof(NaPlanInfo));
  if (std::strcmp(name, "NaPlanArgs") == 0) return int64_t(sizeof(NaPlanArgs));
  if (std::strcmp(name, "NaRunArgs") == 0) return int64_t(sizeof(NaRunArgs));
  if (std::strcmp(name, "NaKvWriteArgs") == 0) return int64_t(sizeof(NaKvWriteArgs));
  if (std::strcmp(name, "NaStepArgs") == 0) return int64_t(sizeof(NaStepArgs));
  if (std::strcmp(name, "NaStepInfo") == 0) return int64_t(sizeof(NaStepInfo));
  return -1;
}

const char* na_codes(void) {
  static const std::string codes = [] {
    std::string s;
#define NA_CODE_TEXT_(name, value) s += std::string(s.empty() ? "" : ",") + #name "=" #value;
    NA_RETURN_CODES(NA_CODE_TEXT_)
    NA_ERROR_FIELDS(NA_CODE_TEXT_)
#undef NA_CODE_TEXT_
    return s;
  }();
  return codes.c_str();
}

}  // extern "C"

extern "C" {

int na_runner_create(const NaConfig* cfg, uint64_t* runner) {
  if (cfg == nullptr || runner == nullptr || !na::config_ok(*cfg)) return NA_BAD_CONFIG;
  try {
    std::unique_lock<std::shared_mutex> lk(*g_table_mu);
    const uint64_t id = new_id_locked();
    g_runners->emplace(id, *cfg);
    *runner = id;
  } catch (const std::bad_alloc&) {
    return NA_NO_MEMORY;
  }
  return NA_OK;
}

void na_runner_free(uint64_t runner) {
  std::vector<std::shared_ptr<const NaPlan>> dead;  // destroyed after the lock is released
  std::unique_lock<std::shared_mutex> lk(*g_table_mu);
  if (g_runners->erase(runner) == 0) return;
  for (auto it = g_plans->begin(); it != g_plans->end();) {
    if (it->second.runner != runner) {
      ++it;
      continue;
    }
    try {
      dead.push_back(std::move(it->second.plan));
    } catch (const std::bad_alloc&) {  // destroyed here instead: still freed, only later
    }
    it = g_plans->erase(it);
  }
}

int na_plan_create(uint64_t runner, const NaPlanArgs* a, uint64_t* plan_id, NaPlanInfo* info,
                   NaError* err) {
  if (err) *err = NaError{0, -1, 0, 0};
  NaConfig cfg;
  {
    std::shared_lock<std::shared_mutex> lk(*g_table_mu);
    auto found = g_runners->find(runner);
    if (found == g_runners->end()) return NA_UNKNOWN_RUNNER;
    cfg = found->second;
  }
  if (a == nullptr || plan_id == nullptr || info == nullptr || a->num_requests < 0 ||
      a->num_indices < 0 || a->qo_indptr == nullptr || a->kv_indptr == nullptr ||
      (a->num_requests > 0 && a->kv_lens == nullptr) ||
      (a->num_indices > 0 && a->kv_indices == nullptr) ||
      (a->mask == nullptr && a->mask_len != 0) || a->mask_len < 0) {
    if (err) *err = NaError{NA_E_CONFIG, -1, 0, 0};
    return NA_BAD_ARGS;
  }
  std::shared_ptr<NaPlan> P;
  try {
    P = std::make_shared<NaPlan>();
    P->cfg = cfg;
    if (na::build_plan(*P, *a, err) != 0) return NA_BAD_ARGS;
    *info = NaPlanInfo{P->num_tokens,    P->num_requests,
                       P->max_page,      int64_t(P->items.size()),
                       int64_t(P->merges.size()), P->scratch_rows,
                       P->cascade_groups, P->cascade_requests,
                       P->cascade_keys};
    std::unique_lock<std::shared_mutex> lk(*g_table_mu);
    if (!g_runners->count(runner)) return NA_UNKNOWN_RUNNER;  // freed meanwhile
    const uint64_t id = new_id_locked();
    g_plans->emplace(id, PlanEntry{std::move(P), runner});
    *plan_id = id;
  } catch (const std::bad_alloc&) {
    if (err) *err = NaError{NA_E_NO_MEMORY, -1, 0, 0};
    return NA_NO_MEMORY;
  }
  return NA_OK;
}

int na_plan_free(uint64_t runner, uint64_t plan) {
  std::shared_ptr<const NaPlan> dead;  // destroyed after the lock is released
  std::unique_lock<std::shared_mutex> lk(*g_table_mu);
  auto found = g_plans->find(plan);
  if (found == g_plans->end()) return NA_UNKNOWN_PLAN;
  if (found->second.runner != runner) return NA_FOREIGN_PLAN;
  dead = std::move(found->second.plan);
  g_plans->erase(found);
  return NA_OK;
}

int na_run(uint64_t runner, uint64_t plan_id, const NaRunArgs* a) {
  std::shared_ptr<const NaPlan> held;  // keeps the plan alive through the call, freed or not
  {
    std::shared_lock<std::shared_mutex> lk(*g_table_mu);
    if (!g_runners->count(runner)) return NA_UNKNOWN_RUNNER;
    auto found = g_plans->find(plan_id);
    if (found == g_plans->end()) return NA_UNKNOWN_PLAN;
    if (found->second.runner != runner) return NA_FOREIGN_PLAN;
    held = found->second.plan;
  }
  if (a == nullptr) return NA_BAD_ARGS;
  const NaPlan* plan = held.get();
  const NaConfig& c = plan->cfg;
  const bool mla = c.kind == NA_MLA;
  const int32_t num_threads = a->num_threads;
  if (num_threads < 1) return NA_BAD_THREADS;
  // Every tensor as its description says, against the config and the plan, before any load.
  if (!tensors_fit(*a, c, *plan)) return NA_BAD_ARGS;
  const void *q = a->q, *k = a->k, *v = a->v;
  void* out = a->out;
  const int64_t sinks_numel = a->sinks_numel, lse_numel = a->lse_numel;
  const float* sinks = a->sinks;
  float* lse = a->lse;
  const float sm_scale = a->sm_scale, k_scale = a->k_scale, v_scale = a->v_scale;
  // out and lse hold exactly the plan's rows: every one of them is written below.
  const int64_t T = plan->num_tokens, Hq = c.num_q_heads;
  if (lse != nullptr && lse_numel != T * Hq) return NA_BAD_ARGS;
  if (sinks != nullptr && sinks_numel < Hq) return NA_BAD_ARGS;
  if (plan->items.empty()) return NA_OK;
  if (q == nullptr || k == nullptr || out == nullptr || (!mla && v == nullptr)) return NA_BAD_ARGS;
  NaProblem p{};
  p.q = gathered_q(q, a->q_stride[0], T, Hq * c.head_dim, c.q_dtype == NA_F32 ? 4 : 2);
  if (p.q == nullptr) return NA_NO_MEMORY;
  p.k = k;
  p.v = mla ? nullptr : v;
  p.out = out;
  p.q_dtype = c.q_dtype;
  p.kv_dtype = c.kv_dtype;
  p.kind = c.kind;
  p.num_q_heads = c.num_q_heads;
  p.num_kv_heads = c.num_kv_heads;
  p.head_dim = c.head_dim;
  p.v_head_dim = c.v_head_dim;
  p.page_size = c.page_size;
  p.sm_scale = sm_scale;
  p.window_left = c.window_left;
  p.logit_cap = c.logit_cap;
  p.sinks = sinks;
  const bool fp8 = c.kv_dtype == NA_E4M3 || c.kv_dtype == NA_E5M2;
  p.k_scale = fp8 ? k_scale : 1.0f;
  p.v_scale = fp8 ? (mla ? k_scale : v_scale) : 1.0f;
  p.causal = plan->causal;
  p.noncausal = plan->causal && !c.causal;
  p.chunk_size = c.chunk_size;
  p.qo_indptr = plan->qo.data();
  p.kv_indptr = plan->kvp.data();
  p.kv_indices = plan->idx.data();
  p.kv_lens = plan->lens.data();
  p.mask = plan->causal ? nullptr : plan->mask.data();
  p.mask_indptr = plan->causal ? nullptr : plan->mask_indptr.data();
  p.scratch_rows = plan->scratch_rows;
  p.lse = lse;
  p.ctoks = plan->ctoks.data();
  {
    const int64_t elem = c.kv_dtype == NA_F32 ? 4 : (fp8 ? 1 : 2);
    const int64_t row = mla ? int64_t(c.head_dim) * elem
                            : int64_t(c.num_kv_heads) * (c.head_dim + c.v_head_dim) * elem;
    // kv_keys <= 2^31 * requests, row < 2^31: compared by division, no product to overflow
    p.lean_prefetch = plan->kv_keys <= na::kLeanPrefetchBytes / row ? 1 : 0;
  }
  if (!plan->merges.empty()) {
    try {
      const size_t need = size_t(plan->scratch_rows) * (size_t(c.v_head_dim) + 1);
      if (tls_scratch.size() < need) tls_scratch.resize(need);
    } catch (const std::bad_alloc&) {
      return NA_NO_MEMORY;
    }
    p.scratch = tls_scratch.data();
  }
  const na::Kernels* kern = na::kernels();
  const int items = na::parallel_items(num_threads, int(plan->items.size()),
                                       [&](int i) { return kern->item(&p, &plan->items[i]); });
  if (items != 0) return items;
  return na::parallel_items(num_threads, int(plan->merges.size()),
                            [&](int i) { return kern->merge(&p, &plan->merges[i]); });
}

int na_step_index(const NaStepArgs* a, NaStepInfo* info) {
  if (a == nullptr || info == nullptr || a->host != 1) return NA_BAD_ARGS;
  for (const int32_t dt : {a->qsl_dtype, a->seq_dtype, a->bt_dtype}) {
    if (dt != 0 && dt != 1) return NA_BAD_ARGS;
  }
  const int64_t R = a->qsl_numel - 1, bs = a->block_size;
  const int64_t rows = a->bt_shape[0], cols = a->bt_shape[1];
  // R < 2^30: the offsets and out_used below cannot overflow.
  if (R < 0 || R >= kStepMaxBlockId || a->seq_numel != R || bs < 1 || rows < R || cols < 0 ||
      a->qsl_stride < 0 || a->seq_stride < 0 || a->bt_stride[0] < 0 || a->bt_stride[1] < 0 ||
      a->query_start_loc == nullptr || (R > 0 && a->seq_lens == nullptr) ||
      a->out_capacity < 0 || (a->out_capacity > 0 && a->out == nullptr)) {
    return NA_BAD_ARGS;
  }
  // Pass 1: the lengths, each read once and checked; written into out when it holds them
  // (a short buffer still learns out_used). Pass 2 reads the blocks from those values.
  const bool write = a->out_capacity >= 3 * R + 2;
  int32_t* qo = a->out;
  int32_t* kvp = write ? qo + (R + 1) : nullptr;
  int32_t* lens = write ? kvp + (R + 1) : nullptr;
  const int64_t first = step_value(a->query_start_loc, a->qsl_dtype, 0);
  if (first < 0) return NA_BAD_ARGS;
  int64_t prev = first, min_q = R > 0 ? kStepInt32Max : 0, max_q = 0, max_kv = 0;
  int64_t min_cached = R > 0 ? kStepInt32Max : 0, pages = 0;
  if (write) qo[0] = kvp[0] = 0;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t next = step_value(a->query_start_loc, a->qsl_dtype, (i + 1) * a->qsl_stride);
    const int64_t kv = step_value(a->seq_lens, a->seq_dtype, i * a->seq_stride);
    // Both offsets >= 0, so next - prev cannot overflow; kv >= q >= 0 follows.
    if (next < prev || next - first > kStepInt32Max) return NA_BAD_ARGS;
    const int64_t q = next - prev;
    if (kv < q || kv > kStepInt32Max) return NA_BAD_ARGS;
    const int64_t need = q > 0 ? kv / bs + (kv % bs != 0 ? 1 : 0) : 0;
    if (need > cols) return NA_BAD_ARGS;
    pages += need;  // need <= kv < 2^31 and pages < 2^31 before: no overflow
    if (pages > kStepInt32Max) return NA_BAD_ARGS;
    if (q < min_q) min_q = q;
    if (q > max_q) max_q = q;
    if (kv > max_kv) max_kv = kv;
    if (kv - q < min_cached) min_cached = kv - q;
    if (write) {
      qo[i + 1] = int32_t(next - first);
      kvp[i + 1] = int32_t(pages);
      lens[i] = int32_t(kv);
    }
    prev = next;
  }
  if (pages > 0 && a->block_table == nullptr) return NA_BAD_ARGS;
  *info = NaStepInfo{R, first, prev - first, min_q, max_q, max_kv, min_cached, pages,
                     3 * R + 2 + pages};
  if (a->out_capacity < info->out_used) return NA_SHORT_BUFFER;
  // Pass 2: each request's blocks (kvp, written above from checked values), ids checked.
  int32_t* idx = lens + R;
  const int64_t esize = a->bt_dtype == 0 ? 4 : 8;
  for (int64_t i = 0; i < R; ++i) {
    const char* row = static_cast<const char*>(a->block_table) + esize * (i * a->bt_stride[0]);
    for (int64_t c = kvp[i]; c < kvp[i + 1]; ++c) {
      const int64_t b = step_value(row, a->bt_dtype, (c - kvp[i]) * a->bt_stride[1]);
      if (b < 0 || b >= kStepMaxBlockId) return NA_BAD_ARGS;
      idx[c] = int32_t(2 * b);
    }
  }
  return NA_OK;
}

int na_kv_write(const NaKvWriteArgs* a, int64_t* bad_slot) {
  if (bad_slot != nullptr) *bad_slot = -1;
  if (a == nullptr || !kv_write_fits(*a)) return NA_BAD_ARGS;
  const int64_t n = a->num_slots, pages = a->k_shape[0], ps = a->k_shape[1];
  const int64_t H = a->k_shape[2], D = a->k_shape[3], step = a->page_step;
  // Every slot first: nothing is written unless every page index is inside both caches.
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = a->slots[i * a->slots_stride];
    if (s < 0) continue;  // padding
    const int64_t block = s / ps;
    // block < pages first, so block * step cannot overflow (pages is a tensor's size).
    if (block >= pages || block * step >= pages) {
      if (bad_slot != nullptr) *bad_slot = i;
      return NA_BAD_ARGS;
    }
  }
  const size_t elem = a->k_dtype == NA_F32 ? 4 : 2;
  const size_t row_bytes = size_t(H * D) * elem;
  auto* kc = static_cast<unsigned char*>(a->k_cache);
  auto* vc = static_cast<unsigned char*>(a->v_cache);
  const auto* key = static_cast<const unsigned char*>(a->key);
  const auto* value = static_cast<const unsigned char*>(a->value);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t s = a->slots[i * a->slots_stride];
    if (s < 0) continue;
    const size_t row = size_t((s / ps) * step * ps + s % ps);
    copy_token_row(kc + row * row_bytes, key + size_t(i * a->key_stride[0]) * elem,
                   a->key_stride, H, D, elem);
    copy_token_row(vc + row * row_bytes, value + size_t(i * a->value_stride[0]) * elem,
                   a->value_stride, H, D, elem);
  }
  return NA_OK;
}

}  // extern "C"
