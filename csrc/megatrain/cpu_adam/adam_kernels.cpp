#include "megatrain/cpu_adam/adam_kernels.h"

#include <cmath>
#include <stdexcept>
#include <string>

namespace megatrain {
namespace cpu_adam {

AdamConstants make_adam_constants(const AdamHyper& h) {
  if (h.step < 1) {
    throw std::invalid_argument("AdamW step must be >= 1 (the count after this update), got " +
                                std::to_string(h.step));
  }
  AdamConstants c;
  // Double precision here mirrors torch.optim.AdamW, which computes these as Python floats and
  // rounds them to fp32 when they meet the fp32 tensors.
  const double bc1 = 1.0 - std::pow(h.beta1, static_cast<double>(h.step));
  const double bc2 = 1.0 - std::pow(h.beta2, static_cast<double>(h.step));
  c.decay = static_cast<float>(1.0 - h.lr * h.weight_decay);
  const double w = 1.0 - h.beta1;
  c.lerp_weight = static_cast<float>(w);
  c.lerp_low = std::abs(c.lerp_weight) < 0.5f;
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.step_size = static_cast<float>(h.lr / bc1);
  c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  c.eps = static_cast<float>(h.eps);
  c.grad_scale = h.grad_scale;
  return c;
}

void adamw_range(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end,
                 common::CpuIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case common::CpuIsa::kAvx512:
      kernels::adamw_avx512(a, c, begin, end);
      return;
    case common::CpuIsa::kAvx2:
      kernels::adamw_avx2(a, c, begin, end);
      return;
#endif
    default:
      kernels::adamw_scalar(a, c, begin, end);
      return;
  }
}

double grad_accumulate_range(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                             int64_t begin, int64_t end, common::CpuIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case common::CpuIsa::kAvx512:
      return kernels::grad_accumulate_avx512(accum, grad, grad_dtype, overwrite, begin, end);
    case common::CpuIsa::kAvx2:
      return kernels::grad_accumulate_avx2(accum, grad, grad_dtype, overwrite, begin, end);
#endif
    default:
      return kernels::grad_accumulate_scalar(accum, grad, grad_dtype, overwrite, begin, end);
  }
}

}  // namespace cpu_adam
}  // namespace megatrain
