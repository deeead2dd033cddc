// AVX-512 variant of the STREAM-style bandwidth kernels (see stream_kernels.h). Built for every
// x86-64 target, only called when the CPU has AVX-512 (runtime dispatch); the ISA is enabled for
// this file's own functions only, after all headers.
#include <immintrin.h>

#include <cstdint>

#include "megatrain/bench/stream_kernels.h"

#if defined(__x86_64__)

#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"))), \
                             apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace megatrain {
namespace bench {
namespace kernels {
namespace {

inline bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

// p, m, v at [i, i + 16) updated in place; returns the new p.
inline __m512 adam16(const StreamArgs& s, int64_t i) {
  const __m512 k = _mm512_set1_ps(0.5f);
  __m512 g;
  if (s.g_bf16) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(s.g) + i));
    g = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    g = _mm512_loadu_ps(static_cast<const float*>(s.g) + i);
  }
  const __m512 p = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(s.p + i), k), g);
  const __m512 m = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(s.m + i), k), g);
  const __m512 v = _mm512_add_ps(_mm512_mul_ps(_mm512_loadu_ps(s.v + i), k), _mm512_mul_ps(g, g));
  _mm512_storeu_ps(s.p + i, p);
  _mm512_storeu_ps(s.m + i, m);
  _mm512_storeu_ps(s.v + i, v);
  return p;
}

inline __m256i trunc_bf16x16(__m512 p) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(p), 16));
}

}  // namespace

void stream_avx512(const StreamArgs& s, int64_t begin, int64_t end) {
  int64_t i = begin;
  switch (s.kind) {
    case StreamKind::kCopy:
      if (s.nt) {
        while (i < end && !aligned64(s.a + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + 16 <= end; i += 16) _mm512_stream_ps(s.a + i, _mm512_loadu_ps(s.b + i));
      } else {
        for (; i + 16 <= end; i += 16) _mm512_storeu_ps(s.a + i, _mm512_loadu_ps(s.b + i));
      }
      break;
    case StreamKind::kTriad: {
      const __m512 k = _mm512_set1_ps(3.0f);
      if (s.nt) {
        while (i < end && !aligned64(s.a + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + 16 <= end; i += 16) {
          _mm512_stream_ps(s.a + i, _mm512_add_ps(_mm512_loadu_ps(s.b + i), _mm512_mul_ps(k, _mm512_loadu_ps(s.c + i))));
        }
      } else {
        for (; i + 16 <= end; i += 16) {
          _mm512_storeu_ps(s.a + i, _mm512_add_ps(_mm512_loadu_ps(s.b + i), _mm512_mul_ps(k, _mm512_loadu_ps(s.c + i))));
        }
      }
      break;
    }
    case StreamKind::kAdam:
      if (s.nt && s.out != nullptr) {
        while (i < end && !aligned64(s.out + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + 32 <= end; i += 32) {
          const __m512 p0 = adam16(s, i);
          const __m512 p1 = adam16(s, i + 16);
          _mm512_stream_si512(reinterpret_cast<__m512i*>(s.out + i),
                              _mm512_inserti64x4(_mm512_castsi256_si512(trunc_bf16x16(p0)), trunc_bf16x16(p1), 1));
        }
      }
      for (; i + 16 <= end; i += 16) {
        const __m512 p = adam16(s, i);
        if (s.out != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.out + i), trunc_bf16x16(p));
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
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

#endif  // __x86_64__
