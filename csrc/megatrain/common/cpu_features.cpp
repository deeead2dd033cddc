#include "megatrain/common/cpu_features.h"

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

namespace megatrain {
namespace common {
namespace {

std::once_flag g_init_once;
std::atomic<int> g_active{static_cast<int>(CpuIsa::kScalar)};

bool cpu_has(CpuIsa isa) {
#if defined(__x86_64__) || defined(__i386__)
  switch (isa) {
    case CpuIsa::kScalar:
      return true;
    case CpuIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    case CpuIsa::kAvx512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  }
  return false;
#else
  return isa == CpuIsa::kScalar;
#endif
}

bool is_compiled(CpuIsa isa) {
#if defined(__x86_64__)
  (void)isa;
  return true;
#else
  return isa == CpuIsa::kScalar;
#endif
}

void init_active() {
  const char* env = std::getenv("MEGATRAIN_CPU_ISA");
  if (env != nullptr && env[0] != '\0') {
    CpuIsa requested;
    try {
      requested = parse_isa(env);
    } catch (const std::invalid_argument& e) {
      throw std::runtime_error(std::string("MEGATRAIN_CPU_ISA: ") + e.what());
    }
    if (!cpu_supports(requested)) {
      throw std::runtime_error(std::string("MEGATRAIN_CPU_ISA=") + env +
                               " requests an ISA this CPU does not support (best supported: " +
                               isa_name(best_supported_isa()) + "); unset it or choose a supported one");
    }
    g_active.store(static_cast<int>(requested));
  } else {
    g_active.store(static_cast<int>(best_supported_isa()));
  }
}

}  // namespace

const char* isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar:
      return "scalar";
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

CpuIsa parse_isa(const std::string& name) {
  if (name == "scalar") return CpuIsa::kScalar;
  if (name == "avx2") return CpuIsa::kAvx2;
  if (name == "avx512") return CpuIsa::kAvx512;
  throw std::invalid_argument("unknown CPU ISA '" + name + "', expected one of scalar, avx2, avx512");
}

std::vector<CpuIsa> compiled_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (is_compiled(isa)) out.push_back(isa);
  }
  return out;
}

bool cpu_supports(CpuIsa isa) { return is_compiled(isa) && cpu_has(isa); }

std::vector<CpuIsa> supported_isas() {
  std::vector<CpuIsa> out;
  for (CpuIsa isa : compiled_isas()) {
    if (cpu_has(isa)) out.push_back(isa);
  }
  return out;
}

CpuIsa best_supported_isa() { return supported_isas().back(); }

CpuIsa active_isa() {
  std::call_once(g_init_once, init_active);
  return static_cast<CpuIsa>(g_active.load());
}

void set_active_isa(CpuIsa isa) {
  // Run the one-time init first so a later active_isa() cannot overwrite this choice.
  std::call_once(g_init_once, [] {
    try {
      init_active();
    } catch (const std::exception&) {
      g_active.store(static_cast<int>(best_supported_isa()));
    }
  });
  if (!cpu_supports(isa)) {
    throw std::runtime_error(std::string("cannot select CPU ISA '") + isa_name(isa) +
                             "': this CPU does not support it (best supported: " +
                             isa_name(best_supported_isa()) + ")");
  }
  g_active.store(static_cast<int>(isa));
}

}  // namespace common
}  // namespace megatrain
