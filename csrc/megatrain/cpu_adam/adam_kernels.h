// Torch-free fused AdamW and gradient-accumulation kernels over raw pointers.
//
// Update rule: decoupled weight decay AdamW (Loshchilov & Hutter, "Decoupled Weight Decay
// Regularization", ICLR 2019), with the exact operation order of torch.optim.AdamW's
// single-tensor (foreach=False, fused=False) implementation.
#pragma once

#include <cstdint>

#include "megatrain/common/cpu_features.h"

namespace megatrain {
namespace cpu_adam {

/// \brief Element type of a gradient input.
enum class GradDtype { kFloat32, kBFloat16 };

/// \brief Element type of the optional compute copy written after the update.
enum class OutDtype { kNone, kFloat32, kBFloat16 };

/// \brief Hyper-parameters of one AdamW step (as torch.optim.AdamW receives them).
struct AdamHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 1e-2;
  int64_t step = 1;         ///< 1-based step count of this update (after increment)
  float grad_scale = 1.0f;  ///< gradient multiplier applied first (clip scale / 1 / loss scale)
};

/// \brief fp32 constants derived once per step from AdamHyper; every ISA variant uses these same
/// values so that the variants agree bit for bit.
struct AdamConstants {
  float decay;           ///< 1 - lr * weight_decay
  float lerp_weight;     ///< 1 - beta1
  bool lerp_low;         ///< lerp_weight < 0.5 (which torch.lerp formula applies)
  float beta2;           ///< beta2
  float one_minus_beta2; ///< 1 - beta2
  float step_size;       ///< lr / (1 - beta1^step)
  float bc2_sqrt;        ///< sqrt(1 - beta2^step)
  float eps;             ///< eps
  float grad_scale;      ///< grad multiplier
};

/// \brief Computes the fp32 constants in double precision, as Python/torch does, then rounds.
/// \throws std::invalid_argument if step < 1.
AdamConstants make_adam_constants(const AdamHyper& h);

/// \brief Pointers for one fused AdamW pass over n contiguous elements.
struct AdamArgs {
  float* master;        ///< [n] fp32, updated in place
  float* exp_avg;       ///< [n] fp32, updated in place
  float* exp_avg_sq;    ///< [n] fp32, updated in place
  const void* grad;     ///< [n] fp32 or bf16 (grad_dtype), read only
  GradDtype grad_dtype;
  void* compute_out;    ///< [n] nullptr, fp32 or bf16 (out_dtype): receives the updated master
  OutDtype out_dtype;
  /// Vector kernels: write compute_out with non-temporal (streaming) stores, whole 64-byte lines
  /// from the first 64-byte boundary on (the elements before it, and the tail, are stored
  /// normally). Saves the read-for-ownership of a write-only output; meant for outputs much
  /// larger than the caches. Same values as ordinary stores; the scalar kernel ignores it.
  bool nt_out = false;
  /// Vector kernels: software-prefetch master / exp_avg / exp_avg_sq / grad this many bytes (of
  /// fp32 state) ahead; 0 = off. The scalar kernel ignores it.
  int64_t prefetch_bytes = 0;
};

/// \brief One fused AdamW pass over elements [begin, end) of `a`, single threaded.
///
/// Per element: g = grad * grad_scale; p *= decay; m = lerp(m, g, 1 - beta1) (one fma, as torch);
/// v = v * beta2 + (1 - beta2) * g * g; p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps);
/// compute_out = bf16_round_nearest_even(p) (NaN -> 0x7FC0) or p.
/// \pre 0 <= begin <= end; pointers valid for `end` elements; `isa` supported by the CPU.
void adamw_range(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end,
                 common::CpuIsa isa);

/// \brief accum[i] = g[i] (overwrite) or accum[i] += g[i], for i in [begin, end).
/// \param[in,out] accum [n] fp32 accumulator.
/// \param[in] grad [n] fp32 or bf16.
/// \return sum over [begin, end) of accum[i]^2 after the update, accumulated in double.
double grad_accumulate_range(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                             int64_t begin, int64_t end, common::CpuIsa isa);

// Per-ISA entry points (kernels/adam_<isa>.cpp). Exposed for tests; prefer the dispatchers above.
namespace kernels {
void adamw_scalar(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end);
double grad_accumulate_scalar(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t begin, int64_t end);
#if defined(__x86_64__)
void adamw_avx2(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end);
double grad_accumulate_avx2(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                            int64_t begin, int64_t end);
void adamw_avx512(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end);
double grad_accumulate_avx512(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t begin, int64_t end);
#endif
}  // namespace kernels

}  // namespace cpu_adam
}  // namespace megatrain
