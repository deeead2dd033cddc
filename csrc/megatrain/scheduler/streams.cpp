#include "megatrain/scheduler/streams.h"

#include <stdexcept>
#include <string>

#ifdef MEGATRAIN_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace megatrain {
namespace scheduler {

#ifdef MEGATRAIN_WITH_CUDA
namespace {

void check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear it: later calls must not report this one
  throw std::runtime_error(std::string("megatrain scheduler: ") + what + " failed: " + cudaGetErrorString(err));
}

// Makes `device` current for the calls in its scope (events and streams of one device must be
// used with it current) and restores the caller's device afterwards.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0) return;
    check(cudaGetDevice(&prev_), "cudaGetDevice");
    if (prev_ != device) {
      check(cudaSetDevice(device), "cudaSetDevice");
      switched_ = true;
    }
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
  bool switched_ = false;
};

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }
cudaEvent_t as_event(void* e) { return static_cast<cudaEvent_t>(e); }

// after_stream's work so far -> stream (a short-lived event; destroying it after the wait is
// enqueued is allowed: the wait keeps what it needs).
void wait_for_stream(void* stream, void* after_stream) {
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "cudaEventCreateWithFlags");
  cudaError_t err = cudaEventRecord(ev, as_stream(after_stream));
  if (err == cudaSuccess) err = cudaStreamWaitEvent(as_stream(stream), ev, 0);
  cudaEventDestroy(ev);
  check(err, "waiting for the compute stream (cudaEventRecord / cudaStreamWaitEvent)");
}

}  // namespace

bool streams_have_cuda() { return true; }

CudaEvent::CudaEvent(bool timing, int device) {
  DeviceGuard guard(device);
  if (device < 0) check(cudaGetDevice(&device), "cudaGetDevice");
  device_ = device;
  cudaEvent_t ev = nullptr;
  check(cudaEventCreateWithFlags(&ev, timing ? cudaEventDefault : cudaEventDisableTiming), "cudaEventCreateWithFlags");
  event_ = ev;
}

CudaEvent::~CudaEvent() {
  if (event_ != nullptr) cudaEventDestroy(as_event(event_));  // errors at process teardown are ignored
}

void CudaEvent::record(void* stream) {
  DeviceGuard guard(device_);
  check(cudaEventRecord(as_event(event_), as_stream(stream)), "cudaEventRecord");
}

bool CudaEvent::query() const {
  const cudaError_t err = cudaEventQuery(as_event(event_));
  if (err == cudaErrorNotReady) {
    cudaGetLastError();
    return false;
  }
  check(err, "cudaEventQuery");
  return true;
}

void CudaEvent::synchronize() const { check(cudaEventSynchronize(as_event(event_)), "cudaEventSynchronize"); }

float CudaEvent::elapsed_ms(const CudaEvent& end) const {
  float ms = 0.0f;
  check(cudaEventElapsedTime(&ms, as_event(event_), as_event(end.event_)), "cudaEventElapsedTime");
  return ms;
}

void enqueue_copies(void* stream, int device, std::optional<void*> after_stream, CopyKind kind,
                    const std::vector<ByteCopy>& copies, const CopyTiming& timing, void* done_event,
                    const std::function<void()>& before_copy) {
  if (stream == nullptr) throw std::invalid_argument("enqueue_copies: the copy stream must not be null");
  DeviceGuard guard(device);
  if (after_stream) wait_for_stream(stream, *after_stream);
  if (before_copy) before_copy();
  if (timing.start != nullptr) check(cudaEventRecord(as_event(timing.start), as_stream(stream)), "cudaEventRecord");
  const cudaMemcpyKind k = kind == CopyKind::kHostToDevice ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost;
  for (const ByteCopy& c : copies) {
    if (c.bytes <= 0) continue;
    check(cudaMemcpyAsync(c.dst, c.src, static_cast<size_t>(c.bytes), k, as_stream(stream)), "cudaMemcpyAsync");
  }
  if (timing.end != nullptr) check(cudaEventRecord(as_event(timing.end), as_stream(stream)), "cudaEventRecord");
  if (done_event != nullptr) check(cudaEventRecord(as_event(done_event), as_stream(stream)), "cudaEventRecord");
}

void stream_wait_event(void* stream, void* event, int device) {
  DeviceGuard guard(device);
  check(cudaStreamWaitEvent(as_stream(stream), as_event(event), 0), "cudaStreamWaitEvent");
}

CudaCopyEngine::CudaCopyEngine(void* h2d_stream, int device) : h2d_stream_(h2d_stream), device_(device) {
  if (h2d_stream == nullptr) throw std::invalid_argument("CudaCopyEngine: the H2D stream must not be null");
}

void CudaCopyEngine::add_slot(int slot) {
  if (slot != static_cast<int>(weights_ready_.size())) {
    throw std::logic_error("CudaCopyEngine.add_slot: slots must be added in index order");
  }
  weights_ready_.push_back(std::make_unique<CudaEvent>(false, device_));
  buffer_free_.push_back(std::make_unique<CudaEvent>(false, device_));
}

void CudaCopyEngine::load(int slot, void* dst, const void* src, int64_t bytes, bool wait_free,
                          const LoadOptions& options) {
  DeviceGuard guard(device_);
  const auto i = static_cast<size_t>(slot);
  if (wait_free) stream_wait_event(h2d_stream_, buffer_free_.at(i)->handle(), device_);
  enqueue_copies(h2d_stream_, device_, std::nullopt, CopyKind::kHostToDevice, {ByteCopy{dst, src, bytes}}, options.timing,
                 weights_ready_.at(i)->handle(), options.before_copy);
  if (options.sync) check(cudaStreamSynchronize(as_stream(h2d_stream_)), "cudaStreamSynchronize");
}

void CudaCopyEngine::wait_ready(int slot, void* compute_stream) {
  stream_wait_event(compute_stream, weights_ready_.at(static_cast<size_t>(slot))->handle(), device_);
}

void CudaCopyEngine::record_free(int slot, void* compute_stream) {
  buffer_free_.at(static_cast<size_t>(slot))->record(compute_stream);
}

bool CudaCopyEngine::ready(int slot) { return weights_ready_.at(static_cast<size_t>(slot))->query(); }

#else  // no CUDA: every entry point says so

namespace {
[[noreturn]] void no_cuda(const char* what) {
  throw std::runtime_error(std::string(what) + ": megatrain was built without CUDA");
}
}  // namespace

bool streams_have_cuda() { return false; }

CudaEvent::CudaEvent(bool, int) { no_cuda("CudaEvent"); }
CudaEvent::~CudaEvent() = default;
void CudaEvent::record(void*) { no_cuda("CudaEvent.record"); }
bool CudaEvent::query() const { no_cuda("CudaEvent.query"); }
void CudaEvent::synchronize() const { no_cuda("CudaEvent.synchronize"); }
float CudaEvent::elapsed_ms(const CudaEvent&) const { no_cuda("CudaEvent.elapsed_ms"); }

void enqueue_copies(void*, int, std::optional<void*>, CopyKind, const std::vector<ByteCopy>&, const CopyTiming&,
                    void*, const std::function<void()>&) {
  no_cuda("enqueue_copies");
}

void stream_wait_event(void*, void*, int) { no_cuda("stream_wait_event"); }

CudaCopyEngine::CudaCopyEngine(void* h2d_stream, int device) : h2d_stream_(h2d_stream), device_(device) {
  no_cuda("CudaCopyEngine");
}
void CudaCopyEngine::add_slot(int) { no_cuda("CudaCopyEngine.add_slot"); }
void CudaCopyEngine::load(int, void*, const void*, int64_t, bool, const LoadOptions&) { no_cuda("CudaCopyEngine.load"); }
void CudaCopyEngine::wait_ready(int, void*) { no_cuda("CudaCopyEngine.wait_ready"); }
void CudaCopyEngine::record_free(int, void*) { no_cuda("CudaCopyEngine.record_free"); }
bool CudaCopyEngine::ready(int) { no_cuda("CudaCopyEngine.ready"); }

#endif

}  // namespace scheduler
}  // namespace megatrain
