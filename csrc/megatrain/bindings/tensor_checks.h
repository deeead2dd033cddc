// Boundary checks of CPU tensors handed to the kernels, and the parallel loop the kernels run on
// (shared by the torch ops and the scheduler's tasks).
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <functional>

#include <string>

#include "megatrain/cpu_adam/adam_kernels.h"

namespace megatrain {
namespace bindings {

// "[a, b, c]" built with std::to_string only: on the H200 build, streaming c10 types into the
// error message is the suspect of a crash (SIGSEGV instead of ValueError).
inline std::string int_list(c10::IntArrayRef v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  return s + "]";
}

inline void check_cpu_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu(), op, ": ", name, " must be a CPU tensor, got device ",
                    t.device().str());
  TORCH_CHECK_VALUE(t.is_contiguous(), op, ": ", name,
                    " must be contiguous (in-place ops never work on a hidden copy), got sizes ",
                    int_list(t.sizes()), " and strides ", int_list(t.strides()));
}

inline void check_fp32_state(const at::Tensor& t, const char* op, const char* name, int64_t numel) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat, op, ": ", name,
                   " must be a contiguous float32 CPU tensor, got dtype ", t.scalar_type());
  check_cpu_contiguous(t, op, name);
  TORCH_CHECK_VALUE(t.numel() == numel, op, ": ", name, " must have ", numel,
                    " elements (the numel of the first tensor), got ", t.numel());
}

inline cpu_adam::GradDtype grad_dtype_of(const at::Tensor& grad, const char* op, int64_t numel) {
  TORCH_CHECK_TYPE(grad.scalar_type() == at::kFloat || grad.scalar_type() == at::kBFloat16, op,
                   ": grad must be a contiguous float32 or bfloat16 CPU tensor, got dtype ",
                   grad.scalar_type());
  check_cpu_contiguous(grad, op, "grad");
  TORCH_CHECK_VALUE(grad.numel() == numel, op, ": grad must have ", numel,
                    " elements (the numel of the first tensor), got ", grad.numel());
  return grad.scalar_type() == at::kFloat ? cpu_adam::GradDtype::kFloat32 : cpu_adam::GradDtype::kBFloat16;
}

// The element type of a compute copy written by the kernels (bf16 or fp32), checked like grad.
inline cpu_adam::OutDtype out_dtype_of(const at::Tensor& out, const char* op, const char* name, int64_t numel) {
  TORCH_CHECK_TYPE(out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat, op, ": ", name,
                   " must be a contiguous bfloat16 or float32 CPU tensor, got dtype ", out.scalar_type());
  check_cpu_contiguous(out, op, name);
  TORCH_CHECK_VALUE(out.numel() == numel, op, ": ", name, " must have ", numel,
                    " elements (the numel of master), got ", out.numel());
  return out.scalar_type() == at::kFloat ? cpu_adam::OutDtype::kFloat32 : cpu_adam::OutDtype::kBFloat16;
}

// The hyperparameters of one AdamW step as the ops and the update tasks receive them.
inline cpu_adam::AdamHyper adam_hyper(double lr, double beta1, double beta2, double eps, double weight_decay,
                                      int64_t step, float grad_scale = 1.0f) {
  return cpu_adam::AdamHyper{lr, beta1, beta2, eps, weight_decay, step, grad_scale};  // the fields in order
}

// The cpu_adam drivers' chunks (cpu_adam::kChunkNumel, independent of the thread count) on
// torch's intra-op pool.
inline void aten_parallel_for(int64_t chunks, const std::function<void(int64_t, int64_t)>& body) {
  at::parallel_for(0, chunks, 1, body);
}

}  // namespace bindings
}  // namespace megatrain
