#include "megatrain/cpu_adam/adam_driver.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "megatrain/common/cpu_features.h"
#include "megatrain/common/tuning.h"
#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

namespace megatrain {
namespace cpu_adam {
namespace {

void run_chunks(int64_t chunks, const ParallelFor& pfor, const std::function<void(int64_t, int64_t)>& body) {
  if (chunks <= 0) return;
  if (pfor) {
    pfor(chunks, body);
  } else {
    body(0, chunks);
  }
}

int64_t elem_bytes(GradDtype d) { return d == GradDtype::kFloat32 ? 4 : 2; }
int64_t elem_bytes(OutDtype d) { return d == OutDtype::kFloat32 ? 4 : d == OutDtype::kBFloat16 ? 2 : 0; }

}  // namespace

void adamw_tensor(AdamArgs a, const AdamHyper& h, int64_t n, const ParallelFor& pfor) {
  const AdamConstants c = make_adam_constants(h);
  if (n <= 0) return;
  // Streaming stores only for outputs far larger than the caches, where the compute copy is not
  // read again before it is evicted anyway, and not when the gradient is read from the output
  // itself (training's direct D2H into the compute section): the kernel has just loaded those
  // lines, so there is no read-for-ownership to save.
  const common::Tuning tune = common::tuning();
  bool grad_in_out = false;
  if (a.compute_out != nullptr) {
    const char* g0 = static_cast<const char*>(a.grad);
    const char* g1 = g0 + n * elem_bytes(a.grad_dtype);
    const char* o0 = static_cast<const char*>(a.compute_out);
    const char* o1 = o0 + n * elem_bytes(a.out_dtype);
    grad_in_out = g0 < o1 && o0 < g1;
  }
  a.nt_out = tune.nt_stores && a.out_dtype != OutDtype::kNone && n >= tune.nt_min_numel && !grad_in_out;
  a.prefetch_bytes = tune.prefetch_bytes;
  const common::CpuIsa isa = common::active_isa();
  const int64_t chunks = (n + kChunkNumel - 1) / kChunkNumel;
  run_chunks(chunks, pfor, [&](int64_t c0, int64_t c1) {
    for (int64_t ci = c0; ci < c1; ++ci) {
      adamw_range(a, c, ci * kChunkNumel, std::min(n, (ci + 1) * kChunkNumel), isa);
    }
  });
}

double grad_accumulate_tensor(float* accum, const void* grad, GradDtype grad_dtype, bool overwrite,
                              int64_t n, const ParallelFor& pfor) {
  if (n <= 0) return 0.0;
  const common::CpuIsa isa = common::active_isa();
  const int64_t chunks = (n + kChunkNumel - 1) / kChunkNumel;
  std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
  run_chunks(chunks, pfor, [&](int64_t c0, int64_t c1) {
    for (int64_t ci = c0; ci < c1; ++ci) {
      partial[ci] = grad_accumulate_range(accum, grad, grad_dtype, overwrite, ci * kChunkNumel,
                                          std::min(n, (ci + 1) * kChunkNumel), isa);
    }
  });
  double sumsq = 0.0;
  for (double p : partial) sumsq += p;  // fixed order: deterministic for any thread count
  return sumsq;
}

void weights_from_master(const float* master, void* compute, OutDtype out_dtype, int64_t n) {
  if (out_dtype == OutDtype::kFloat32) {
    if (n > 0) std::memcpy(compute, master, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  if (out_dtype != OutDtype::kBFloat16) {
    throw std::invalid_argument("weights_from_master: the compute copy must be float32 or bfloat16");
  }
  auto* out = static_cast<uint16_t*>(compute);
  for (int64_t i = 0; i < n; ++i) out[i] = detail::float_to_bf16_rne(master[i]);
}

}  // namespace cpu_adam
}  // namespace megatrain
