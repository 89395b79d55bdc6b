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

int32_t na_abi_version(void) { return 1; }

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

int na_plan(int32_t num_requests, const int32_t* qo_indptr, const int32_t* kv_lens,
            int32_t kind, int32_t num_q_heads, int32_t num_kv_heads, int32_t causal,
            int32_t split_target, NaItem* items, int64_t cap_items, NaMerge* merges,
            int64_t cap_merges, int64_t* num_items, int64_t* num_merges,
            int64_t* scratch_rows) {
  if (num_requests < 0 || num_q_heads <= 0 || num_kv_heads <= 0 ||
      num_q_heads % num_kv_heads != 0 || (kind == NA_MLA && num_kv_heads != 1)) {
    return -1;
  }
  // A tile is (request, kv head, head block, query block); its rows share every K/V row read.
  const int group = num_q_heads / num_kv_heads;
  const int n_hblocks = ceil_div(group, na::kMaxRows);
  const int hb = ceil_div(group, n_hblocks);
  const int qb = std::max(1, na::kMaxRows / hb);
  int64_t tiles = 0;
  for (int i = 0; i < num_requests; ++i) {
    const int q_len = qo_indptr[i + 1] - qo_indptr[i];
    tiles += int64_t(num_kv_heads) * n_hblocks * ceil_div(q_len, qb);
  }
  // Split the keys only when the tiles alone cannot keep every thread busy. The target is
  // chosen by the caller from a fixed floor, so small thread counts plan the same splits.
  const int want = tiles > 0 && tiles < split_target ? ceil_div(split_target, tiles) : 1;
  int64_t ni = 0, nm = 0, rows_used = 0;
  for (int i = 0; i < num_requests; ++i) {
    const int q_len = qo_indptr[i + 1] - qo_indptr[i];
    const int kv_len = kv_lens[i];
    for (int g = 0; g < num_kv_heads; ++g) {
      for (int h0 = 0; h0 < group; h0 += hb) {
        const int h1 = std::min(group, h0 + hb);
        for (int q0 = 0; q0 < q_len; q0 += qb) {
          const int q1 = std::min(q_len, q0 + qb);
          const int rows = (h1 - h0) * (q1 - q0);
          // Causal: the tile's last query sees keys [0, kv_len - q_len + q1).
          const int kend = causal ? std::max(0, std::min(kv_len, kv_len - q_len + q1)) : kv_len;
          int nsplit = std::max(1, std::min(want, ceil_div(kend, na::kMinSplitKeys)));
          int chunk = kend;
          if (nsplit > 1) {
            chunk = ceil_div(ceil_div(kend, nsplit), na::kBlockKeys) * na::kBlockKeys;
            nsplit = ceil_div(kend, chunk);
          }
          if (nsplit <= 1) {
            if (ni < cap_items) items[ni] = NaItem{i, g, q0, q1, h0, h1, 0, kend, -1, 0};
            ++ni;
            continue;
          }
          const int64_t slot0 = rows_used;
          for (int s = 0; s < nsplit; ++s) {
            const int k0 = s * chunk, k1 = std::min(kend, k0 + chunk);
            if (ni < cap_items) {
              items[ni] = NaItem{i, g, q0, q1, h0, h1, k0, k1, int32_t(slot0 + int64_t(s) * rows), 0};
            }
            ++ni;
          }
          if (nm < cap_merges) merges[nm] = NaMerge{i, g, q0, q1, h0, h1, nsplit, int32_t(slot0)};
          ++nm;
          rows_used += int64_t(nsplit) * rows;
          if (rows_used > INT32_MAX) return -1;
        }
      }
    }
  }
  *num_items = ni;
  *num_merges = nm;
  *scratch_rows = rows_used;
  return 0;
}

int na_run(const NaProblem* p) {
  if (p == nullptr || p->q == nullptr || p->k == nullptr || p->out == nullptr) return -1;
  if (p->kind != NA_MHA && p->kind != NA_MLA) return -1;
  if (p->kind == NA_MHA && p->v == nullptr) return -1;
  if (p->num_q_heads <= 0 || p->num_kv_heads <= 0 || p->num_q_heads % p->num_kv_heads) return -1;
  if (p->head_dim <= 0 || p->head_dim > na::kMaxHeadDim || p->v_head_dim <= 0 ||
      p->v_head_dim > na::kMaxHeadDim || p->page_size <= 0) {
    return -1;
  }
  if (p->kind == NA_MLA && (p->num_kv_heads != 1 || p->v_head_dim > p->head_dim)) return -1;
  if (!p->causal && (p->mask == nullptr || p->mask_indptr == nullptr)) return -1;
  if (p->num_merges > 0 && p->scratch == nullptr) return -1;
  const na::Kernels* k = kernels();
  std::atomic<int> status{0};
  auto parallel = [&](int count, auto&& body) {
    if (count <= 0) return;
    const int n = std::max(1, std::min(p->num_threads, count));
    std::atomic<int> next{0};
    pool().run(n, [&](int) {
      for (;;) {
        const int i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= count) break;
        if (const int rc = body(i)) status.store(rc);
      }
    });
  };
  parallel(p->num_items, [&](int i) { return k->item(p, &p->items[i]); });
  if (status.load() != 0) return status.load();
  parallel(p->num_merges, [&](int i) { return k->merge(p, &p->merges[i]); });
  return status.load();
}

}  // extern "C"
