// 8 x fp32 lanes (AVX2 + FMA) as the operation set the vector kernel bodies are written against
// (kernels/adam_simd_inl.h, bench/stream_simd_inl.h). Include only between
// MEGATRAIN_ISA_TARGET_BEGIN("avx2,fma") and MEGATRAIN_ISA_TARGET_END() (isa_target.h): it is
// compiled for AVX2 and has internal linkage, so each including file gets its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace megatrain {
namespace simd {
namespace {

struct Avx2 {
  static constexpr int64_t kWidth = 8;  ///< fp32 lanes of F
  using F = __m256;                     ///< kWidth floats
  using D = __m256d;                    ///< kWidth / 2 doubles

  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F x) { _mm256_storeu_ps(p, x); }
  /// Non-temporal store; p 32-byte aligned.
  static void stream(float* p, F x) { _mm256_stream_ps(p, x); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F div(F a, F b) { return _mm256_div_ps(a, b); }
  static F sqrt(F a) { return _mm256_sqrt_ps(a); }
  /// a * b + c with one rounding.
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }

  /// kWidth bf16 bit patterns -> fp32 (exact).
  static F load_bf16(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  /// Round-to-nearest-even fp32 -> bf16, NaN -> 0x7FC0 (bit-identical to
  /// cpu_adam::detail::float_to_bf16_rne), stored unaligned.
  static void store_bf16_rne(uint16_t* p, F x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), bf16_rne(x)); }
  /// The 16 values of x[0 .. 16 / kWidth) -> 16 bf16 (round to nearest even), in element order.
  static __m256i bf16_rne_x16(const F* x) { return _mm256_set_m128i(bf16_rne(x[1]), bf16_rne(x[0])); }
  /// The 16 values of x[0 .. 16 / kWidth) -> 16 bf16 by truncation (high halves), in element order.
  static __m256i bf16_trunc_x16(const F* x) {
    const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(x[0]), 16);
    const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(x[1]), 16);
    // packus works per 128-bit lane: [a0-3 b0-3 | a4-7 b4-7] -> qwords 0, 2, 1, 3.
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
  }
  /// One 64-byte line, lo then hi, with non-temporal stores; p 64-byte aligned.
  static void stream_line(void* p, __m256i lo, __m256i hi) {
    __m256i* out = static_cast<__m256i*>(p);
    _mm256_stream_si256(out, lo);
    _mm256_stream_si256(out + 1, hi);
  }

  static D zero_d() { return _mm256_setzero_pd(); }
  static D add_d(D a, D b) { return _mm256_add_pd(a, b); }
  static D mul_d(D a, D b) { return _mm256_mul_pd(a, b); }
  /// Lanes [0, kWidth / 2) / [kWidth / 2, kWidth) of x as doubles.
  static D widen_lo(F x) { return _mm256_cvtps_pd(_mm256_castps256_ps128(x)); }
  static D widen_hi(F x) { return _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1)); }
  /// p aligned to sizeof(D).
  static void store_d(double* p, D x) { _mm256_store_pd(p, x); }

 private:
  static __m128i bf16_rne(F p) {
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
};

}  // namespace
}  // namespace simd
}  // namespace megatrain
