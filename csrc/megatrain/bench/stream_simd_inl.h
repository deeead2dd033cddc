// The STREAM-style bandwidth kernels (stream_kernels.h), written once for every vector ISA. V is
// a lane set from common/simd/vec_<isa>.h. Each bench/stream_<isa>.cpp includes this between
// MEGATRAIN_ISA_TARGET_BEGIN/END and instantiates stream_simd<V>; everything here has internal
// linkage, so each ISA gets its own copy.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "megatrain/bench/stream_kernels.h"

namespace megatrain {
namespace bench {
namespace kernels {
namespace {

inline bool aligned64(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 63) == 0; }

// p, m, v at [i, i + kWidth) updated in place; returns the new p.
template <class V>
typename V::F adam_like_vec(const StreamArgs& s, int64_t i) {
  using F = typename V::F;
  const F k = V::set1(0.5f);
  F g;
  if (s.g_bf16) {
    g = V::load_bf16(static_cast<const uint16_t*>(s.g) + i);
  } else {
    g = V::load(static_cast<const float*>(s.g) + i);
  }
  const F p = V::add(V::mul(V::load(s.p + i), k), g);
  const F m = V::add(V::mul(V::load(s.m + i), k), g);
  const F v = V::add(V::mul(V::load(s.v + i), k), V::mul(g, g));
  V::store(s.p + i, p);
  V::store(s.m + i, m);
  V::store(s.v + i, v);
  return p;
}

template <class V>
void stream_simd(const StreamArgs& s, int64_t begin, int64_t end) {
  using F = typename V::F;
  constexpr int64_t kW = V::kWidth;
  static_assert(kW <= 16 && 16 % kW == 0, "a lane set is 16 / 2^k fp32 lanes");
  int64_t i = begin;
  switch (s.kind) {
    case StreamKind::kCopy:
      if (s.nt) {
        while (i < end && !aligned64(s.a + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + kW <= end; i += kW) V::stream(s.a + i, V::load(s.b + i));
      } else {
        for (; i + kW <= end; i += kW) V::store(s.a + i, V::load(s.b + i));
      }
      break;
    case StreamKind::kTriad: {
      const F k = V::set1(3.0f);
      if (s.nt) {
        while (i < end && !aligned64(s.a + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + kW <= end; i += kW) V::stream(s.a + i, V::add(V::load(s.b + i), V::mul(k, V::load(s.c + i))));
      } else {
        for (; i + kW <= end; i += kW) V::store(s.a + i, V::add(V::load(s.b + i), V::mul(k, V::load(s.c + i))));
      }
      break;
    }
    case StreamKind::kAdam:
      if (s.nt && s.out != nullptr) {
        // 32 elements: one whole 64-byte line of bf16 output per iteration.
        while (i < end && !aligned64(s.out + i)) ++i;
        stream_scalar(s, begin, i);
        for (; i + 32 <= end; i += 32) {
          F p[32 / kW];
          for (int64_t j = 0; j < 32 / kW; ++j) p[j] = adam_like_vec<V>(s, i + j * kW);
          V::stream_line(s.out + i, V::bf16_trunc_x16(p), V::bf16_trunc_x16(p + 16 / kW));
        }
      }
      for (; i + 16 <= end; i += 16) {
        F p[16 / kW];
        for (int64_t j = 0; j < 16 / kW; ++j) p[j] = adam_like_vec<V>(s, i + j * kW);
        if (s.out != nullptr) _mm256_storeu_si256(reinterpret_cast<__m256i*>(s.out + i), V::bf16_trunc_x16(p));
      }
      break;
  }
  stream_scalar(s, i, end);
  if (s.nt) _mm_sfence();
}

}  // namespace
}  // namespace kernels
}  // namespace bench
}  // namespace megatrain
