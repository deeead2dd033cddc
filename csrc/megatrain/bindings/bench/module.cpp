// The megatrain._bench extension module: benchmark-only kernels, kept out of megatrain._C.
// Importing it registers torch.ops.megatrain.bench_stream (bench_ops.cpp).
#include <torch/extension.h>

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "megatrain benchmark kernels: torch.ops.megatrain.bench_stream (STREAM-style host bandwidth)";
}
