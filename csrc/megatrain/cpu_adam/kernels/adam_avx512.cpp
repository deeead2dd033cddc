// AVX-512 AdamW kernel (16 x fp32 lanes). Built for every x86-64 target; only called when the CPU
// has avx512f+bw+vl+dq (runtime dispatch). The ISA is enabled for this file's own functions only,
// after all headers, so no inline function shared with other translation units is compiled for it.
#include <immintrin.h>

#include <cstdint>

#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
// GCC 12's own avx512fintrin.h trips -Wmaybe-uninitialized (_mm512_undefined_pd); not ours.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace megatrain {
namespace cpu_adam {
namespace kernels {
namespace {

inline __m512 load16_grad(const void* grad, GradDtype dt, int64_t i) {
  if (dt == GradDtype::kFloat32) return _mm512_loadu_ps(static_cast<const float*>(grad) + i);
  const __m256i h = _mm256_loadu_si256(
      reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(grad) + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round-to-nearest-even fp32 -> bf16, NaN -> 0x7FC0 (bit-identical to detail::float_to_bf16_rne).
inline void store16_bf16(uint16_t* out, __m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_cvtepi32_epi16(r));
}

}  // namespace

void adamw_avx512(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  const __m512 gs = _mm512_set1_ps(c.grad_scale);
  const __m512 decay = _mm512_set1_ps(c.decay);
  const __m512 w = _mm512_set1_ps(c.lerp_weight);
  const __m512 wm1 = _mm512_set1_ps(c.lerp_weight - 1.0f);
  const __m512 b2 = _mm512_set1_ps(c.beta2);
  const __m512 omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 ss = _mm512_set1_ps(c.step_size);
  const __m512 bc2s = _mm512_set1_ps(c.bc2_sqrt);
  const __m512 eps = _mm512_set1_ps(c.eps);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = _mm512_mul_ps(load16_grad(a.grad, a.grad_dtype, i), gs);
    __m512 p = _mm512_mul_ps(_mm512_loadu_ps(a.master + i), decay);
    __m512 m = _mm512_loadu_ps(a.exp_avg + i);
    if (c.lerp_low) {
      m = _mm512_fmadd_ps(w, _mm512_sub_ps(g, m), m);  // torch.lerp: one fma
    } else {
      m = _mm512_fmadd_ps(wm1, _mm512_sub_ps(g, m), g);
    }
    const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(omb2, g), g,
                                      _mm512_mul_ps(_mm512_loadu_ps(a.exp_avg_sq + i), b2));  // as torch addcmul
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2s), eps);
    p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(ss, m), denom));
    _mm512_storeu_ps(a.master + i, p);
    _mm512_storeu_ps(a.exp_avg + i, m);
    _mm512_storeu_ps(a.exp_avg_sq + i, v);
    if (a.out_dtype == OutDtype::kBFloat16) {
      store16_bf16(static_cast<uint16_t*>(a.compute_out) + i, p);
    } else if (a.out_dtype == OutDtype::kFloat32) {
      _mm512_storeu_ps(static_cast<float*>(a.compute_out) + i, p);
    }
  }
  for (; i < end; ++i) detail::adamw_one(a, c, i);
}

double grad_accumulate_avx512(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t begin, int64_t end) {
  __m512d s0 = _mm512_setzero_pd();
  __m512d s1 = _mm512_setzero_pd();
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    const __m512 g = load16_grad(grad, grad_dtype, i);
    const __m512 r = overwrite ? g : _mm512_add_ps(_mm512_loadu_ps(accum + i), g);
    _mm512_storeu_ps(accum + i, r);
    const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(r));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(r, 1));
    s0 = _mm512_add_pd(s0, _mm512_mul_pd(lo, lo));
    s1 = _mm512_add_pd(s1, _mm512_mul_pd(hi, hi));
  }
  alignas(64) double lanes[8];
  _mm512_store_pd(lanes, _mm512_add_pd(s0, s1));
  double sumsq = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) +
                 ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
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
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#endif  // __x86_64__
