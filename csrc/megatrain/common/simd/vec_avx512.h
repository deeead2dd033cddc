// 16 x fp32 lanes (AVX-512 F/BW/VL/DQ) as the operation set the vector kernel bodies are written
// against (kernels/adam_simd_inl.h, bench/stream_simd_inl.h). Include only between
// MEGATRAIN_ISA_TARGET_BEGIN("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma") and
// MEGATRAIN_ISA_TARGET_END() (isa_target.h): it is compiled for AVX-512 and has internal linkage,
// so each including file gets its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace megatrain {
namespace simd {
namespace {

struct Avx512 {
  static constexpr int64_t kWidth = 16;  ///< fp32 lanes of F
  using F = __m512;                      ///< kWidth floats
  using D = __m512d;                     ///< kWidth / 2 doubles

  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F x) { _mm512_storeu_ps(p, x); }
  /// Non-temporal store; p 64-byte aligned.
  static void stream(float* p, F x) { _mm512_stream_ps(p, x); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F div(F a, F b) { return _mm512_div_ps(a, b); }
  static F sqrt(F a) { return _mm512_sqrt_ps(a); }
  /// a * b + c with one rounding.
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }

  /// kWidth bf16 bit patterns -> fp32 (exact).
  static F load_bf16(const uint16_t* p) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  /// Round-to-nearest-even fp32 -> bf16, NaN -> 0x7FC0 (bit-identical to
  /// cpu_adam::detail::float_to_bf16_rne), stored unaligned.
  static void store_bf16_rne(uint16_t* p, F x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), bf16_rne(x)); }
  /// The 16 values of x[0 .. 16 / kWidth) -> 16 bf16 (round to nearest even), in element order.
  static __m256i bf16_rne_x16(const F* x) { return bf16_rne(x[0]); }
  /// The 16 values of x[0 .. 16 / kWidth) -> 16 bf16 by truncation (high halves), in element order.
  static __m256i bf16_trunc_x16(const F* x) {
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x[0]), 16));
  }
  /// One 64-byte line, lo then hi, with one non-temporal store; p 64-byte aligned.
  static void stream_line(void* p, __m256i lo, __m256i hi) {
    _mm512_stream_si512(static_cast<__m512i*>(p), _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
  }

  static D zero_d() { return _mm512_setzero_pd(); }
  static D add_d(D a, D b) { return _mm512_add_pd(a, b); }
  static D mul_d(D a, D b) { return _mm512_mul_pd(a, b); }
  /// Lanes [0, kWidth / 2) / [kWidth / 2, kWidth) of x as doubles.
  static D widen_lo(F x) { return _mm512_cvtps_pd(_mm512_castps512_ps256(x)); }
  static D widen_hi(F x) { return _mm512_cvtps_pd(_mm512_extractf32x8_ps(x, 1)); }
  /// p aligned to sizeof(D).
  static void store_d(double* p, D x) { _mm512_store_pd(p, x); }

 private:
  static __m256i bf16_rne(F p) {
    const __m512i u = _mm512_castps_si512(p);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb);
    r = _mm512_srli_epi32(r, 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    return _mm512_cvtepi32_epi16(r);
  }
};

}  // namespace
}  // namespace simd
}  // namespace megatrain
