// Portable scalar AdamW kernel: the reference the vector variants are tested against.
#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

namespace megatrain {
namespace cpu_adam {
namespace kernels {

void adamw_scalar(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  detail::adamw_elements(a, c, begin, end);
}

double grad_accumulate_scalar(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t begin, int64_t end) {
  return detail::accumulate_elements(accum, grad, grad_dtype, overwrite, begin, end, 0.0);
}

}  // namespace kernels
}  // namespace cpu_adam
}  // namespace megatrain
