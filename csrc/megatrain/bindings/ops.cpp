// TORCH_LIBRARY(megatrain) CPU ops over the torch-free CPU Adam kernels.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "megatrain/common/cpu_features.h"
#include "megatrain/cpu_adam/adam_driver.h"
#include "megatrain/bindings/tensor_checks.h"
#include "megatrain/cpu_adam/adam_kernels.h"

namespace megatrain {
namespace bindings {
namespace {

using cpu_adam::GradDtype;
using cpu_adam::OutDtype;

void adamw_step_cpu(const at::Tensor& master, const at::Tensor& exp_avg,
                    const at::Tensor& exp_avg_sq, const at::Tensor& grad,
                    const std::optional<at::Tensor>& compute_out, double lr, double beta1,
                    double beta2, double eps, double weight_decay, int64_t step,
                    double grad_scale) {
  constexpr const char* op = "megatrain::adamw_step_";
  const int64_t n = master.numel();
  check_fp32_state(master, op, "master", n);
  check_fp32_state(exp_avg, op, "exp_avg", n);
  check_fp32_state(exp_avg_sq, op, "exp_avg_sq", n);
  const GradDtype gdt = grad_dtype_of(grad, op, n);
  OutDtype odt = OutDtype::kNone;
  void* out_ptr = nullptr;
  if (compute_out.has_value()) {
    odt = out_dtype_of(*compute_out, op, "compute_out", n);
    out_ptr = compute_out->data_ptr();
  }
  TORCH_CHECK_VALUE(step >= 1, op, ": step must be >= 1 (the step count after this update), got ",
                    step);
  TORCH_CHECK_VALUE(lr >= 0.0, op, ": lr must be >= 0, got ", lr);
  TORCH_CHECK_VALUE(beta1 >= 0.0 && beta1 < 1.0 && beta2 >= 0.0 && beta2 < 1.0, op,
                    ": betas must be in [0, 1), got (", beta1, ", ", beta2, ")");
  TORCH_CHECK_VALUE(eps >= 0.0, op, ": eps must be >= 0, got ", eps);
  if (n == 0) return;

  const cpu_adam::AdamHyper h =
      bindings::adam_hyper(lr, beta1, beta2, eps, weight_decay, step, static_cast<float>(grad_scale));
  cpu_adam::AdamArgs a;
  a.master = master.data_ptr<float>();
  a.exp_avg = exp_avg.data_ptr<float>();
  a.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  a.grad = grad.data_ptr();
  a.grad_dtype = gdt;
  a.compute_out = out_ptr;
  a.out_dtype = odt;
  cpu_adam::adamw_tensor(a, h, n, aten_parallel_for);
}

at::Tensor grad_accumulate_cpu(const at::Tensor& accum, const at::Tensor& grad, bool overwrite) {
  constexpr const char* op = "megatrain::grad_accumulate_";
  const int64_t n = accum.numel();
  check_fp32_state(accum, op, "accum", n);
  const GradDtype gdt = grad_dtype_of(grad, op, n);
  const double sumsq = cpu_adam::grad_accumulate_tensor(accum.data_ptr<float>(), grad.data_ptr(), gdt,
                                                        overwrite, n, aten_parallel_for);
  return at::scalar_tensor(sumsq, at::TensorOptions().dtype(at::kDouble));
}

}  // namespace
}  // namespace bindings
}  // namespace megatrain

TORCH_LIBRARY(megatrain, m) {
  m.def(
      "adamw_step_(Tensor(a!) master, Tensor(b!) exp_avg, Tensor(c!) exp_avg_sq, Tensor grad, "
      "Tensor(d!)? compute_out, float lr, float beta1, float beta2, float eps, "
      "float weight_decay, int step, float grad_scale) -> ()");
  m.def("grad_accumulate_(Tensor(a!) accum, Tensor grad, bool overwrite) -> Tensor");
}

TORCH_LIBRARY_IMPL(megatrain, CPU, m) {
  m.impl("adamw_step_", &megatrain::bindings::adamw_step_cpu);
  m.impl("grad_accumulate_", &megatrain::bindings::grad_accumulate_cpu);
}
