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
inline __m128i bf16x8(__m256 p) {
  const __m256i u = _mm256_castps_si256(p);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb);
  r = _mm256_srli_epi32(r, 16);
  const __m256 nan = _mm256_cmp_ps(p, p, _CMP_UNORD_Q);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  // packus works per 128-bit lane: [r0-3 r0-3 | r4-7 r4-7] -> pick qwords 0 and 2.
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0xD8);
  return _mm256_castsi256_si128(packed);
}

struct Consts {
  __m256 gs, decay, w, wm1, b2, omb2, ss, bc2s, eps;
  bool lerp_low;
};

inline Consts make_consts(const AdamConstants& c) {
  Consts k;
  k.gs = _mm256_set1_ps(c.grad_scale);
  k.decay = _mm256_set1_ps(c.decay);
  k.w = _mm256_set1_ps(c.lerp_weight);
  k.wm1 = _mm256_set1_ps(c.lerp_weight - 1.0f);
  k.b2 = _mm256_set1_ps(c.beta2);
  k.omb2 = _mm256_set1_ps(c.one_minus_beta2);
  k.ss = _mm256_set1_ps(c.step_size);
  k.bc2s = _mm256_set1_ps(c.bc2_sqrt);
  k.eps = _mm256_set1_ps(c.eps);
  k.lerp_low = c.lerp_low;
  return k;
}

// Updates master / exp_avg / exp_avg_sq at [i, i + 8); returns the new master.
inline __m256 step8(const AdamArgs& a, const Consts& k, int64_t i) {
  const __m256 g = _mm256_mul_ps(load8_grad(a.grad, a.grad_dtype, i), k.gs);
  __m256 p = _mm256_mul_ps(_mm256_loadu_ps(a.master + i), k.decay);
  __m256 m = _mm256_loadu_ps(a.exp_avg + i);
  if (k.lerp_low) {
    m = _mm256_fmadd_ps(k.w, _mm256_sub_ps(g, m), m);  // torch.lerp: one fma
  } else {
    m = _mm256_fmadd_ps(k.wm1, _mm256_sub_ps(g, m), g);
  }
  const __m256 v = _mm256_fmadd_ps(_mm256_mul_ps(k.omb2, g), g,
                                    _mm256_mul_ps(_mm256_loadu_ps(a.exp_avg_sq + i), k.b2));  // as torch addcmul
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), k.bc2s), k.eps);
  p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(k.ss, m), denom));
  _mm256_storeu_ps(a.master + i, p);
  _mm256_storeu_ps(a.exp_avg + i, m);
  _mm256_storeu_ps(a.exp_avg_sq + i, v);
  return p;
}

// One 64-byte line of each fp32 stream (and the grad bytes of the same 16 elements), `d`
// elements ahead of i.
inline void prefetch16(const AdamArgs& a, int64_t i, int64_t d) {
  _mm_prefetch(reinterpret_cast<const char*>(a.master + i + d), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(a.exp_avg + i + d), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(a.exp_avg_sq + i + d), _MM_HINT_T0);
  const char* g = static_cast<const char*>(a.grad) + (i + d) * (a.grad_dtype == GradDtype::kFloat32 ? 4 : 2);
  _mm_prefetch(g, _MM_HINT_T0);
}

}  // namespace

void adamw_avx2(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  const Consts k = make_consts(c);
  const int64_t pf = a.prefetch_bytes / 4;  // distance in elements
  int64_t i = begin;
  const int64_t esize = a.out_dtype == OutDtype::kBFloat16 ? 2 : 4;
  const uintptr_t out_addr = reinterpret_cast<uintptr_t>(a.compute_out);
  const bool nt = a.nt_out && a.out_dtype != OutDtype::kNone && out_addr % esize == 0;
  if (nt) {
    // Scalar head up to the output's first 64-byte boundary, then 32 elements per iteration:
    // one whole output line (bf16) or two (fp32), streamed past the caches.
    while (i < end && (out_addr + static_cast<uintptr_t>(i * esize)) % 64 != 0) {
      detail::adamw_one(a, c, i);
      ++i;
    }
    for (; i + 32 <= end; i += 32) {
      if (pf > 0) {
        prefetch16(a, i, pf);
        prefetch16(a, i + 16, pf);
      }
      const __m256 p0 = step8(a, k, i);
      const __m256 p1 = step8(a, k, i + 8);
      const __m256 p2 = step8(a, k, i + 16);
      const __m256 p3 = step8(a, k, i + 24);
      if (a.out_dtype == OutDtype::kBFloat16) {
        __m256i* out = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.compute_out) + i);
        _mm256_stream_si256(out, _mm256_set_m128i(bf16x8(p1), bf16x8(p0)));
        _mm256_stream_si256(out + 1, _mm256_set_m128i(bf16x8(p3), bf16x8(p2)));
      } else {
        float* out = static_cast<float*>(a.compute_out) + i;
        _mm256_stream_ps(out, p0);
        _mm256_stream_ps(out + 8, p1);
        _mm256_stream_ps(out + 16, p2);
        _mm256_stream_ps(out + 24, p3);
      }
    }
  }
  for (; i + 8 <= end; i += 8) {
    if (pf > 0 && (i & 15) == 0) prefetch16(a, i, pf);
    const __m256 p = step8(a, k, i);
    if (a.out_dtype == OutDtype::kBFloat16) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(a.compute_out) + i), bf16x8(p));
    } else if (a.out_dtype == OutDtype::kFloat32) {
      _mm256_storeu_ps(static_cast<float*>(a.compute_out) + i, p);
    }
  }
  for (; i < end; ++i) detail::adamw_one(a, c, i);
  // Streaming stores are weakly ordered: make them globally visible before this returns (the
  // caller then signals other threads / a DMA engine that the output is ready).
  if (nt) _mm_sfence();
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
