// The run-time instruction-set choice: the fastest kernel table this CPU and build can run,
// or the one NATIVE_ATTN_ISA / na_set_isa pins.
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>

#if defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "internal.h"

namespace {

// AMX tiles usable by this process: the CPU has AMX-TILE and AMX-BF16 (CPUID 7.0 EDX bits 24,
// 22), the OS enables the tile state (XCR0 bits 17, 18), and Linux grants this process the
// tile data (arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), per process, asked once;
// without it the first tile instruction faults). Any no: the amx path is not offered.
bool amx_usable() {
#if defined(NA_HAVE_AMX_UNIT) && defined(__linux__) && (defined(__x86_64__) || defined(_M_X64))
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return false;  // OSXSAVE
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (!(d & (1u << 24)) || !(d & (1u << 22))) return false;
    unsigned lo = 0, hi = 0;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & (3u << 17)) != (3u << 17)) return false;
    constexpr long kArchReqXcompPerm = 0x1023;
    constexpr long kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
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
  if (std::strcmp(isa, "amx") == 0) {
    return avx512 && __builtin_cpu_supports("avx512bf16") && amx_usable();
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
#ifdef NA_HAVE_AMX_UNIT
  if (std::strcmp(name, "amx") == 0) return &na_kernels_amx;
#endif
#endif
  return nullptr;
}

// The default choice, fastest first. "amx" is not in it: it runs only when pinned
// (NATIVE_ATTN_ISA=amx, na_set_isa), until it is measured faster on an AMX machine
// (bench/native_notes.md). kIsaAll is what na_isa_list offers.
const char* const kIsaOrder[] = {"avx512bf16", "avx512", "avx2", "generic"};
const char* const kIsaAll[] = {"amx", "avx512bf16", "avx512", "avx2", "generic"};

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
    for (const char* name : kIsaAll) {
      if (find_kernels(name) == nullptr) continue;
      if (!s.empty()) s += ",";
      s += name;
    }
    return s;
  }();
  return list.c_str();
}

}  // extern "C"
