// Planner, thread pool, run-time instruction-set choice and the C entry points.
#include "native_attn.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include <dlfcn.h>

#include "kernels.h"

namespace {

// A small persistent pool of our own, used when torch's OpenMP runtime is not loaded (see
// gomp_parallel) and in forked children. Never a second OpenMP runtime: torch ships its own
// libgomp, and another one in the same process competes with it for the same cores (and
// some builds abort at load). Callers are serialised; ctypes releases the GIL, so two Python
// threads may call in at once.
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
std::atomic<bool> g_forked{false};  // set in a forked child: torch's OpenMP team is gone
std::once_flag g_pool_once;

// A forked child has none of the parent's threads: forget the pool (leaked on purpose, its
// mutexes may be held by threads that no longer exist) and build a new one on first use.
void forget_pool_in_child() {
  g_pool = new Pool();
  g_forked.store(true);
}

// torch's OpenMP runtime, when this process has loaded it (torch links libgomp.so.1 and
// loads it before any tensor reaches us). Running the items on torch's own team instead of
// a second set of threads matters because torch's OpenMP workers spin for a while after
// each parallel op: right after a GEMM, a pool of our own competes with them for the same
// cores (measured: decode 1.2-1.5x slower when it follows a 2-thread matmul; with
// OMP_WAIT_POLICY=passive the gap closes). Found with dlopen(RTLD_NOLOAD), so the library
// never loads an OpenMP runtime itself and has no link dependency on one. A forked child
// uses our pool: an OpenMP team does not survive fork().
using GompParallel = void (*)(void (*)(void*), void*, unsigned, unsigned);

Pool& pool();

GompParallel gomp_parallel() {
  pool();  // registers the fork handler that switches a child to our pool
  if (g_forked.load(std::memory_order_relaxed)) return nullptr;
  // Looked up once, at the first call with more than one thread: a tensor has reached us by
  // then, so torch (and its runtime) is loaded if it ever will be.
  static const GompParallel fn = []() -> GompParallel {
    if (std::getenv("NATIVE_ATTN_OWN_POOL") != nullptr) return nullptr;
    void* h = dlopen("libgomp.so.1", RTLD_NOW | RTLD_NOLOAD);
    return h == nullptr ? nullptr : reinterpret_cast<GompParallel>(dlsym(h, "GOMP_parallel"));
  }();
  return fn;
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

int32_t na_abi_version(void) { return NA_ABI_VERSION; }

int64_t na_struct_size(const char* name) {
  if (name == nullptr) return -1;
  if (std::strcmp(name, "NaConfig") == 0) return int64_t(sizeof(NaConfig));
  if (std::strcmp(name, "NaError") == 0) return int64_t(sizeof(NaError));
  if (std::strcmp(name, "NaPlanInfo") == 0) return int64_t(sizeof(NaPlanInfo));
  if (std::strcmp(name, "NaPlanArgs") == 0) return int64_t(sizeof(NaPlanArgs));
  if (std::strcmp(name, "NaRunArgs") == 0) return int64_t(sizeof(NaRunArgs));
  return -1;
}

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
};

namespace {

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

// How many leading keys every query of request i sees whatever its position: the keys a
// cascade tile may read for it without a per-row limit (0: none).
int64_t keys_all_rows_see(const NaPlan& P, int i) {
  const int q_len = P.qo[i + 1] - P.qo[i];
  const int64_t kv_len = P.lens[i];
  if (P.causal) return P.cfg.causal ? kv_len - q_len + 1 : kv_len;
  int64_t lo = kv_len;  // custom mask: the shortest run of allowed keys from 0 over its rows
  for (int j = 0; j < q_len; ++j) {
    const uint8_t* row = P.mask.data() + P.mask_indptr[i] + int64_t(j) * kv_len;
    int64_t t = 0;
    while (t < lo && row[t]) ++t;
    lo = t;
  }
  return lo;
}

// One group of requests whose page tables start with the same `pages` page ids.
struct Group {
  std::vector<int> members;
  int pages = 0;
  int ctok0 = 0, ntok = 0;  // its cascade tokens: ctoks[ctok0 .. ctok0 + ntok)
  int nsplit = 1, chunk = 0;
  int64_t base = 0;  // scratch row of split 0, token 0, head 0
};

// Cascade planning: requests with small tiles (decode, short verify) whose page tables start
// with the same whole pages, read by every query of each of them, form a group; the group's
// shared keys are then read once by tiles spanning all its queries, and each member's own
// keys as before, the two merged by log-sum-exp. Off with a window or a chunk (each row would
// need its own first key) and for long prefill tiles (which read each key for 32 rows already).
std::vector<Group> find_groups(NaPlan& P, int group_heads) {
  std::vector<Group> groups;
  const NaConfig& c = P.cfg;
  if (!c.cascade || c.window_left >= 0 || c.chunk_size > 0) return groups;
  const int ps = c.page_size;
  const int B = P.num_requests;
  std::vector<std::pair<int32_t, int>> firsts;  // (first page, request) of eligible requests
  std::vector<int> usable(size_t(B), 0);        // whole pages every query of i sees
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    if (q_len < 1 || group_heads * q_len > na::kMaxRows / 2) continue;
    const int64_t n_pages = P.kvp[i + 1] - P.kvp[i];
    usable[size_t(i)] = int(std::min<int64_t>(n_pages, keys_all_rows_see(P, i) / ps));
    if (usable[size_t(i)] > 0) firsts.emplace_back(P.idx[size_t(P.kvp[i])], i);
  }
  std::stable_sort(firsts.begin(), firsts.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::pair<int, int>> lcp;  // (shared pages with the run's first request, request)
  for (size_t a = 0; a < firsts.size();) {
    size_t b = a;
    while (b < firsts.size() && firsts[b].first == firsts[a].first) ++b;
    if (b - a >= 2) {
      const int lead = firsts[a].second;
      const int32_t* lp = P.idx.data() + P.kvp[lead];
      lcp.clear();
      for (size_t m = a; m < b; ++m) {
        const int i = firsts[m].second;
        const int32_t* ip = P.idx.data() + P.kvp[i];
        const int most = std::min(usable[size_t(i)], usable[size_t(lead)]);
        int n = 0;
        while (n < most && ip[n] == lp[n]) ++n;
        lcp.emplace_back(n, i);
      }
      // The share length that saves the most key reads, (members - 1) x shared pages, among
      // those of at least kMinCascadeKeys keys (sorted longest first: the rest are shorter).
      std::stable_sort(lcp.begin(), lcp.end(),
                       [](const auto& x, const auto& y) { return x.first > y.first; });
      int64_t best = 0;
      size_t best_n = 0;
      for (size_t k = 1; k < lcp.size(); ++k) {
        if (int64_t(lcp[k].first) * ps < na::kMinCascadeKeys) break;
        const int64_t saved = int64_t(k) * lcp[k].first;
        if (saved > best) best = saved, best_n = k + 1;
      }
      if (best_n >= 2 && int64_t(lcp[best_n - 1].first) * ps >= na::kMinCascadeKeys) {
        Group g;
        g.pages = lcp[best_n - 1].first;
        for (size_t k = 0; k < best_n; ++k) g.members.push_back(lcp[k].second);
        std::sort(g.members.begin(), g.members.end());  // batch order: tokens stay in order
        groups.push_back(std::move(g));
      }
    }
    a = b;
  }
  return groups;
}

int make_items(NaPlan& P) {
  const NaConfig& c = P.cfg;
  const int B = P.num_requests;
  const int Hq = c.num_q_heads;
  // A tile is (request, kv head, head block, query block); its rows share every K/V row read.
  const int group = c.num_q_heads / c.num_kv_heads;
  const int n_hblocks = ceil_div(group, na::kMaxRows);
  const int hb = ceil_div(group, n_hblocks);
  const int qb = std::max(1, na::kMaxRows / hb);
  // A tile whose rows of one kv head are few (decode, short verify) takes several kv heads:
  // each block of tokens is then read whole, in address order (a token's heads are adjacent
  // in the cache), instead of one head's 2 KB-strided rows per tile.
  auto heads_per_rows = [&](int rows) {
    if (n_hblocks != 1 || rows > na::kMaxRows / 2) return 1;
    return std::max(1, std::min(c.num_kv_heads, na::kMaxRows / rows));
  };
  auto heads_per_tile = [&](int q_len) { return heads_per_rows(group * q_len); };
  std::vector<Group> groups = find_groups(P, group);
  std::vector<int> shared_keys(size_t(B), 0), member_group(size_t(B), -1);
  std::vector<int> member_tok(size_t(B), 0);
  int64_t tiles = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    g.ctok0 = int(P.ctoks.size() / 2);
    for (int i : g.members) {
      shared_keys[size_t(i)] = g.pages * c.page_size;
      member_group[size_t(i)] = int(gi);
      member_tok[size_t(i)] = g.ntok;
      for (int j = 0; j < P.qo[i + 1] - P.qo[i]; ++j) {
        P.ctoks.push_back(i);
        P.ctoks.push_back(j);
        ++g.ntok;
      }
    }
    const int rows = std::min(g.ntok, qb) * hb;
    tiles += int64_t(ceil_div(c.num_kv_heads, heads_per_rows(rows))) * n_hblocks *
             ceil_div(g.ntok, qb);
    P.cascade_keys += int64_t(g.pages) * c.page_size;
    P.cascade_requests += int64_t(g.members.size());
  }
  P.cascade_groups = int64_t(groups.size());
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    tiles += int64_t(ceil_div(c.num_kv_heads, heads_per_tile(q_len))) * n_hblocks *
             ceil_div(q_len, qb);
  }
  // Split the keys only when the tiles alone cannot keep every thread busy. The target is
  // chosen by the caller from a fixed floor, so small thread counts plan the same splits.
  const int64_t target = std::max(1, P.split_target);
  const int want = tiles > 0 && tiles < target ? ceil_div(target, tiles) : 1;
  // How a span of keys is cut: (splits, keys per split), splits 1 meaning whole.
  auto cut = [&](int span) {
    int nsplit = std::max(1, std::min(want, ceil_div(span, na::kMinSplitKeys)));
    int chunk = span;
    if (nsplit > 1) {
      chunk = ceil_div(ceil_div(span, nsplit), na::kBlockKeys) * na::kBlockKeys;
      nsplit = ceil_div(span, chunk);
    }
    return std::make_pair(nsplit, chunk);
  };
  int64_t rows_used = 0;
  P.items.reserve(size_t(tiles) * size_t(want));
  // Cascade tiles first (the largest items: the pool takes items in order).
  for (Group& g : groups) {
    std::tie(g.nsplit, g.chunk) = cut(g.pages * c.page_size);
    g.base = rows_used;
    rows_used += int64_t(g.nsplit) * g.ntok * Hq;
    if (rows_used > INT32_MAX) return NA_E_TOO_LARGE;
    const int span = g.pages * c.page_size;
    const int hpt = heads_per_rows(std::min(g.ntok, qb) * hb);
    for (int kh = 0; kh < c.num_kv_heads; kh += hpt) {
      const int kh1 = std::min(c.num_kv_heads, kh + hpt);
      for (int h0 = 0; h0 < group; h0 += hb) {
        const int h1 = std::min(group, h0 + hb);
        for (int t0 = 0; t0 < g.ntok; t0 += qb) {
          const int t1 = std::min(g.ntok, t0 + qb);
          for (int s = 0; s < g.nsplit; ++s) {
            const int k0 = s * g.chunk, k1 = std::min(span, k0 + g.chunk);
            const int64_t slot = g.base + int64_t(s) * g.ntok * Hq;
            P.items.push_back(NaItem{g.members[0], kh, t0, t1, h0, h1, k0, k1, int32_t(slot),
                                     kh1, 1, g.ctok0});
          }
        }
      }
    }
  }
  for (int i = 0; i < B; ++i) {
    const int q_len = P.qo[i + 1] - P.qo[i];
    const int kv_len = P.lens[i];
    const int hpt = heads_per_tile(q_len);
    const int mg = member_group[size_t(i)];
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
          // A cascade member's shared keys were read by its group's tiles.
          const int kstart =
              std::min(kend, std::max(shared_keys[size_t(i)], first_key(P, i, q0, q1)));
          const int span = kend - kstart;
          int nsplit, chunk;
          std::tie(nsplit, chunk) = cut(span);
          if (mg < 0 && nsplit <= 1) {
            P.items.push_back(NaItem{i, g, q0, q1, h0, h1, kstart, kend, -1, g1, 0, 0});
            continue;
          }
          if (span == 0) nsplit = 0;  // a member whose every key is shared
          for (int s = 0; s < nsplit; ++s) {
            const int k0 = kstart + s * chunk, k1 = std::min(kend, k0 + chunk);
            P.items.push_back(NaItem{i, g, q0, q1, h0, h1, k0, k1,
                                     int32_t(rows_used + int64_t(s) * rows), g1, 0, 0});
          }
          NaMerge m{i, g, q0, q1, h0, h1, nsplit, int32_t(rows_used), g1, 0, 0, 0};
          if (mg >= 0) {
            const Group& gr = groups[size_t(mg)];
            m.nshared = gr.nsplit;
            m.shared0 = int32_t(gr.base + (int64_t(member_tok[size_t(i)]) + q0) * Hq);
            m.shared_stride = gr.ntok * Hq;
          }
          P.merges.push_back(m);
          rows_used += int64_t(nsplit) * rows;
          if (rows_used > INT32_MAX) return NA_E_TOO_LARGE;
        }
      }
    }
  }
  P.scratch_rows = rows_used;
  // Every output row is written by exactly one direct tile or merge: the handler hands back
  // an output it never filled otherwise. Checked once per plan (a planner bug, never input).
  int64_t covered = 0;
  for (const NaItem& it : P.items) {
    if (it.slot < 0) covered += int64_t(it.kv_head_end - it.kv_head) * (it.h1 - it.h0) * (it.q1 - it.q0);
  }
  for (const NaMerge& mg : P.merges) {
    covered += int64_t(mg.kv_head_end - mg.kv_head) * (mg.h1 - mg.h0) * (mg.q1 - mg.q0);
  }
  if (covered != P.num_tokens * Hq) return NA_E_INTERNAL;
  return 0;
}

// The library's tables of live runners and plans. Ids are a 64-bit counter passed through a
// bijective mixer keyed per process, so they are never reused (a freed id stays dead) and
// not guessable from one another. The maps are leaked on purpose: no destructor runs at exit
// while another thread may still be inside na_run.
struct PlanEntry {
  std::shared_ptr<const NaPlan> plan;
  uint64_t runner;
};
std::mutex g_table_mu;
// fork() while another thread holds the table lock would leave the child's copy locked
// forever: hold it across fork so both sides start with it free (the tables are copied whole).
const int g_table_atfork = pthread_atfork([] { g_table_mu.lock(); }, [] { g_table_mu.unlock(); },
                                          [] { g_table_mu.unlock(); });
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

}  // namespace

extern "C" {

int na_runner_create(const NaConfig* cfg, uint64_t* runner) {
  if (cfg == nullptr || runner == nullptr || !config_ok(*cfg)) return NA_BAD_CONFIG;
  try {
    std::lock_guard<std::mutex> lk(g_table_mu);
    const uint64_t id = new_id_locked();
    g_runners->emplace(id, *cfg);
    *runner = id;
  } catch (const std::bad_alloc&) {
    return NA_NO_MEMORY;
  }
  return NA_OK;
}

void na_runner_free(uint64_t runner) {
  std::lock_guard<std::mutex> lk(g_table_mu);
  if (g_runners->erase(runner) == 0) return;
  for (auto it = g_plans->begin(); it != g_plans->end();) {
    it = it->second.runner == runner ? g_plans->erase(it) : std::next(it);
  }
}

int na_plan_create(uint64_t runner, const NaPlanArgs* a, uint64_t* plan_id, NaPlanInfo* info,
                   NaError* err) {
  if (err) *err = NaError{0, -1, 0, 0};
  NaConfig cfg;
  {
    std::lock_guard<std::mutex> lk(g_table_mu);
    auto found = g_runners->find(runner);
    if (found == g_runners->end()) return NA_UNKNOWN_RUNNER;
    cfg = found->second;
  }
  if (a == nullptr || plan_id == nullptr || info == nullptr || a->num_requests < 0 ||
      a->num_indices < 0 || a->qo_indptr == nullptr || a->kv_indptr == nullptr ||
      (a->num_requests > 0 && a->kv_lens == nullptr) ||
      (a->num_indices > 0 && a->kv_indices == nullptr) ||
      (a->mask == nullptr && a->mask_len != 0) || a->mask_len < 0) {
    fail(err, NA_E_CONFIG, -1);
    return NA_BAD_ARGS;
  }
  std::shared_ptr<NaPlan> P;
  try {
    P = std::make_shared<NaPlan>();
    P->cfg = cfg;
    P->split_target = std::max(1, a->split_target);
    P->num_requests = a->num_requests;
    int rc = validate(*P, a->qo_indptr, a->kv_indptr, a->kv_indices, a->num_indices, a->kv_lens,
                      a->mask, a->mask_len, a->decode, err);
    if (rc == 0) {
      rc = make_items(*P);
      if (rc != 0) fail(err, rc, -1);
    }
    if (rc != 0) return NA_BAD_ARGS;
    *info = NaPlanInfo{P->num_tokens,    P->num_requests,
                       P->max_page,      int64_t(P->items.size()),
                       int64_t(P->merges.size()), P->scratch_rows,
                       P->cascade_groups, P->cascade_requests,
                       P->cascade_keys};
    std::lock_guard<std::mutex> lk(g_table_mu);
    if (!g_runners->count(runner)) return NA_UNKNOWN_RUNNER;  // freed meanwhile
    const uint64_t id = new_id_locked();
    g_plans->emplace(id, PlanEntry{std::move(P), runner});
    *plan_id = id;
  } catch (const std::bad_alloc&) {
    fail(err, NA_E_NO_MEMORY, -1);
    return NA_NO_MEMORY;
  }
  return NA_OK;
}

int na_plan_free(uint64_t runner, uint64_t plan) {
  std::shared_ptr<const NaPlan> dead;  // destroyed after the lock is released
  std::lock_guard<std::mutex> lk(g_table_mu);
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
    std::lock_guard<std::mutex> lk(g_table_mu);
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
  const void *q = a->q, *k = a->k, *v = a->v;
  void* out = a->out;
  const int64_t q_numel = a->q_numel, k_numel = a->k_numel, v_numel = a->v_numel;
  const int64_t out_numel = a->out_numel, sinks_numel = a->sinks_numel;
  const int64_t lse_numel = a->lse_numel;
  const float* sinks = a->sinks;
  float* lse = a->lse;
  const float sm_scale = a->sm_scale, k_scale = a->k_scale, v_scale = a->v_scale;
  const int32_t num_threads = a->num_threads;
  // out and lse hold exactly the plan's rows: every one of them is written below.
  const int64_t T = plan->num_tokens, Hq = c.num_q_heads;
  if (out_numel != T * Hq * c.v_head_dim) return NA_BAD_ARGS;
  if (lse != nullptr && lse_numel != T * Hq) return NA_BAD_ARGS;
  if (plan->items.empty()) return NA_OK;
  if (q == nullptr || k == nullptr || out == nullptr || (!mla && v == nullptr)) return NA_BAD_ARGS;
  // Every row and page the plan names must lie inside the tensors given (64-bit products:
  // the factors are int32, so no overflow).
  if (q_numel < 0 || T * Hq * c.head_dim > q_numel) return NA_BAD_ARGS;
  const int64_t pages = plan->max_page + 1;
  const int64_t k_page = int64_t(c.page_size) * (mla ? 1 : c.num_kv_heads) * c.head_dim;
  if (k_numel < 0 || pages * k_page > k_numel) return NA_BAD_ARGS;
  if (!mla && (v_numel < 0 || pages * int64_t(c.page_size) * c.num_kv_heads * c.v_head_dim >
                                  v_numel)) {
    return NA_BAD_ARGS;
  }
  if (sinks != nullptr && sinks_numel < Hq) return NA_BAD_ARGS;
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
  p.lse = lse;
  p.ctoks = plan->ctoks.data();
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
    auto take_items = [&]() {
      for (;;) {
        const int i = next.fetch_add(1, std::memory_order_relaxed);
        if (i >= count) break;
        if (const int rc = body(i)) status.store(rc);
      }
    };
    using Take = decltype(take_items);
    if (n > 1) {
      if (const GompParallel gp = gomp_parallel()) {
        // The items never throw (allocation failures are return codes).
        gp([](void* d) { (*static_cast<Take*>(d))(); }, &take_items, unsigned(n), 0);
        return;
      }
    }
    pool().run(n, [&](int) { take_items(); });
  };
  parallel(int(plan->items.size()), [&](int i) { return kern->item(&p, &plan->items[i]); });
  if (status.load() != 0) return status.load();
  parallel(int(plan->merges.size()), [&](int i) { return kern->merge(&p, &plan->merges[i]); });
  return status.load();
}

}  // extern "C"
