// Scalar per-element AdamW math, shared by the scalar kernel and the vector kernels' heads and tails.
// Compiled with -ffp-contract=off everywhere so no FMA changes the rounding between variants.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "megatrain/cpu_adam/adam_kernels.h"

namespace megatrain {
namespace cpu_adam {
namespace detail {

inline float bf16_to_float(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}

// Same rounding as c10::detail::round_to_nearest_even (what tensor.to(torch.bfloat16) does).
inline uint16_t float_to_bf16_rne(float f) {
  if (std::isnan(f)) return UINT16_C(0x7FC0);
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u += UINT32_C(0x7FFF) + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float load_grad(const void* grad, GradDtype dt, int64_t i) {
  return dt == GradDtype::kFloat32 ? static_cast<const float*>(grad)[i]
                                   : bf16_to_float(static_cast<const uint16_t*>(grad)[i]);
}

inline void adamw_one(const AdamArgs& a, const AdamConstants& c, int64_t i) {
  const float g = load_grad(a.grad, a.grad_dtype, i) * c.grad_scale;
  float p = a.master[i] * c.decay;
  float m = a.exp_avg[i];
  // torch.lerp as its vectorized CPU kernel computes it (ATen LerpKernel: one fused multiply-add):
  // fma(w, end - start, start) for |w| < 0.5, else fma(w - 1, end - start, end). Matching it
  // bit for bit keeps megatrain's trajectory on top of torch.optim.AdamW's (parity tests).
  if (c.lerp_low) {
    m = std::fma(c.lerp_weight, g - m, m);
  } else {
    m = std::fma(c.lerp_weight - 1.0f, g - m, g);
  }
  // torch: exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1-beta2); addcmul's vector kernel is
  // fma(value * g, g, self).
  float v = std::fma(c.one_minus_beta2 * g, g, a.exp_avg_sq[i] * c.beta2);
  const float denom = std::sqrt(v) / c.bc2_sqrt + c.eps;
  p = p - (c.step_size * m) / denom;
  a.master[i] = p;
  a.exp_avg[i] = m;
  a.exp_avg_sq[i] = v;
  if (a.out_dtype == OutDtype::kBFloat16) {
    static_cast<uint16_t*>(a.compute_out)[i] = float_to_bf16_rne(p);
  } else if (a.out_dtype == OutDtype::kFloat32) {
    static_cast<float*>(a.compute_out)[i] = p;
  }
}

inline float accumulate_one(float* accum, const void* grad, GradDtype dt, bool overwrite,
                            int64_t i) {
  const float g = load_grad(grad, dt, i);
  const float r = overwrite ? g : accum[i] + g;
  accum[i] = r;
  return r;
}

// Elements [begin, end) one at a time: the scalar kernel, and the vector kernels' remainders.
inline void adamw_elements(const AdamArgs& a, const AdamConstants& c, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) adamw_one(a, c, i);
}

// accumulate_one over [begin, end); returns sumsq plus the squares of the results, added in order.
inline double accumulate_elements(float* accum, const void* grad, GradDtype dt, bool overwrite,
                                  int64_t begin, int64_t end, double sumsq) {
  for (int64_t i = begin; i < end; ++i) {
    const double r = accumulate_one(accum, grad, dt, overwrite, i);
    sumsq += r * r;
  }
  return sumsq;
}

}  // namespace detail
}  // namespace cpu_adam
}  // namespace megatrain
