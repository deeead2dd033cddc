// Portable scalar AdamW kernel: the reference the vector variants are tested against.
#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

namespace megatrain {
namespace cpu_adam {
namespace kernels {

void adamw_scalar(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) detail::adamw_one(a, c, i);
}

double grad_accumulate_scalar(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t begin, int64_t end) {
  double sumsq = 0.0;
  for (int64_t i = begin; i < end; ++i) {
    const double r = detail::accumulate_one(accum, grad, grad_dtype, overwrite, i);
    sumsq += r * r;
  }
  return sumsq;
}

}  // namespace kernels
}  // namespace cpu_adam
}  // namespace megatrain
