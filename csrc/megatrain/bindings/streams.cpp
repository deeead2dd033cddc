// pybind11 classes of the slot pool and the copy streams (csrc/megatrain/scheduler/slot_pool.h,
// streams.h): SlotPool, CudaEvent, copy_to_host, stream_wait_event. Streams come from Python as
// torch.cuda.Stream().cuda_stream handles; tensors are checked here and passed on as pointers.
// The GIL stays held: every call is short (copies are enqueued, not waited for, except a load
// with sync=True from pageable memory), and before_copy is a Python callable.
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "megatrain/scheduler/slot_pool.h"
#include "megatrain/scheduler/streams.h"

namespace py = pybind11;
namespace sch = megatrain::scheduler;

namespace {

using EventRef = std::shared_ptr<sch::CudaEvent>;

void* as_ptr(uintptr_t handle) { return reinterpret_cast<void*>(handle); }

std::string device_str(const at::Tensor& t) { return t.device().str(); }

void check_contiguous(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.defined() && t.is_contiguous(), op, ": ", name, " must be a contiguous tensor");
}

sch::CopyTiming timing_of(const py::object& timing) {
  sch::CopyTiming t;
  if (timing.is_none()) return t;
  auto pair = timing.cast<std::pair<EventRef, EventRef>>();
  TORCH_CHECK_VALUE(pair.first && pair.second, "timing must be None or a (start, end) pair of CudaEvent");
  t.start = pair.first->handle();
  t.end = pair.second->handle();
  return t;
}

std::function<void()> callback_of(const py::object& fn) {
  if (fn.is_none()) return {};
  py::function f = fn.cast<py::function>();
  return [f] { f(); };  // runs on the calling thread, which holds the GIL
}

// SlotPool plus the device buffers it points into (kept alive until their template is dropped).
class PySlotPool {
 public:
  PySlotPool(bool cuda, uintptr_t h2d_stream, int device) : cuda_(cuda), device_(device) {
    std::unique_ptr<sch::CopyEngine> engine;
    if (cuda) {
      engine = std::make_unique<sch::CudaCopyEngine>(as_ptr(h2d_stream), device);
    } else {
      engine = std::make_unique<sch::HostCopyEngine>();
    }
    pool_ = std::make_unique<sch::SlotPool>(std::move(engine));
  }

  int add_slot(int64_t template_id, const at::Tensor& buffer) {
    check_contiguous(buffer, "SlotPool.add_slot", "buffer");
    TORCH_CHECK_VALUE(buffer.is_cuda() == cuda_, "SlotPool.add_slot: buffer must be on ",
                      cuda_ ? "a CUDA device" : "the CPU", ", got ", device_str(buffer));
    const int slot = pool_->add_slot(template_id, buffer.data_ptr(), buffer.numel() * buffer.element_size());
    buffers_.push_back(buffer);
    return slot;
  }

  void drop_template(int64_t template_id) {
    pool_->drop_template(template_id);
    for (int i = 0; i < pool_->num_slots(); ++i) {
      if (pool_->state(i).template_id == template_id) buffers_[static_cast<size_t>(i)] = at::Tensor();
    }
  }

  void load(int slot, int64_t unit, int64_t version, const at::Tensor& src, bool sync, const py::object& timing,
            const py::object& before_copy) {
    check_contiguous(src, "SlotPool.load", "src");
    TORCH_CHECK_VALUE(src.device().is_cpu(), "SlotPool.load: src must be a CPU tensor, got ", device_str(src));
    const at::Tensor& dst = buffer(slot);
    TORCH_CHECK_TYPE(src.scalar_type() == dst.scalar_type(), "SlotPool.load: src dtype ",
                     c10::toString(src.scalar_type()), " differs from the slot's ", c10::toString(dst.scalar_type()));
    sch::LoadOptions o;
    o.sync = sync;
    o.timing = timing_of(timing);
    o.before_copy = callback_of(before_copy);
    pool_->load(slot, unit, version, src.data_ptr(), src.numel() * src.element_size(), o);
  }

  // The slot filled by `fill` (called on the H2D stream after the slot's buffer_free, before
  // weights_ready is recorded) instead of a copy of a host tensor.
  void fill(int slot, int64_t unit, int64_t version, const py::object& fill, bool sync) {
    TORCH_CHECK_VALUE(!fill.is_none(), "SlotPool.fill: fill must be a callable");
    buffer(slot);  // a live slot
    sch::LoadOptions o;
    o.sync = sync;
    o.before_copy = callback_of(fill);
    pool_->load(slot, unit, version, nullptr, 0, o);
  }

  const at::Tensor& buffer(int slot) const {
    if (slot < 0 || slot >= static_cast<int>(buffers_.size()) || !buffers_[static_cast<size_t>(slot)].defined()) {
      throw std::out_of_range("SlotPool: no live slot " + std::to_string(slot));
    }
    return buffers_[static_cast<size_t>(slot)];
  }

  sch::SlotPool& get() { return *pool_; }
  bool cuda() const { return cuda_; }
  int device() const { return device_; }

 private:
  bool cuda_;
  int device_;
  std::unique_ptr<sch::SlotPool> pool_;
  std::vector<at::Tensor> buffers_;
};

}  // namespace

namespace megatrain {
namespace bindings {

void init_streams(py::module_& m) {
  m.def("streams_have_cuda", &sch::streams_have_cuda,
        "Whether the slot pool's CUDA path (CudaEvent, copy_to_host, SlotPool(cuda=True)) was compiled in.");

  py::class_<sch::CudaEvent, EventRef>(m, "CudaEvent", R"doc(
An owned CUDA event, created now (unlike torch.cuda.Event, which creates its event at the first
record). A Worker task's ``ready`` gate accepts it like a torch.cuda.Event. Raises RuntimeError in
builds without CUDA (see streams_have_cuda()).)doc")
      .def(py::init<bool, int>(), py::arg("enable_timing") = false, py::arg("device") = -1)
      .def("record", [](sch::CudaEvent& e, uintptr_t stream) { e.record(as_ptr(stream)); }, py::arg("stream"),
           "cudaEventRecord on the stream handle (torch.cuda.Stream().cuda_stream).")
      .def("query", &sch::CudaEvent::query, "True once the work before the last record completed.")
      .def("synchronize", &sch::CudaEvent::synchronize, py::call_guard<py::gil_scoped_release>(),
           "Block until the event completed (the GIL is released meanwhile).")
      .def("elapsed_time", &sch::CudaEvent::elapsed_ms, py::arg("end"),
           "Milliseconds from this event to ``end`` (both enable_timing, recorded and completed).")
      .def_property_readonly("cuda_event", [](const sch::CudaEvent& e) { return reinterpret_cast<uintptr_t>(e.handle()); })
      .def_property_readonly("device", &sch::CudaEvent::device);

  m.def("copy_to_host",
        [](const std::vector<std::pair<at::Tensor, at::Tensor>>& copies, uintptr_t stream,
           std::optional<uintptr_t> after_stream,
           int device, const py::object& timing, const EventRef& done, const py::object& before_copy) {
          std::vector<sch::ByteCopy> bc;
          bc.reserve(copies.size());
          for (const auto& [dst, src] : copies) {
            check_contiguous(dst, "copy_to_host", "dst");
            check_contiguous(src, "copy_to_host", "src");
            TORCH_CHECK_VALUE(dst.device().is_cpu() && src.is_cuda(), "copy_to_host: copies go from a CUDA tensor to a "
                              "CPU tensor, got ", device_str(src), " -> ", device_str(dst));
            TORCH_CHECK_VALUE(dst.scalar_type() == src.scalar_type() && dst.numel() == src.numel(),
                              "copy_to_host: dst and src differ (", c10::toString(dst.scalar_type()), " x ",
                              std::to_string(dst.numel()), " vs ", c10::toString(src.scalar_type()), " x ",
                              std::to_string(src.numel()), ")");
            bc.push_back(sch::ByteCopy{dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()});
          }
          std::optional<void*> after;
          if (after_stream) after = as_ptr(*after_stream);
          sch::enqueue_copies(as_ptr(stream), device, after, sch::CopyKind::kDeviceToHost, bc,
                              timing_of(timing), done ? done->handle() : nullptr, callback_of(before_copy));
        },
        py::arg("copies"), py::arg("stream"), py::arg("after_stream") = py::none(), py::arg("device") = -1,
        py::arg("timing") = py::none(), py::arg("done") = py::none(), py::arg("before_copy") = py::none(),
        "Enqueue on ``stream``: a wait for the work enqueued so far on ``after_stream`` (None: no wait; 0 is "
        "the default stream), "
        "``before_copy()``, ``timing``'s start event, the D2H copies ``(dst pinned CPU, src CUDA)`` "
        "(contiguous, same dtype and numel), its end event, and a record of ``done``. The caller keeps "
        "the sources alive for the copies (Tensor.record_stream).");
  m.def("stream_wait_event",
        [](uintptr_t stream, const EventRef& event) { sch::stream_wait_event(as_ptr(stream), event->handle(), event->device()); },
        py::arg("stream"), py::arg("event"), "cudaStreamWaitEvent: ``stream`` waits for ``event``.");

  py::class_<PySlotPool, std::shared_ptr<PySlotPool>>(m, "SlotPool", R"doc(
The device slot pool (csrc/megatrain/scheduler/slot_pool.h): which slot holds which unit at which
version, in-use counts, least-recently-used reuse, and per slot a weights_ready and a buffer_free
event. cuda=True: loads are cudaMemcpyAsync on ``h2d_stream`` (a torch.cuda.Stream().cuda_stream
handle) on ``device``; the compute stream is given to acquire / release. cuda=False: loads are
synchronous host copies (the CPU backend). Slot buffers are the caller's tensors, kept alive
until their template is dropped.)doc")
      .def(py::init<bool, uintptr_t, int>(), py::arg("cuda"), py::arg("h2d_stream") = 0, py::arg("device") = -1)
      .def("add_slot", &PySlotPool::add_slot, py::arg("template"), py::arg("buffer"),
           "A new empty slot of layer template ``template`` over ``buffer`` (contiguous; CUDA when cuda=True). "
           "Returns its index.")
      .def("drop_template", &PySlotPool::drop_template, py::arg("template"),
           "The template's slots are never used again (their buffers are let go). Raises if one is in use.")
      .def("find", [](PySlotPool& p, int64_t t, int64_t unit, int64_t version) { return p.get().find(t, unit, version); },
           py::arg("template"), py::arg("unit"), py::arg("version"),
           "The slot holding ``unit`` at ``version``, or -1.")
      .def("pick", [](PySlotPool& p, int64_t t, const std::vector<int>& protect) { return p.get().pick(t, protect); },
           py::arg("template"), py::arg("protect") = std::vector<int>{},
           "The free slot a load would overwrite (least recently used, not in ``protect``), or -1.")
      .def("load", &PySlotPool::load, py::arg("slot"), py::arg("unit"), py::arg("version"), py::arg("src"),
           py::arg("sync") = false, py::arg("timing") = py::none(), py::arg("before_copy") = py::none(),
           "Copy ``src`` (contiguous CPU, the slot's dtype; page-locked unless sync=True) into free ``slot``, "
           "which then holds ``unit`` at ``version``: on the H2D stream after the slot's buffer_free, then "
           "weights_ready is recorded. ``timing``: (start, end) CudaEvents around the copy; ``before_copy``: "
           "called once the stream waits for the slot. sync=True: returns after the copy completed.")
      .def("fill", &PySlotPool::fill, py::arg("slot"), py::arg("unit"), py::arg("version"), py::arg("fill"),
           py::arg("sync") = false,
           "Like load, but the slot is filled by the callable ``fill()`` (it enqueues its work on the H2D "
           "stream, which then already waits for the slot's buffer_free; weights_ready is recorded after it): "
           "a master-streamed unit's fp32 master copied H2D and cast on the device. On the CPU backend fill "
           "runs at once. sync=True: returns after the H2D stream completed it.")
      .def("acquire", [](PySlotPool& p, int slot, uintptr_t stream) { p.get().acquire(slot, as_ptr(stream)); },
           py::arg("slot"), py::arg("compute_stream") = 0,
           "One more use of ``slot``: ``compute_stream`` waits for its weights_ready.")
      .def("release",
           [](PySlotPool& p, int slot, uintptr_t stream, bool forget) { return p.get().release(slot, as_ptr(stream), forget); },
           py::arg("slot"), py::arg("compute_stream") = 0, py::arg("forget") = false,
           "One use of ``slot`` ended; the last records buffer_free on ``compute_stream`` (forget: the slot "
           "then holds nothing). Returns the uses left.")
      .def("ready", [](PySlotPool& p, int slot) { return p.get().ready(slot); }, py::arg("slot"),
           "Whether the slot's last load completed.")
      .def("in_use", [](PySlotPool& p, int slot) { return p.get().state(slot).in_use; }, py::arg("slot"))
      .def("state",
           [](PySlotPool& p, int slot) {
             const sch::SlotState s = p.get().state(slot);
             py::dict d;
             d["template"] = s.template_id;
             d["unit"] = s.unit;
             d["version"] = s.version;
             d["in_use"] = s.in_use;
             d["last_use"] = s.last_use;
             d["free_recorded"] = s.free_recorded;
             d["dropped"] = s.dropped;
             d["bytes"] = s.bytes;
             return d;
           },
           py::arg("slot"))
      .def("buffer", &PySlotPool::buffer, py::arg("slot"), "The slot's device buffer.")
      .def_property_readonly("num_slots", [](PySlotPool& p) { return p.get().num_slots(); })
      .def_property_readonly("clock", [](PySlotPool& p) { return p.get().clock(); })
      .def_property_readonly("cuda", &PySlotPool::cuda);
}

}  // namespace bindings
}  // namespace megatrain
