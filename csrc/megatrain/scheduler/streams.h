// CUDA side of the scheduler: owned events, byte copies enqueued on a copy stream after another
// stream's work, and the CopyEngine of the slot pool (the H2D stream, per slot a weights_ready and
// a buffer_free event). Streams are the caller's (torch.cuda.Stream().cuda_stream handles); events
// are created here. Everything CUDA is behind MEGATRAIN_WITH_CUDA (common/cuda_utils.cpp does the
// same): without it every constructor and function here throws std::runtime_error.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "megatrain/scheduler/slot_pool.h"

namespace megatrain {
namespace scheduler {

/// \brief Whether this build has the CUDA path (MEGATRAIN_WITH_CUDA).
bool streams_have_cuda();

/// \brief An owned cudaEvent_t, created on `device` (DisableTiming unless `timing`).
class CudaEvent {
 public:
  /// \param[in] device CUDA device index the event belongs to (-1: the current one).
  /// \throws std::runtime_error without CUDA or on a CUDA error.
  explicit CudaEvent(bool timing = false, int device = -1);
  /// \brief cudaEventDestroy (a pending event is released once it completes). Never throws.
  ~CudaEvent();
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  /// \brief cudaEventRecord on `stream` (a cudaStream_t of the event's device).
  void record(void* stream);
  /// \brief True once the work before the last record completed (true if never recorded).
  bool query() const;
  /// \brief Blocks the calling thread until query() would be true.
  void synchronize() const;
  /// \brief Milliseconds from this event to `end` (both timing events, recorded and completed).
  float elapsed_ms(const CudaEvent& end) const;
  void* handle() const { return event_; }
  int device() const { return device_; }

 private:
  void* event_ = nullptr;
  int device_ = -1;
};

/// \brief The direction of a batch of copies.
enum class CopyKind { kHostToDevice, kDeviceToHost };

/// \brief One copy of `bytes` bytes between host and device memory.
struct ByteCopy {
  void* dst = nullptr;
  const void* src = nullptr;
  int64_t bytes = 0;
};

/// \brief Enqueues on `stream` (device `device`): a wait for the work enqueued so far on
/// `after_stream` (unless absent; null is the legacy default stream: the backward-done event), `before_copy()` (unless empty), the
/// timing start, the copies (cudaMemcpyAsync of `kind`), the timing end, and a record of
/// `done_event` (unless null: the event the CPU worker waits for).
/// \pre host memory of the copies is page-locked (otherwise a copy is synchronous).
/// \throws std::runtime_error without CUDA or on a CUDA error (named in the message).
void enqueue_copies(void* stream, int device, std::optional<void*> after_stream, CopyKind kind,
                    const std::vector<ByteCopy>& copies,
                    const CopyTiming& timing, void* done_event, const std::function<void()>& before_copy = {});

/// \brief cudaStreamWaitEvent(stream, event) on `device`. \throws as enqueue_copies.
void stream_wait_event(void* stream, void* event, int device);

/// \brief The slot pool's CUDA side: loads on the H2D stream `h2d_stream` (the caller's,
/// alive as long as this engine), per slot a weights_ready and a buffer_free event.
class CudaCopyEngine : public CopyEngine {
 public:
  /// \throws std::runtime_error without CUDA; std::invalid_argument for a null stream.
  CudaCopyEngine(void* h2d_stream, int device);
  void add_slot(int slot) override;
  void load(int slot, void* dst, const void* src, int64_t bytes, bool wait_free,
            const LoadOptions& options) override;
  void wait_ready(int slot, void* compute_stream) override;
  void record_free(int slot, void* compute_stream) override;
  bool ready(int slot) override;

 private:
  void* h2d_stream_;
  int device_;
  std::vector<std::unique_ptr<CudaEvent>> weights_ready_;
  std::vector<std::unique_ptr<CudaEvent>> buffer_free_;
};

}  // namespace scheduler
}  // namespace megatrain
