// Whole-tensor drivers over the per-range kernels: fixed chunking, a caller-supplied parallel
// loop, the bandwidth switches of common/tuning.h and the active ISA. Shared by the torch ops
// (bindings/ops.cpp) and the scheduler's kernel tasks (scheduler/tasks.cpp), so both run the
// same floating-point operations in the same order.
#pragma once

#include <cstdint>
#include <functional>

#include "megatrain/cpu_adam/adam_kernels.h"

namespace megatrain {
namespace cpu_adam {

/// Elements per work chunk: a multiple of 64, independent of the thread count, so every chunk
/// but the last starts on a 64-element boundary and results do not depend on the threads.
constexpr int64_t kChunkNumel = 64 * 1024;

/// \brief Runs body(c0, c1) over disjoint sub-ranges covering [0, n_chunks), possibly on several
/// threads (the bindings pass at::parallel_for). Empty: one call on the calling thread.
using ParallelFor =
    std::function<void(int64_t n_chunks, const std::function<void(int64_t, int64_t)>& body)>;

/// \brief Fused AdamW over n elements of `a` (a.nt_out / a.prefetch_bytes are set here from
/// common::tuning(): streaming stores only for outputs of >= nt_min_numel elements that do not
/// overlap the gradient).
/// \param[in,out] a pointers as AdamArgs documents; grad_bytes / out_bytes: element sizes.
/// \throws std::invalid_argument if h.step < 1.
void adamw_tensor(AdamArgs a, const AdamHyper& h, int64_t n, const ParallelFor& pfor = {});

/// \brief accum = grad (overwrite) or accum += grad over n elements; returns sum(accum^2) in
/// double, the per-chunk partial sums added in chunk order (the same for any thread count).
double grad_accumulate_tensor(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t n, const ParallelFor& pfor = {});

/// \brief compute[i] = master[i] rounded to out_dtype (bf16: round to nearest even, NaN ->
/// 0x7FC0, as tensor.copy_ does; fp32: copied). out_dtype must not be kNone.
void weights_from_master(const float* master, void* compute, OutDtype out_dtype, int64_t n);

}  // namespace cpu_adam
}  // namespace megatrain
