// AVX-512 AdamW kernel (16 x fp32 lanes): the shared loops of adam_simd_inl.h over simd::Avx512.
// Built for every x86-64 target; only called when the CPU has avx512f+bw+vl+dq (runtime
// dispatch). The ISA is enabled for this file's own functions only, after all shared headers
// (isa_target.h).
#include <immintrin.h>

#include <cstdint>

#include "megatrain/common/simd/isa_target.h"
#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

#if defined(__x86_64__)

MEGATRAIN_ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

#include "megatrain/common/simd/vec_avx512.h"
#include "megatrain/cpu_adam/kernels/adam_simd_inl.h"

namespace megatrain {
namespace cpu_adam {
namespace kernels {

void adamw_avx512(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  adamw_simd<simd::Avx512>(a, c, begin, end);
}

double grad_accumulate_avx512(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t begin, int64_t end) {
  return grad_accumulate_simd<simd::Avx512>(accum, grad, grad_dtype, overwrite, begin, end);
}

}  // namespace kernels
}  // namespace cpu_adam
}  // namespace megatrain

MEGATRAIN_ISA_TARGET_END()

#endif  // __x86_64__
