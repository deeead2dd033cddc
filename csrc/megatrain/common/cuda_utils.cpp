#include "megatrain/common/cuda_utils.h"

#include <stdexcept>

#ifdef MEGATRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace megatrain {
namespace common {

bool cuda_device_present() {
#ifdef MEGATRAIN_WITH_CUDA
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are not confused
    return false;
  }
  return count > 0;
#else
  return false;
#endif
}

bool cuda_host_register(void* ptr, size_t bytes) {
#ifdef MEGATRAIN_WITH_CUDA
  if (bytes == 0 || !cuda_device_present()) return false;
  const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("cudaHostRegister of ") + std::to_string(bytes) +
                             " bytes failed: " + cudaGetErrorString(err) +
                             " (check `ulimit -l` / RLIMIT_MEMLOCK and free host memory)");
  }
  return true;
#else
  (void)ptr;
  (void)bytes;
  return false;
#endif
}

std::string cuda_host_unregister(void* ptr) noexcept {
#ifdef MEGATRAIN_WITH_CUDA
  const cudaError_t err = cudaHostUnregister(ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return std::string("cudaHostUnregister failed: ") + cudaGetErrorString(err);
  }
  return "";
#else
  (void)ptr;
  return "";
#endif
}

bool cuda_event_query(void* event) {
#ifdef MEGATRAIN_WITH_CUDA
  const cudaError_t err = cudaEventQuery(static_cast<cudaEvent_t>(event));
  if (err == cudaSuccess) return true;
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  cudaGetLastError();
  throw std::runtime_error(std::string("cudaEventQuery failed: ") + cudaGetErrorString(err));
#else
  (void)event;
  throw std::runtime_error("cuda_event_query: megatrain was built without CUDA");
#endif
}

void cuda_event_synchronize(void* event) {
#ifdef MEGATRAIN_WITH_CUDA
  const cudaError_t err = cudaEventSynchronize(static_cast<cudaEvent_t>(event));
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::runtime_error(std::string("cudaEventSynchronize failed: ") + cudaGetErrorString(err));
  }
#else
  (void)event;
  throw std::runtime_error("cuda_event_synchronize: megatrain was built without CUDA");
#endif
}

}  // namespace common
}  // namespace megatrain
