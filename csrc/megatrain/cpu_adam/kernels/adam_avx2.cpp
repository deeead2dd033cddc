// AVX2 AdamW kernel (8 x fp32 lanes). Built for every x86-64 target; only called when the CPU has
// AVX2+FMA (runtime dispatch). The ISA is enabled for this file's own functions only, after all
// headers, so no inline function shared with other translation units is compiled for AVX2.
#include <immintrin.h>

#include <cstdint>

#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace megatrain {
namespace cpu_adam {
namespace kernels {
namespace {

inline __m256 load8_grad(const void* grad, GradDtype dt, int64_t i) {
  if (dt == GradDtype::kFloat32) return _mm256_loadu_ps(static_cast<const float*>(grad) + i);
  const __m128i h =
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(grad) + i));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Round-to-nearest-even fp32 -> bf16, NaN -> 0x7FC0 (bit-identical to detail::float_to_bf16_rne).
inline void store8_bf16(uint16_t* out, __m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // packus works per 128-bit lane: [r0-3 r0-3 | r4-7 r4-7] -> pick qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

}  // namespace

void adamw_avx2(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  const __m256 gs = _mm256_set1_ps(c.grad_scale);
  const __m256 decay = _mm256_set1_ps(c.decay);
  const __m256 w = _mm256_set1_ps(c.lerp_weight);
  const __m256 wm1 = _mm256_set1_ps(c.lerp_weight - 1.0f);
  const __m256 b2 = _mm256_set1_ps(c.beta2);
  const __m256 omb2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 ss = _mm256_set1_ps(c.step_size);
  const __m256 bc2s = _mm256_set1_ps(c.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(c.eps);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = _mm256_mul_ps(load8_grad(a.grad, a.grad_dtype, i), gs);
    __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a.master + i), decay);
    __m256 m = _mm256_loadu_ps(a.exp_avg + i);
    if (c.lerp_low) {
      m = _mm256_fmadd_ps(w, _mm256_sub_ps(g, m), m);  // torch.lerp: one fma
    } else {
      m = _mm256_fmadd_ps(wm1, _mm256_sub_ps(g, m), g);
    }
    const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(omb2, g), g,
                                      _mm256_mul_ps(_mm256_loadu_ps(a.exp_avg_sq + i), b2));  // as torch addcmul
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2s), eps);
    p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(ss, m), denom));
    _mm256_storeu_ps(a.master + i, p);
    _mm256_storeu_ps(a.exp_avg + i, m);
    _mm256_storeu_ps(a.exp_avg_sq + i, v);
    if (a.out_dtype == OutDtype::kBFloat16) {
      store8_bf16(static_cast<uint16_t*>(a.compute_out) + i, p);
    } else if (a.out_dtype == OutDtype::kFloat32) {
      _mm256_storeu_ps(static_cast<float*>(a.compute_out) + i, p);
    }
  }
  for (; i < end; ++i) detail::adamw_one(a, c, i);
}

double grad_accumulate_avx2(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                            int64_t begin, int64_t end) {
  __m256d s0 = _mm256_setzero_pd();
  __m256d s1 = _mm256_setzero_pd();
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    const __m256 g = load8_grad(grad, grad_dtype, i);
    const __m256 r = overwrite ? g : _mm256_add_ps(_mm256_loadu_ps(accum + i), g);
    _mm256_storeu_ps(accum + i, r);
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(r));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(r, 1));
    s0 = _mm256_add_pd(s0, _mm256_mul_pd(lo, lo));
    s1 = _mm256_add_pd(s1, _mm256_mul_pd(hi, hi));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(s0, s1));
  double sumsq = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
  for (; i < end; ++i) {
    const double r = detail::accumulate_one(accum, grad, grad_dtype, overwrite, i);
    sumsq += r * r;
  }
  return sumsq;
}

}  // namespace kernels
}  // namespace cpu_adam
}  // namespace megatrain

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // __x86_64__
