// Benchmark-only op of the megatrain._bench extension (not of _C): torch.ops.megatrain.bench_stream,
// the STREAM-style host bandwidth kernels (csrc/megatrain/bench/stream_kernels.h) run with the
// same at::parallel_for chunking as megatrain::adamw_step_, so benchmarks/bench_cpu_adam.py can set
// the fused AdamW against a bandwidth roofline measured on the same arrays, threads and run.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "megatrain/bench/stream_kernels.h"
#include "megatrain/common/cpu_features.h"

namespace megatrain {
namespace bindings {
namespace {

constexpr int64_t kChunkNumel = 64 * 1024;  // as adamw_step_ (ops.cpp)

float* fp32_arg(const at::Tensor& t, int64_t n, const char* name) {
  TORCH_CHECK_VALUE(t.device().is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat,
                    "bench_stream: ", name, " must be a contiguous float32 CPU tensor");
  TORCH_CHECK_VALUE(t.numel() == n, "bench_stream: ", name, " must have ", n, " elements, got ",
                    t.numel());
  return t.data_ptr<float>();
}

// Runs one pass of kernel `kind` over the arrays (all the same numel; see the schema) and
// returns the bytes it counts (explicit reads + writes).
// `isa`: "scalar" | "avx2" | "avx512", or "" for the best this CPU supports (MEGATRAIN_CPU_ISA
// overrides); this extension keeps no ISA choice of its own, so a benchmark passes _C.cpu_isa().
int64_t bench_stream_cpu(const std::string& kind, at::TensorList arrays, bool nt_stores,
                         const std::string& isa_name) {
  bench::StreamArgs s;
  s.kind = bench::parse_stream_kind(kind.c_str());
  s.nt = nt_stores;
  TORCH_CHECK_VALUE(!arrays.empty(), "bench_stream: no arrays");
  const int64_t n = arrays[0].numel();
  switch (s.kind) {
    case bench::StreamKind::kCopy:
      TORCH_CHECK_VALUE(arrays.size() == 2, "bench_stream copy: arrays = [dst, src]");
      s.a = fp32_arg(arrays[0], n, "dst");
      s.b = fp32_arg(arrays[1], n, "src");
      break;
    case bench::StreamKind::kTriad:
      TORCH_CHECK_VALUE(arrays.size() == 3, "bench_stream triad: arrays = [a, b, c]");
      s.a = fp32_arg(arrays[0], n, "a");
      s.b = fp32_arg(arrays[1], n, "b");
      s.c = fp32_arg(arrays[2], n, "c");
      break;
    case bench::StreamKind::kAdam: {
      TORCH_CHECK_VALUE(arrays.size() == 4 || arrays.size() == 5,
                        "bench_stream adam: arrays = [p, m, v, g] or [p, m, v, g, out]");
      s.p = fp32_arg(arrays[0], n, "p");
      s.m = fp32_arg(arrays[1], n, "m");
      s.v = fp32_arg(arrays[2], n, "v");
      const at::Tensor& g = arrays[3];
      TORCH_CHECK_VALUE(g.device().is_cpu() && g.is_contiguous() && g.numel() == n &&
                            (g.scalar_type() == at::kFloat || g.scalar_type() == at::kBFloat16),
                        "bench_stream: g must be a contiguous float32 or bfloat16 CPU tensor of ",
                        n, " elements");
      s.g = g.data_ptr();
      s.g_bf16 = g.scalar_type() == at::kBFloat16;
      if (arrays.size() == 5) {
        const at::Tensor& out = arrays[4];
        TORCH_CHECK_VALUE(out.device().is_cpu() && out.is_contiguous() && out.numel() == n &&
                              out.scalar_type() == at::kBFloat16,
                          "bench_stream: out must be a contiguous bfloat16 CPU tensor of ", n,
                          " elements");
        s.out = static_cast<uint16_t*>(out.data_ptr());
      }
      break;
    }
  }
  const common::CpuIsa isa = isa_name.empty() ? common::active_isa() : common::parse_isa(isa_name);
  TORCH_CHECK_VALUE(common::cpu_supports(isa), "bench_stream: this CPU does not support ISA ", isa_name);
  const int64_t chunks = (n + kChunkNumel - 1) / kChunkNumel;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t ci = c0; ci < c1; ++ci) {
      bench::stream_range(s, ci * kChunkNumel, std::min(n, (ci + 1) * kChunkNumel), isa);
    }
  });
  return n * bench::stream_bytes_per_element(s);
}

}  // namespace
}  // namespace bindings
}  // namespace megatrain

TORCH_LIBRARY_FRAGMENT(megatrain, m) {
  m.def("bench_stream(str kind, Tensor(a!)[] arrays, bool nt_stores=False, str isa=\"\") -> int");
}

TORCH_LIBRARY_IMPL(megatrain, CPU, m) {
  m.impl("bench_stream", &megatrain::bindings::bench_stream_cpu);
}
