// AVX-512 variant of the STREAM-style bandwidth kernels (see stream_kernels.h): the shared loops
// of stream_simd_inl.h over simd::Avx512. Built for every x86-64 target, only called when the CPU
// has AVX-512 (runtime dispatch); the ISA is enabled for this file's own functions only, after
// all shared headers (isa_target.h).
#include <immintrin.h>

#include <cstdint>

#include "megatrain/bench/stream_kernels.h"
#include "megatrain/common/simd/isa_target.h"

#if defined(__x86_64__)

MEGATRAIN_ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

#include "megatrain/bench/stream_simd_inl.h"
#include "megatrain/common/simd/vec_avx512.h"

namespace megatrain {
namespace bench {
namespace kernels {

void stream_avx512(const StreamArgs& s, int64_t begin, int64_t end) { stream_simd<simd::Avx512>(s, begin, end); }

}  // namespace kernels
}  // namespace bench
}  // namespace megatrain

MEGATRAIN_ISA_TARGET_END()

#endif  // __x86_64__
