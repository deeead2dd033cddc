// AVX2 AdamW kernel (8 x fp32 lanes): the shared loops of adam_simd_inl.h over simd::Avx2. Built
// for every x86-64 target; only called when the CPU has AVX2+FMA (runtime dispatch). The ISA is
// enabled for this file's own functions only, after all shared headers (isa_target.h).
#include <immintrin.h>

#include <cstdint>

#include "megatrain/common/simd/isa_target.h"
#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

#if defined(__x86_64__)

MEGATRAIN_ISA_TARGET_BEGIN("avx2,fma")

#include "megatrain/common/simd/vec_avx2.h"
#include "megatrain/cpu_adam/kernels/adam_simd_inl.h"

namespace megatrain {
namespace cpu_adam {
namespace kernels {

void adamw_avx2(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  adamw_simd<simd::Avx2>(a, c, begin, end);
}

double grad_accumulate_avx2(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                            int64_t begin, int64_t end) {
  return grad_accumulate_simd<simd::Avx2>(accum, grad, grad_dtype, overwrite, begin, end);
}

}  // namespace kernels
}  // namespace cpu_adam
}  // namespace megatrain

MEGATRAIN_ISA_TARGET_END()

#endif  // __x86_64__
