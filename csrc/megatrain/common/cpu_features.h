// Runtime CPU ISA detection and selection for the CPU kernels (torch-free).
#pragma once

#include <string>
#include <vector>

namespace megatrain {
namespace common {

/// \brief Instruction-set variants the CPU kernels are compiled for.
enum class CpuIsa { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

/// \brief Lower-case name of an ISA ("scalar", "avx2", "avx512").
const char* isa_name(CpuIsa isa);

/// \brief Parses "scalar" | "avx2" | "avx512".
/// \throws std::invalid_argument on any other name.
CpuIsa parse_isa(const std::string& name);

/// \brief ISA variants compiled into this binary (always includes kScalar).
std::vector<CpuIsa> compiled_isas();

/// \brief Whether this CPU can run `isa` AND the variant is compiled in.
/// AVX-512 requires avx512f, avx512bw, avx512vl and avx512dq; AVX2 requires avx2 and fma.
bool cpu_supports(CpuIsa isa);

/// \brief Every ISA that is compiled in and that this CPU supports, best last.
std::vector<CpuIsa> supported_isas();

/// \brief Best ISA supported by this CPU (ignores MEGATRAIN_CPU_ISA).
CpuIsa best_supported_isa();

/// \brief The ISA the kernels dispatch to.
///
/// Chosen once (thread-safe): the value of the environment variable
/// MEGATRAIN_CPU_ISA=scalar|avx2|avx512 if set, otherwise best_supported_isa().
/// \throws std::runtime_error if MEGATRAIN_CPU_ISA names an unknown ISA or one this CPU lacks.
CpuIsa active_isa();

/// \brief Overrides the dispatch choice (tests, benchmarks). Not meant to race with running kernels.
/// \throws std::runtime_error if this CPU does not support `isa`.
void set_active_isa(CpuIsa isa);

}  // namespace common
}  // namespace megatrain
