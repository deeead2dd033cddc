// Minimal CUDA runtime helpers for the torch-free core. Everything CUDA is behind
// MEGATRAIN_WITH_CUDA so the core also builds (and pins nothing) without a toolkit.
#pragma once

#include <cstddef>
#include <string>

namespace megatrain {
namespace common {

/// \brief True when built with CUDA and at least one CUDA device is visible now.
bool cuda_device_present();

/// \brief Page-locks [ptr, ptr+bytes) for DMA with one cudaHostRegister(Portable) call.
/// \return false (and does nothing) when built without CUDA or no device is visible.
/// \throws std::runtime_error if a device is present but registration fails (the message
///         names the CUDA error and the byte count).
bool cuda_host_register(void* ptr, size_t bytes);

/// \brief Undoes cuda_host_register. Never throws; returns an error string ("" on success).
std::string cuda_host_unregister(void* ptr) noexcept;

/// \brief Non-blocking test of a recorded CUDA event (a cudaEvent_t passed as a pointer, e.g.
/// torch.cuda.Event().cuda_event): true once the work before it is done.
/// \throws std::runtime_error when built without CUDA, or on a CUDA error (named in the message).
bool cuda_event_query(void* event);

/// \brief Blocks the calling thread until the CUDA event completed (cudaEventSynchronize).
/// \throws std::runtime_error as cuda_event_query.
void cuda_event_synchronize(void* event);

}  // namespace common
}  // namespace megatrain
