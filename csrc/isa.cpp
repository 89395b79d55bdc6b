// The run-time instruction-set choice: the fastest kernel table this CPU and build can run,
// or the one NATIVE_ATTN_ISA / na_set_isa pins.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#include "internal.h"

namespace {

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

}  // namespace

namespace na {

const Kernels* kernels() {
  const Kernels* k = g_kernels.load(std::memory_order_acquire);
  if (k == nullptr) {
    k = best_kernels();
    g_kernels.store(k, std::memory_order_release);
  }
  return k;
}

}  // namespace na

extern "C" {

const char* na_isa(void) { return na::kernels()->name; }

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
