// AVX2 variant of the STREAM-style bandwidth kernels (see stream_kernels.h). Built for every
// x86-64 target, only called when the CPU has AVX2 (runtime dispatch); the ISA is enabled for
// this file's own functions only, after all headers.
#include <immintrin.h>

#include <cstdint>

#include "megatrain/bench/stream_kernels.h"

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif

namespace megatrain {
namespace bench {
namespace kernels {
namespace {

inline bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

// p, m, v at [i, i + 8) updated in place; returns the new p.
inline __m256 adam8(const StreamArgs& s, int64_t i) {
  const __m256 k = _mm256_set1_ps(0.5f);
  __m256 g;
  if (s.g_bf16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(s.g) + i));
    g = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    g = _mm256_loadu_ps(static_cast<const float*>(s.g) + i);
  }
  const __m256 p = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s.p + i), k), g);
  const __m256 m = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s.m + i), k), g);
  const __m256 v = _mm256_add_ps(_mm256_mul_ps(_mm256_loadu_ps(s.v + i), k), _mm256_mul_ps(g, g));
  _mm256_storeu_ps(s.p + i, p);
  _mm256_storeu_ps(s.m + i, m);
  _mm256_storeu_ps(s.v + i, v);
  return p;
}

// High halves of two 8 x fp32 vectors -> 16 x bf16 (truncation), in element order.
inline __m256i trunc_bf16x16(__m256 p0, __m256 p1) {
  const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(p0), 16);
  const __m256i b = _mm256_srli_epi32(_mm256_castps_si256(p1), 16);
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8);
}

}  // namespace

void stream_avx2(const StreamArgs& s, int64_t begin, int64_t end) {
  int64_t i = begin;
  switch (s.kind) {
    case StreamKind::kCopy:
      if (s.nt) {
        while (i < end && !aligned64(s.a + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + 8 <= end; i += 8) _mm256_stream_ps(s.a + i, _mm256_loadu_ps(s.b + i));
      } else {
        for (; i + 8 <= end; i += 8) _mm256_storeu_ps(s.a + i, _mm256_loadu_ps(s.b + i));
      }
      break;
    case StreamKind::kTriad: {
      const __m256 k = _mm256_set1_ps(3.0f);
      if (s.nt) {
        while (i < end && !aligned64(s.a + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + 8 <= end; i += 8) {
          _mm256_stream_ps(s.a + i, _mm256_add_ps(_mm256_loadu_ps(s.b + i), _mm256_mul_ps(k, _mm256_loadu_ps(s.c + i))));
        }
      } else {
        for (; i + 8 <= end; i += 8) {
          _mm256_storeu_ps(s.a + i, _mm256_add_ps(_mm256_loadu_ps(s.b + i), _mm256_mul_ps(k, _mm256_loadu_ps(s.c + i))));
        }
      }
      break;
    }
    case StreamKind::kAdam:
      if (s.nt && s.out != nullptr) {
        while (i < end && !aligned64(s.out + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + 32 <= end; i += 32) {
          const __m256 p0 = adam8(s, i), p1 = adam8(s, i + 8);
          const __m256 p2 = adam8(s, i + 16), p3 = adam8(s, i + 24);
          __m256i* out = reinterpret_cast<__m256i*>(s.out + i);
          _mm256_stream_si256(out, trunc_bf16x16(p0, p1));
          _mm256_stream_si256(out + 1, trunc_bf16x16(p2, p3));
        }
      }
      for (; i + 16 <= end; i += 16) {
        const __m256 p0 = adam8(s, i), p1 = adam8(s, i + 8);
        if (s.out != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.out + i), trunc_bf16x16(p0, p1));
      }
      break;
  }
  stream_scalar(s, i, end);
  if (s.nt) _mm_sfence();
}

}  // namespace kernels
}  // namespace bench
}  // namespace megatrain

#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

#endif  // __x86_64__
