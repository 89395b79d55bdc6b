// Planner, thread pool, run-time instruction-set choice and the C entry points.
#include "native_attn.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kernels.h"

namespace {

// A small persistent pool of our own. Not OpenMP: torch ships its own libgomp, and a second
// OpenMP runtime in the same process competes with it for the same cores (and some builds
// abort at load). Callers are serialised; ctypes releases the GIL, so two Python threads may
// call in at once.
class Pool {
 public:
  // Runs fn(0) .. fn(n-1), fn(0) on the calling thread; returns when all have finished.
  void run(int n, const std::function<void(int)>& fn) {
    std::lock_guard<std::mutex> serial(run_mu_);
    if (n <= 1) {
      fn(0);
      return;
    }
    {
      std::unique_lock<std::mutex> lk(mu_);
      while (nworkers_ < n - 1) {
        const int idx = ++nworkers_;
        std::thread([this, idx, seen = gen_] { worker(idx, seen); }).detach();
      }
      job_ = &fn;
      want_ = n;
      pending_ = n - 1;
      ++gen_;
    }
    cv_.notify_all();
    fn(0);
    std::unique_lock<std::mutex> lk(mu_);
    done_.wait(lk, [this] { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void worker(int idx, uint64_t seen) {
    std::unique_lock<std::mutex> lk(mu_);
    for (;;) {
      cv_.wait(lk, [&] { return gen_ != seen; });
      seen = gen_;
      if (idx >= want_) continue;
      const std::function<void(int)>* job = job_;
      lk.unlock();
      (*job)(idx);
      lk.lock();
      if (--pending_ == 0) done_.notify_all();
    }
  }

  std::mutex run_mu_;
  std::mutex mu_;
  std::condition_variable cv_, done_;
  const std::function<void(int)>* job_ = nullptr;
  uint64_t gen_ = 0;
  int want_ = 0, pending_ = 0, nworkers_ = 0;
};

Pool* g_pool = nullptr;
std::once_flag g_pool_once;

// A forked child has none of the parent's threads: forget the pool (leaked on purpose, its
// mutexes may be held by threads that no longer exist) and build a new one on first use.
void forget_pool_in_child() {
  g_pool = new Pool();
}

Pool& pool() {
  std::call_once(g_pool_once, [] {
    g_pool = new Pool();
    pthread_atfork(nullptr, nullptr, forget_pool_in_child);
  });
  return *g_pool;
}

bool cpu_has(const char* isa) {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  if (std::strcmp(isa, "avx2") == 0) {
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  }
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  if (std::strcmp(isa, "avx512") == 0) return avx512;
  if (std::strcmp(isa, "avx512bf16") == 0) {
    return avx512 && __builtin_cpu_supports("avx512bf16");
  }
#endif
  return std::strcmp(isa, "generic") == 0;
}

const na::Kernels* find_kernels(const char* name) {
  if (!cpu_has(name)) return nullptr;
  if (std::strcmp(name, "generic") == 0) return &na_kernels_generic;
#if defined(__x86_64__) || defined(_M_X64)
  if (std::strcmp(name, "avx2") == 0) return &na_kernels_avx2;
  if (std::strcmp(name, "avx512") == 0) return &na_kernels_avx512;
  if (std::strcmp(name, "avx512bf16") == 0) return &na_kernels_avx512bf16;
#endif
  return nullptr;
}

const char* const kIsaOrder[] = {"avx512bf16", "avx512", "avx2", "generic"};

const na::Kernels* best_kernels() {
  // NATIVE_ATTN_ISA=<name> pins a path (tests, comparisons); an unusable name is ignored.
  if (const char* env = std::getenv("NATIVE_ATTN_ISA")) {
    if (const na::Kernels* k = find_kernels(env)) return k;
  }
  for (const char* name : kIsaOrder) {
    if (const na::Kernels* k = find_kernels(name)) return k;
  }
  return &na_kernels_generic;
}

std::atomic<const na::Kernels*> g_kernels{nullptr};

const na::Kernels* kernels() {
  const na::Kernels* k = g_kernels.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = best_kernels();
    g_kernels.store(k, std::memory_order_release);
  }
  return k;
}

int ceil_div(int64_t a, int64_t b) { return int((a + b - 1) / b); }

}  // namespace

extern "C" {

int32_t na_abi_version(void) { return 4; }

const char* na_isa(void) { return kernels()->name; }

int na_set_isa(const char* name) {
  const na::Kernels* k = name ? find_kernels(name) : nullptr;
  if (k == nullptr) return -1;
  g_kernels.store(k, std::memory_order_release);
  return 0;
}

const char* na_isa_list(void) {
  static std::string list = [] {
    std::string s;
    for (const char* name : kIsaOrder) {
      if (find_kernels(name) == nullptr) continue;
      if (!s.empty()) s += ",";
      s += name;
    }
    return s;
  }();
  return list.c_str();
}

}  // extern "C"

struct NaPlan {
  NaConfig cfg;
  int32_t causal = 1;
  int32_t num_requests = 0;
  int64_t num_tokens = 0, max_page = -1, scratch_rows = 0;
  std::vector<int32_t> qo, kvp, idx, lens;
  std::vector<uint8_t> mask;
  std::vector<int64_t> mask_indptr;
  std::vector<NaItem> items;
  std::vector<NaMerge> merges;
};

namespace {

bool same_config(const NaConfig& a, const NaConfig& b) {
  return a.kind == b.kind && a.q_dtype == b.q_dtype && a.kv_dtype == b.kv_dtype &&
         a.num_q_heads == b.num_q_heads && a.num_kv_heads == b.num_kv_heads &&
         a.head_dim == b.head_dim && a.v_head_dim == b.v_head_dim && a.page_size == b.page_size &&
         a.window_left == b.window_left && a.logit_cap == b.logit_cap &&
         a.causal == b.causal && a.chunk_size == b.chunk_size;
}

bool config_ok(const NaConfig& c) {
  auto dtype_ok = [](int d) { return d == NA_F32 || d == NA_BF16 || d == NA_F16; };
  if (c.kind != NA_MHA && c.kind != NA_MLA) return false;
  if (!dtype_ok(c.q_dtype)) return false;
  if (!dtype_ok(c.kv_dtype) && c.kv_dtype != NA_E4M3 && c.kv_dtype != NA_E5M2) return false;
  if (c.window_left < -1 || c.chunk_size < 0 || (c.causal != 0 && c.causal != 1)) return false;
  // A non-causal layer sees every key: no window or chunk (AttnConfig refuses them too).
  if (!c.causal && (c.window_left >= 0 || c.chunk_size > 0)) return false;
  if (!(c.logit_cap >= 0.0f && c.logit_cap <= 3.0e38f)) return false;  // also refuses NaN
  if (c.num_q_heads <= 0 || c.num_kv_heads <= 0 || c.num_q_heads % c.num_kv_heads) return false;
  if (c.head_dim <= 0 || c.head_dim > na::kMaxHeadDim || c.v_head_dim <= 0 ||
      c.v_head_dim > na::kMaxHeadDim || c.page_size <= 0) {
    return false;
  }
  return c.kind != NA_MLA || (c.num_kv_heads == 1 && c.v_head_dim <= c.head_dim);
}

int fail(NaError* err, int field, int request, int64_t a = 0, int64_t b = 0) {
  if (err) *err = NaError{field, request, a, b};
  return field;
}

// Every check the kernels rely on, in one pass over the host arrays; copies what it reads.
int validate(NaPlan& P, const int32_t* qo, const int32_t* kvp, const int32_t* idx,
             int64_t num_indices, const int32_t* lens, const uint8_t* mask, int64_t mask_len,
             int32_t decode, NaError* err) {
  const int B = P.num_requests;
  const int ps = P.cfg.page_size;
  if (qo[0] != 0) return fail(err, NA_E_QO_INDPTR, -1, qo[0]);
  if (kvp[0] != 0) return fail(err, NA_E_KV_INDPTR, -1, kvp[0]);
  int64_t mask_total = 0;
  for (int i = 0; i < B; ++i) {
    const int64_t q_len = int64_t(qo[i + 1]) - qo[i];
    if (q_len < 0) return fail(err, NA_E_QO_INDPTR, i, qo[i], qo[i + 1]);
    const int64_t n_pages = int64_t(kvp[i + 1]) - kvp[i];
    if (n_pages < 0) return fail(err, NA_E_KV_INDPTR, i, kvp[i], kvp[i + 1]);
    if (kvp[i + 1] > num_indices) return fail(err, NA_E_KV_INDPTR, i, kvp[i + 1], num_indices);
    const int64_t kv_len = lens[i];
    if (kv_len < q_len) return fail(err, NA_E_KV_LENS, i, kv_len, q_len);
    if ((kv_len + ps - 1) / ps > n_pages) return fail(err, NA_E_KV_LENS, i, kv_len, n_pages);
    if (decode && q_len != 1) return fail(err, NA_E_DECODE_QLEN, i, q_len);
    mask_total += q_len * kv_len;
  }
  if (mask != nullptr && mask_total != mask_len) {
    return fail(err, NA_E_MASK, -1, mask_len, mask_total);
  }
  const int64_t used = B > 0 ? kvp[B] : 0;
  int32_t mx = -1;
  for (int i = 0; i < B; ++i) {
    for (int64_t j = kvp[i]; j < kvp[i + 1]; ++j) {
      if (idx[j] < 0) return fail(err, NA_E_KV_INDICES, i, idx[j], j);
      mx = std::max(mx, idx[j]);
    }
  }
  P.max_page = mx;
  P.num_tokens = B > 0 ? qo[B] : 0;
  P.qo.assign(qo, qo + B + 1);
  P.kvp.assign(kvp, kvp + B + 1);
  P.lens.assign(lens, lens + B);
  P.idx.assign(idx, idx + used);
  if (mask != nullptr) {
    P.causal = 0;
    P.mask.assign(mask, mask + mask_len);
    P.mask_indptr.resize(size_t(B) + 1);
    P.mask_indptr[0] = 0;
    for (int i = 0; i < B; ++i) {
      P.mask_indptr[i + 1] = P.mask_indptr[i] + int64_t(qo[i + 1] - qo[i]) * lens[i];
    }
    // A chunk on a custom (tree) mask: a query at sequence position p (its allowed keys - 1)
    // keeps the keys of its own chunk, the last p % chunk + 1 it allows (the reference's
    // chunk_tree_mask); folded in before the window, once per plan.
    const int64_t ck = P.cfg.chunk_size;
    if (ck > 0) {
      for (int i = 0; i < B; ++i) {
        const int64_t kl = lens[i];
        for (int64_t j = 0; j < int64_t(qo[i + 1] - qo[i]); ++j) {
          uint8_t* row = P.mask.data() + P.mask_indptr[i] + j * kl;
          int64_t count = 0;
          for (int64_t t = 0; t < kl; ++t) count += row[t] != 0;
          const int64_t keep = count > 0 ? (count - 1) % ck + 1 : 0;
          int64_t seen = 0;
          for (int64_t t = kl - 1; t >= 0; --t) {
            if (!row[t]) continue;
            if (++seen > keep) row[t] = 0;
          }
        }
      }
    }
    // A window on a custom (tree) mask: each query keeps the window_left + 1 most recent keys
    // its mask allows (the reference's window_tree_mask), folded in once per plan.
    const int64_t w = P.cfg.window_left;
    if (w >= 0) {
      for (int i = 0; i < B; ++i) {
        const int64_t kl = lens[i];
        for (int64_t j = 0; j < int64_t(qo[i + 1] - qo[i]); ++j) {
          uint8_t* row = P.mask.data() + P.mask_indptr[i] + j * kl;
          int64_t seen = 0;
          for (int64_t t = kl - 1; t >= 0; --t) {
            if (!row[t]) continue;
            if (++seen > w + 1) row[t] = 0;
          }
        }
      }
    }
  }
  return 0;
}

// The first key any query in [q0, q1) of request i may see: 0 without a window or chunk.
int first_key(const NaPlan& P, int i, int q0, int q1) {
  const int64_t w = P.cfg.window_left, ck = P.cfg.chunk_size;
  if (w < 0 && ck <= 0) return 0;
  const int q_len = P.qo[i + 1] - P.qo[i];
  const int kv_len = P.lens[i];
  if (P.causal) {
    // The block's first query has the earliest limit: its window or chunk start.
    const int64_t lim = int64_t(kv_len) - q_len + q0;
    int64_t lo = 0;
    if (w >= 0) lo = std::max(lo, lim - w);
    if (ck > 0) lo = std::max(lo, lim - lim % ck);
    return int(lo);
  }
  int first = kv_len;
  for (int j = q0; j < q1; ++j) {
    const uint8_t* row = P.mask.data() + P.mask_indptr[i] + int64_t(j) * kv_len;
    for (int t = 0; t < first; ++t) {
      if (row[t]) {
        first = t;
        break;
      }
    }
  }
  return first;
}

int make_items(NaPlan& P) {
  const NaConfig& c = P.cfg;
  const int B = P.num_requests;
  // A tile is (request, kv head, head block, query block); its rows share every K/V row read.
  const int group = c.num_q_heads / c.num_kv_heads;
  const int n_hblocks = ceil_div(group, na::kMaxRows);
  const int hb = ceil_div(group, n_hblocks);
  const int qb = std::max(1, na::kMaxRows / hb);
  // A request whose whole tile of one kv head is small (decode, short verify) takes several
  // kv heads per tile: each block of tokens is then read whole, in address order (a token's
  // heads are adjacent in the cache), instead of one head's 2 KB-strided rows per tile.
  auto heads_per_tile = [&](int q_len) {
    const int rows = group * q_len;
    if (n_hblocks != 1 || rows > na::kMaxRows / 2) return 1;
    return std::max(1, std::min(c.num_kv_heads, na::kMaxRows / rows));
  };
  int64_t tiles = 0;
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    tiles += int64_t(ceil_div(c.num_kv_heads, heads_per_tile(q_len))) * n_hblocks *
             ceil_div(q_len, qb);
  }
  // Split the keys only when the tiles alone cannot keep every thread busy. The target is
  // chosen by the caller from a fixed floor, so small thread counts plan the same splits.
  const int64_t target = std::max(1, c.split_target);
  const int want = tiles > 0 && tiles < target ? ceil_div(target, tiles) : 1;
  int64_t rows_used = 0;
  P.items.reserve(size_t(tiles) * size_t(want));
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    const int kv_len = P.lens[i];
    const int hpt = heads_per_tile(q_len);
    for (int g = 0; g < c.num_kv_heads; g += hpt) {
      const int g1 = std::min(c.num_kv_heads, g + hpt);
      for (int h0 = 0; h0 < group; h0 += hb) {
        const int h1 = std::min(group, h0 + hb);
        for (int q0 = 0; q0 < q_len; q0 += qb) {
          const int q1 = std::min(q_len, q0 + qb);
          const int rows = (g1 - g) * (h1 - h0) * (q1 - q0);
          // Causal: the tile's last query sees keys [0, kv_len - q_len + q1).
          const int kend = P.causal && P.cfg.causal
                               ? std::max(0, std::min(kv_len, kv_len - q_len + q1))
                               : kv_len;
          // Sliding window: keys before the first one any row of the tile may see are never
          // read (whole pages outside the window are skipped; decode reads window_left + 1).
          const int kstart = std::min(kend, first_key(P, i, q0, q1));
          const int span = kend - kstart;
          int nsplit = std::max(1, std::min(want, ceil_div(span, na::kMinSplitKeys)));
          int chunk = span;
          if (nsplit > 1) {
            chunk = ceil_div(ceil_div(span, nsplit), na::kBlockKeys) * na::kBlockKeys;
            nsplit = ceil_div(span, chunk);
          }
          if (nsplit <= 1) {
            P.items.push_back(NaItem{i, g, q0, q1, h0, h1, kstart, kend, -1, g1});
            continue;
          }
          for (int s = 0; s < nsplit; ++s) {
            const int k0 = kstart + s * chunk, k1 = std::min(kend, k0 + chunk);
            P.items.push_back(
                NaItem{i, g, q0, q1, h0, h1, k0, k1, int32_t(rows_used + int64_t(s) * rows), g1});
          }
          P.merges.push_back(NaMerge{i, g, q0, q1, h0, h1, nsplit, int32_t(rows_used), g1, 0});
          rows_used += int64_t(nsplit) * rows;
          if (rows_used > INT32_MAX) return NA_E_TOO_LARGE;
        }
      }
    }
  }
  P.scratch_rows = rows_used;
  return 0;
}

// The calling thread's scratch for split-KV partial results: each call has its own, so
// threads sharing one plan never share it.
thread_local std::vector<float> tls_scratch;

}  // namespace

extern "C" {

NaPlan* na_plan_create(const NaConfig* cfg, int32_t num_requests, const int32_t* qo_indptr,
                       const int32_t* kv_indptr, const int32_t* kv_indices, int64_t num_indices,
                       const int32_t* kv_lens, const uint8_t* mask, int64_t mask_len,
                       int32_t decode, NaError* err) {
  if (err) *err = NaError{0, -1, 0, 0};
  if (cfg == nullptr || !config_ok(*cfg) || num_requests < 0 || num_indices < 0 ||
      qo_indptr == nullptr || kv_indptr == nullptr ||
      (num_requests > 0 && kv_lens == nullptr) || (num_indices > 0 && kv_indices == nullptr) ||
      (mask == nullptr && mask_len != 0) || mask_len < 0) {
    fail(err, NA_E_CONFIG, -1);
    return nullptr;
  }
  NaPlan* P = nullptr;
  try {
    P = new NaPlan();
    P->cfg = *cfg;
    P->num_requests = num_requests;
    int rc = validate(*P, qo_indptr, kv_indptr, kv_indices, num_indices, kv_lens, mask,
                      mask_len, decode, err);
    if (rc == 0) {
      rc = make_items(*P);
      if (rc != 0) fail(err, rc, -1);
    }
    if (rc != 0) {
      delete P;
      return nullptr;
    }
  } catch (const std::bad_alloc&) {
    delete P;
    fail(err, NA_E_NO_MEMORY, -1);
    return nullptr;
  }
  return P;
}

void na_plan_free(NaPlan* plan) { delete plan; }

void na_plan_info(const NaPlan* P, NaPlanInfo* info) {
  *info = NaPlanInfo{P->num_tokens, P->num_requests, P->max_page, int64_t(P->items.size()),
                     int64_t(P->merges.size()), P->scratch_rows};
}

int na_run(const NaPlan* plan, const NaConfig* cfg, const void* q, int64_t q_numel,
           const void* k, int64_t k_numel, const void* v, int64_t v_numel, void* out,
           int64_t out_numel, float sm_scale, const float* sinks, int64_t sinks_numel,
           float k_scale, float v_scale, int32_t num_threads) {
  if (plan == nullptr || cfg == nullptr || !same_config(plan->cfg, *cfg)) return -1;
  const NaConfig& c = plan->cfg;
  const bool mla = c.kind == NA_MLA;
  if (plan->items.empty()) return 0;
  if (q == nullptr || k == nullptr || out == nullptr || (!mla && v == nullptr)) return -1;
  // Every row and page the plan names must lie inside the tensors given (64-bit products:
  // the factors are int32, so no overflow).
  const int64_t T = plan->num_tokens, Hq = c.num_q_heads;
  if (q_numel < 0 || T * Hq * c.head_dim > q_numel) return -1;
  if (out_numel < 0 || T * Hq * c.v_head_dim > out_numel) return -1;
  const int64_t pages = plan->max_page + 1;
  const int64_t k_page = int64_t(c.page_size) * (mla ? 1 : c.num_kv_heads) * c.head_dim;
  if (k_numel < 0 || pages * k_page > k_numel) return -1;
  if (!mla && (v_numel < 0 || pages * int64_t(c.page_size) * c.num_kv_heads * c.v_head_dim >
                                  v_numel)) {
    return -1;
  }
  if (sinks != nullptr && sinks_numel < Hq) return -1;
  NaProblem p{};
  p.q = q;
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
  if (!plan->merges.empty()) {
    try {
      const size_t need = size_t(plan->scratch_rows) * (size_t(c.v_head_dim) + 1);
      if (tls_scratch.size() < need) tls_scratch.resize(need);
    } catch (const std::bad_alloc&) {
      return -2;
    }
    p.scratch = tls_scratch.data();
  }
  const na::Kernels* kern = kernels();
  std::atomic<int> status{0};
  auto parallel = [&](int count, auto&& body) {
    if (count <= 0) return;
    const int n = std::max(1, std::min(num_threads, count));
    std::atomic<int> next{0};
    pool().run(n, [&](int) {
      for (;;) {
        const int i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= count) break;
        if (const int rc = body(i)) status.store(rc);
      }
    });
  };
  parallel(int(plan->items.size()), [&](int i) { return kern->item(&p, &plan->items[i]); });
  if (status.load() != 0) return status.load();
  parallel(int(plan->merges.size()), [&](int i) { return kern->merge(&p, &plan->merges[i]); });
  return status.load();
}

}  // extern "C"
