// Run-time switches for memory-bandwidth tuning (torch-free). Each has an environment variable,
// read once on first use; set_tuning() overrides them in-process (benchmarks A/B them side by side).
//
//   MEGATRAIN_HUGEPAGES=0|1          (default 1) host arenas (PinnedBuffer: HostStore, pinned_empty)
//                                    of >= 2 MiB are mapped 2 MiB-aligned and advised
//                                    MADV_HUGEPAGE; 0 advises MADV_NOHUGEPAGE (4 KiB pages even when
//                                    the kernel's THP mode is "always"). Applies to new allocations.
//   MEGATRAIN_STORE_SKEW=0|1         (default 1) HostStore units with fp32 sections of >= 16 MiB
//                                    start each section at a different offset modulo 256 KiB
//                                    (steps of 68 KiB) instead of back to back: the AdamW streams
//                                    (master, exp_avg, exp_avg_sq, grad_accum) then do not sit a
//                                    multiple of a large power of two apart, which costs a large
//                                    share of the host bandwidth (cache-set and DRAM-bank
//                                    conflicts). At most 5 x 252 KiB of padding per unit.
//                                    Applies to new stores.
//   MEGATRAIN_ADAM_NT_STORES=0|1     (default 1) the fused AdamW writes its compute copy (write-only)
//                                    with non-temporal stores when the op updates at least
//                                    MEGATRAIN_ADAM_NT_MIN_NUMEL elements (default 1048576) and the
//                                    gradient is not read from that output itself: no
//                                    read-for-ownership of the output. Results are bit-identical.
//   MEGATRAIN_ADAM_PREFETCH=<bytes>  (default 1024; 0 = off) software prefetch distance, in bytes
//                                    of fp32 state, for the fused AdamW's input streams. On the
//                                    H200 machine's 16-core Xeon (2026-11-29, 256M params) 1024 B
//                                    took the bf16-gradient-in-compute-section update from 4.26 to
//                                    5.41 Gparam/s and the fp32-gradient one from 3.77 to 3.88
//                                    (docs/benchmarks/cpu_adam_h200_variants.json).
#pragma once

#include <cstdint>

namespace megatrain {
namespace common {

struct Tuning {
  bool hugepages = true;
  bool store_skew = true;
  bool nt_stores = true;
  int64_t nt_min_numel = int64_t{1} << 20;
  int64_t prefetch_bytes = 1024;
};

/// \brief Current switches (the environment on first call, then whatever set_tuning() stored).
/// \throws std::invalid_argument if an environment variable holds something unparsable.
Tuning tuning();

/// \brief Replaces the switches for the whole process (takes effect for later allocations / ops).
/// \throws std::invalid_argument for nt_min_numel < 0 or prefetch_bytes outside [0, 65536].
void set_tuning(const Tuning& t);

}  // namespace common
}  // namespace megatrain
