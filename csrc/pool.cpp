// Running a call's work items in parallel: on torch's OpenMP team when this process has
// loaded it, else (and in forked children) on a small persistent pool of our own.
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

#include <dlfcn.h>

#include "internal.h"

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

}  // namespace

namespace na {

int parallel_items(int threads, int count, const std::function<int(int)>& body) {
  if (count <= 0) return 0;
  const int n = std::max(1, std::min(threads, count));
  std::atomic<int> status{0};
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
      return status.load();
    }
  }
  pool().run(n, [&](int) { take_items(); });
  return status.load();
}

}  // namespace na
