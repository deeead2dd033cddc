// The fused AdamW and gradient-accumulate loops, written once for every vector ISA. V is a lane
// set from common/simd/vec_<isa>.h (kWidth fp32 lanes F, kWidth / 2 double lanes D, and the
// operations below). Each kernels/adam_<isa>.cpp includes this between
// MEGATRAIN_ISA_TARGET_BEGIN/END and instantiates adamw_simd<V> / grad_accumulate_simd<V>;
// everything here has internal linkage, so each ISA gets its own copy.
//
// Every operation is the one the scalar reference (adam_scalar_inl.h) does, in the same order and
// with the same roundings, so all variants agree bit for bit (tests/cpp/test_cpu_adam.cpp).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

namespace megatrain {
namespace cpu_adam {
namespace kernels {
namespace {

template <class V>
struct VecConstants {
  using F = typename V::F;
  F gs, decay, w, wm1, b2, omb2, ss, bc2s, eps;
  bool lerp_low;

  explicit VecConstants(const AdamConstants& c)
      : gs(V::set1(c.grad_scale)),
        decay(V::set1(c.decay)),
        w(V::set1(c.lerp_weight)),
        wm1(V::set1(c.lerp_weight - 1.0f)),
        b2(V::set1(c.beta2)),
        omb2(V::set1(c.one_minus_beta2)),
        ss(V::set1(c.step_size)),
        bc2s(V::set1(c.bc2_sqrt)),
        eps(V::set1(c.eps)),
        lerp_low(c.lerp_low) {}
};

template <class V>
typename V::F load_grad_vec(const void* grad, GradDtype dt, int64_t i) {
  if (dt == GradDtype::kFloat32) return V::load(static_cast<const float*>(grad) + i);
  return V::load_bf16(static_cast<const uint16_t*>(grad) + i);
}

// Updates master / exp_avg / exp_avg_sq at [i, i + kWidth); returns the new master.
template <class V>
typename V::F adamw_vec(const AdamArgs& a, const VecConstants<V>& k, int64_t i) {
  using F = typename V::F;
  const F g = V::mul(load_grad_vec<V>(a.grad, a.grad_dtype, i), k.gs);
  F p = V::mul(V::load(a.master + i), k.decay);
  F m = V::load(a.exp_avg + i);
  if (k.lerp_low) {
    m = V::fmadd(k.w, V::sub(g, m), m);  // torch.lerp: one fma
  } else {
    m = V::fmadd(k.wm1, V::sub(g, m), g);
  }
  const F v = V::fmadd(V::mul(k.omb2, g), g, V::mul(V::load(a.exp_avg_sq + i), k.b2));  // as torch addcmul
  const F denom = V::add(V::div(V::sqrt(v), k.bc2s), k.eps);
  p = V::sub(p, V::div(V::mul(k.ss, m), denom));
  V::store(a.master + i, p);
  V::store(a.exp_avg + i, m);
  V::store(a.exp_avg_sq + i, v);
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

template <class V>
void adamw_simd(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  using F = typename V::F;
  constexpr int64_t kW = V::kWidth;
  constexpr int64_t kVecs32 = 32 / kW;  // vectors per 32 elements
  static_assert(kW <= 16 && 16 % kW == 0, "a lane set is 16 / 2^k fp32 lanes");
  const VecConstants<V> k(c);
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
      F p[kVecs32];
      for (int64_t j = 0; j < kVecs32; ++j) p[j] = adamw_vec<V>(a, k, i + j * kW);
      if (a.out_dtype == OutDtype::kBFloat16) {
        V::stream_line(static_cast<uint16_t*>(a.compute_out) + i, V::bf16_rne_x16(p),
                       V::bf16_rne_x16(p + kVecs32 / 2));
      } else {
        float* out = static_cast<float*>(a.compute_out) + i;
        for (int64_t j = 0; j < kVecs32; ++j) V::stream(out + j * kW, p[j]);
      }
    }
  }
  for (; i + kW <= end; i += kW) {
    // One prefetch per 64-byte line of fp32 state: every vector when a vector is a whole line.
    if (pf > 0 && (kW * 4 >= 64 || (i & 15) == 0)) prefetch16(a, i, pf);
    const F p = adamw_vec<V>(a, k, i);
    if (a.out_dtype == OutDtype::kBFloat16) {
      V::store_bf16_rne(static_cast<uint16_t*>(a.compute_out) + i, p);
    } else if (a.out_dtype == OutDtype::kFloat32) {
      V::store(static_cast<float*>(a.compute_out) + i, p);
    }
  }
  detail::adamw_elements(a, c, i, end);
  // Streaming stores are weakly ordered: make them globally visible before this returns (the
  // caller then signals other threads / a DMA engine that the output is ready).
  if (nt) _mm_sfence();
}

template <class V>
double grad_accumulate_simd(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                            int64_t begin, int64_t end) {
  using F = typename V::F;
  using D = typename V::D;
  constexpr int64_t kW = V::kWidth;
  D s0 = V::zero_d();
  D s1 = V::zero_d();
  int64_t i = begin;
  for (; i + kW <= end; i += kW) {
    const F g = load_grad_vec<V>(grad, grad_dtype, i);
    const F r = overwrite ? g : V::add(V::load(accum + i), g);
    V::store(accum + i, r);
    const D lo = V::widen_lo(r);
    const D hi = V::widen_hi(r);
    s0 = V::add_d(s0, V::mul_d(lo, lo));
    s1 = V::add_d(s1, V::mul_d(hi, hi));
  }
  // Pairwise sum of the double lanes: ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) ...
  alignas(64) double lanes[kW / 2];
  V::store_d(lanes, V::add_d(s0, s1));
  for (int64_t n = kW / 2; n > 1; n /= 2) {
    for (int64_t j = 0; j < n / 2; ++j) lanes[j] = lanes[2 * j] + lanes[2 * j + 1];
  }
  return detail::accumulate_elements(accum, grad, grad_dtype, overwrite, i, end, lanes[0]);
}

}  // namespace
}  // namespace kernels
}  // namespace cpu_adam
}  // namespace megatrain
