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
inline __m256i bf16x16(__m512 p) {
  const __m512i u = _mm512_castps_si512(p);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
  r = _mm512_srli_epi32(r, 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

struct Consts {
  __m512 gs, decay, w, wm1, b2, omb2, ss, bc2s, eps;
  bool lerp_low;
};

inline Consts make_consts(const AdamConstants& c) {
  Consts k;
  k.gs = _mm512_set1_ps(c.grad_scale);
  k.decay = _mm512_set1_ps(c.decay);
  k.w = _mm512_set1_ps(c.lerp_weight);
  k.wm1 = _mm512_set1_ps(c.lerp_weight - 1.0f);
  k.b2 = _mm512_set1_ps(c.beta2);
  k.omb2 = _mm512_set1_ps(c.one_minus_beta2);
  k.ss = _mm512_set1_ps(c.step_size);
  k.bc2s = _mm512_set1_ps(c.bc2_sqrt);
  k.eps = _mm512_set1_ps(c.eps);
  k.lerp_low = c.lerp_low;
  return k;
}

// Updates master / exp_avg / exp_avg_sq at [i, i + 16); returns the new master.
inline __m512 step16(const AdamArgs& a, const Consts& k, int64_t i) {
  const __m512 g = _mm512_mul_ps(load16_grad(a.grad, a.grad_dtype, i), k.gs);
  __m512 p = _mm512_mul_ps(_mm512_loadu_ps(a.master + i), k.decay);
  __m512 m = _mm512_loadu_ps(a.exp_avg + i);
  if (k.lerp_low) {
    m = _mm512_fmadd_ps(k.w, _mm512_sub_ps(g, m), m);  // torch.lerp: one fma
  } else {
    m = _mm512_fmadd_ps(k.wm1, _mm512_sub_ps(g, m), g);
  }
  const __m512 v = _mm512_fmadd_ps(_mm512_mul_ps(k.omb2, g), g,
                                    _mm512_mul_ps(_mm512_loadu_ps(a.exp_avg_sq + i), k.b2));  // as torch addcmul
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), k.bc2s), k.eps);
  p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(k.ss, m), denom));
  _mm512_storeu_ps(a.master + i, p);
  _mm512_storeu_ps(a.exp_avg + i, m);
  _mm512_storeu_ps(a.exp_avg_sq + i, v);
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

void adamw_avx512(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
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
      const __m512 p0 = step16(a, k, i);
      const __m512 p1 = step16(a, k, i + 16);
      if (a.out_dtype == OutDtype::kBFloat16) {
        const __m512i line = _mm512_inserti64x4(_mm512_castsi256_si512(bf16x16(p0)), bf16x16(p1), 1);
        _mm512_stream_si512(reinterpret_cast<__m512i*>(static_cast<uint16_t*>(a.compute_out) + i), line);
      } else {
        _mm512_stream_ps(static_cast<float*>(a.compute_out) + i, p0);
        _mm512_stream_ps(static_cast<float*>(a.compute_out) + i + 16, p1);
      }
    }
  }
  for (; i + 16 <= end; i += 16) {
    if (pf > 0) prefetch16(a, i, pf);
    const __m512 p = step16(a, k, i);
    if (a.out_dtype == OutDtype::kBFloat16) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(a.compute_out) + i), bf16x16(p));
    } else if (a.out_dtype == OutDtype::kFloat32) {
      _mm512_storeu_ps(static_cast<float*>(a.compute_out) + i, p);
    }
  }
  for (; i < end; ++i) detail::adamw_one(a, c, i);
  // Streaming stores are weakly ordered: make them globally visible before this returns (the
  // caller then signals other threads / a DMA engine that the output is ready).
  if (nt) _mm_sfence();
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
