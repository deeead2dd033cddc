// pybind11 classes of the scheduler core: Worker (the CPU worker thread), Ledger (per-entry
// gradient state machines), TaskHandle, GradOutcome, and the kernel task kinds over store tensors.
#include <torch/extension.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "megatrain/bindings/tensor_checks.h"
#include "megatrain/cpu_adam/adam_driver.h"
#include "megatrain/scheduler/ledger.h"
#include "megatrain/scheduler/tasks.h"
#include "megatrain/scheduler/worker.h"

namespace py = pybind11;
namespace sch = megatrain::scheduler;
namespace ca = megatrain::cpu_adam;
using megatrain::bindings::check_cpu_contiguous;
using megatrain::bindings::check_fp32_state;
using megatrain::bindings::aten_parallel_for;
using megatrain::bindings::grad_dtype_of;
using megatrain::bindings::out_dtype_of;

namespace megatrain {
namespace bindings {
std::shared_ptr<megatrain::disk_tier::DiskTier> disk_tier_of(const py::object& tier);  // disk_tier.cpp
}  // namespace bindings
}  // namespace megatrain

namespace {

// What a task keeps alive until the main thread releases it (under the GIL): the Python
// callable, the torch.cuda.Event behind its gate, the tensors its pointers point into.
struct Keep {
  std::vector<py::object> objects;
  std::vector<at::Tensor> tensors;
};

std::shared_ptr<void> make_keep(Keep k) { return std::make_shared<Keep>(std::move(k)); }

// Python's KeyboardInterrupt during a long wait.
void check_signals() {
  py::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() != 0) throw py::error_already_set();
}

// Worker plus the Python-side rules: released keeps are dropped on the calling thread (GIL held).
class PyWorker {
 public:
  explicit PyWorker(int64_t adam_threads) {
    sch::WorkerOptions o;
    if (adam_threads > 0) {
      o.thread_init = [adam_threads] { at::set_num_threads(static_cast<int>(adam_threads)); };
    }
    worker_ = std::make_unique<sch::Worker>(std::move(o));
  }

  // Garbage collection of an engine drops its worker with the GIL held: queued Python tasks
  // need it to finish, so the join runs without it.
  ~PyWorker() {
    if (PyGILState_Check()) {
      py::gil_scoped_release nogil;
      worker_->close();
    } else {
      worker_->close();
    }
  }
  PyWorker(const PyWorker&) = delete;
  PyWorker& operator=(const PyWorker&) = delete;

  sch::Worker& get() { return *worker_; }

  void release_finished() { worker_->collect_released(); }  // GIL held: py::objects die here

  sch::TaskRef submit(sch::Task t) {
    release_finished();
    return worker_->submit(std::move(t));
  }

  template <typename F>
  void blocking(F&& f) {
    release_finished();
    {
      py::gil_scoped_release nogil;
      f();
    }
    release_finished();
  }

  void close() {
    {
      py::gil_scoped_release nogil;  // queued Python tasks need the GIL to finish
      worker_->close();
    }
    release_finished();
  }

 private:
  std::unique_ptr<sch::Worker> worker_;
};

sch::Gate gate_of(const py::object& ready, Keep& keep) {
  if (ready.is_none()) return {};
  if (py::isinstance<sch::TaskHandle>(ready)) {
    return sch::after_task(ready.cast<std::shared_ptr<const sch::TaskHandle>>());
  }
  if (py::hasattr(ready, "cuda_event") && py::hasattr(ready, "query")) {
#ifdef MEGATRAIN_WITH_CUDA
    const auto handle = ready.attr("cuda_event").cast<uintptr_t>();
    keep.objects.push_back(ready);
    return sch::after_cuda_event(reinterpret_cast<void*>(handle));
#else
    throw std::invalid_argument("Worker.submit: ready is a CUDA event, but megatrain._C was built without CUDA");
#endif
  }
  throw py::type_error("Worker.submit: ready must be None, a TaskHandle or a recorded torch.cuda.Event, got " +
                       std::string(py::str(py::type::of(ready))));
}

/// One gradient summed into an fp32 accumulator: `grad` (bf16/fp32, CPU) into `accum` (fp32, same
/// length); both kept alive by `keep` until the task ran.
sch::StagedGrad staged_grad(int64_t entry, const at::Tensor& accum, const at::Tensor& grad, bool overwrite,
                            const char* op, Keep& keep) {
  check_fp32_state(accum, op, "accum", accum.numel());
  sch::StagedGrad g;
  g.entry = entry;
  g.accum = accum.data_ptr<float>();
  g.grad_dtype = grad_dtype_of(grad, op, accum.numel());
  g.grad = grad.data_ptr();
  g.numel = accum.numel();
  g.overwrite = overwrite;
  keep.tensors.push_back(accum);
  keep.tensors.push_back(grad);
  return g;
}

sch::TaskClass class_of(int klass) {
  if (klass != 0 && klass != 1) throw std::invalid_argument("Worker.submit: klass must be 0 (GRAD) or 1 (UPDATE)");
  return static_cast<sch::TaskClass>(klass);
}

// (master, compute) pairs -> WeightsBack, tensors kept.
std::vector<sch::WeightsBack> weights_back_of(const std::vector<std::tuple<at::Tensor, at::Tensor>>& pairs,
                                              Keep& keep, const char* op) {
  std::vector<sch::WeightsBack> out;
  for (const auto& [master, compute] : pairs) {
    check_fp32_state(master, op, "master", master.numel());
    const ca::OutDtype dt = out_dtype_of(compute, op, "compute", master.numel());
    out.push_back({master.data_ptr<float>(), compute.data_ptr(), dt, master.numel()});
    keep.tensors.push_back(master);
    keep.tensors.push_back(compute);
  }
  return out;
}

// The disk tier units of a task (state: master / exp_avg / exp_avg_sq, accum: the accumulator);
// the Python tier objects are kept with the task.
sch::TierState tier_state_of(const py::object& state_tier, int64_t state_unit, const py::object& accum_tier,
                             int64_t accum_unit, Keep& keep) {
  sch::TierState t;
  t.state = megatrain::bindings::disk_tier_of(state_tier);
  t.state_unit = state_unit;
  t.accum = megatrain::bindings::disk_tier_of(accum_tier);
  t.accum_unit = accum_unit;
  if (t.state) keep.objects.push_back(state_tier);
  if (t.accum) keep.objects.push_back(accum_tier);
  return t;
}

// (tier offset, compute) pairs -> WeightsBack from the master on disk, compute kept.
std::vector<sch::WeightsBack> weights_back_tier_of(const std::vector<std::tuple<int64_t, at::Tensor>>& pairs,
                                                   Keep& keep, const char* op) {
  std::vector<sch::WeightsBack> out;
  for (const auto& [offset, compute] : pairs) {
    TORCH_CHECK_VALUE(offset >= 0, op, ": a tier offset must be >= 0, got ", offset);
    const ca::OutDtype dt = out_dtype_of(compute, op, "compute", compute.numel());
    sch::WeightsBack w{nullptr, compute.data_ptr(), dt, compute.numel()};
    w.tier_offset = offset;
    out.push_back(w);
    keep.tensors.push_back(compute);
  }
  return out;
}

// A gradient (bf16/fp32 CPU slice, kept) summed into the accumulator on disk at element `offset`.
sch::StagedGrad staged_tier_grad(int64_t entry, int64_t offset, const at::Tensor& grad, bool overwrite,
                                 const char* op, Keep& keep) {
  TORCH_CHECK_VALUE(offset >= 0, op, ": a tier offset must be >= 0, got ", offset);
  sch::StagedGrad g;
  g.entry = entry;
  g.grad_dtype = grad_dtype_of(grad, op, grad.numel());
  g.grad = grad.data_ptr();
  g.numel = grad.numel();
  g.overwrite = overwrite;
  g.tier_offset = offset;
  keep.tensors.push_back(grad);
  return g;
}

std::string describe_python_error(py::error_already_set& e) {
  // As Python's f"{err!r}": RuntimeError('simulated accumulate failure').
  return std::string(py::repr(e.value()));
}

}  // namespace

namespace megatrain {
namespace bindings {

void init_scheduler(py::module_& m) {
  py::register_exception<sch::WorkerFailed>(m, "WorkerFailed", PyExc_RuntimeError);
  py::register_exception<sch::LedgerError>(m, "LedgerError", PyExc_RuntimeError);

  py::class_<sch::TaskHandle, std::shared_ptr<sch::TaskHandle>>(m, "TaskHandle",
                                                                "Completion of one task of a Worker.")
      .def_property_readonly("done", &sch::TaskHandle::done, "True once the task ran (or was skipped after a failure).")
      .def_property_readonly("seq", &sch::TaskHandle::seq);

  py::class_<sch::GradOutcome, std::shared_ptr<sch::GradOutcome>>(m, "GradOutcome",
                                                                  "What a gradient task found.")
      .def(py::init<>())
      .def_property_readonly("finite", [](const sch::GradOutcome& o) { return o.finite.load(); })
      .def_property_readonly("ran", [](const sch::GradOutcome& o) { return o.ran.load(); })
      .def_property_readonly("seconds", [](const sch::GradOutcome& o) { return o.seconds.load(); },
                             "Wall time of the task's kernels in seconds (0 until it ran).")
      .def_property_readonly("started_s", [](const sch::GradOutcome& o) { return o.started_s.load(); },
                             "When the task's kernels started: seconds on steady_now()'s clock (-1 before).")
      .def_property_readonly("finished_s", [](const sch::GradOutcome& o) { return o.finished_s.load(); },
                             "When the task's kernels ended: seconds on steady_now()'s clock (-1 before).");

  py::class_<sch::UpdateOutcome, std::shared_ptr<sch::UpdateOutcome>>(m, "UpdateOutcome",
                                                                      "What an update task did.")
      .def_property_readonly("skipped", [](const sch::UpdateOutcome& o) { return o.skipped.load(); })
      .def_property_readonly("ran", [](const sch::UpdateOutcome& o) { return o.ran.load(); })
      .def_property_readonly("seconds", [](const sch::UpdateOutcome& o) { return o.seconds.load(); },
                             "Wall time of the update in seconds (0 until it ran).")
      .def_property_readonly("started_s", [](const sch::UpdateOutcome& o) { return o.started_s.load(); },
                             "When the update started: seconds on steady_now()'s clock (-1 before).")
      .def_property_readonly("finished_s", [](const sch::UpdateOutcome& o) { return o.finished_s.load(); },
                             "When the update ended: seconds on steady_now()'s clock (-1 before).");

  m.def("steady_now", &sch::steady_now,
        "Seconds on std::chrono::steady_clock since its epoch: the clock of the outcomes' started_s / "
        "finished_s (the same as time.monotonic() on Linux, not guaranteed elsewhere).");

  py::class_<PyWorker, std::shared_ptr<PyWorker>>(m, "Worker", R"doc(
The CPU worker thread (csrc/megatrain/scheduler/worker.h).

Gradient tasks (klass 0) run first, in submission order; update tasks (klass 1) earliest deadline
first by (key, submission order). ``ready``: None, a TaskHandle (runs after that task) or a
recorded torch.cuda.Event (CUDA builds); while the oldest gradient task's event is not done, a
ready update runs instead. A task that raises stops the worker: later tasks are skipped and every
later submit / wait raises WorkerFailed (a RuntimeError) naming the first error. Waits release
the GIL. adam_threads > 0: intra-op threads of the kernels run on the worker (at::set_num_threads
on its thread).)doc")
      .def(py::init<int64_t>(), py::arg("adam_threads") = -1)
      .def_property_readonly_static("GRAD", [](py::object) { return 0; })
      .def_property_readonly_static("UPDATE", [](py::object) { return 1; })
      .def("submit",
           [](PyWorker& w, py::function fn, int klass, int64_t key, py::object ready) {
             Keep keep;
             sch::Task t;
             t.klass = class_of(klass);
             t.key = key;
             t.gate = gate_of(ready, keep);
             keep.objects.push_back(fn);
             PyObject* raw = fn.ptr();  // owned by keep until the main thread releases it
             t.run = [raw] {
               py::gil_scoped_acquire gil;
               try {
                 py::handle callable(raw);
                 callable();
               } catch (py::error_already_set& e) {
                 throw std::runtime_error(describe_python_error(e));
               }
             };
             t.keep = make_keep(std::move(keep));
             return w.submit(std::move(t));
           },
           py::arg("fn"), py::arg("klass") = 0, py::arg("key") = 0, py::arg("ready") = py::none(),
           "Queue the Python callable fn (run on the worker thread with the GIL). Returns a TaskHandle.")
      .def("submit_accumulate",
           [](PyWorker& w, std::shared_ptr<sch::Ledger> ledger, int64_t unit,
              const std::vector<std::tuple<int64_t, std::optional<at::Tensor>, int64_t>>& direct,
              const std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, bool>>& staged, py::object ready,
              const std::vector<std::tuple<int64_t, int64_t, at::Tensor, bool>>& staged_tier, py::object accum_tier,
              int64_t accum_unit) {
             constexpr const char* op = "Worker.submit_accumulate";
             Keep keep;
             std::vector<sch::DirectGrad> d;
             for (const auto& [entry, norms, k] : direct) {
               sch::DirectGrad g;
               g.entry = entry;
               if (norms.has_value()) {
                 TORCH_CHECK_TYPE(norms->scalar_type() == at::kDouble, op, ": norms must be float64, got ",
                                  norms->scalar_type());
                 check_cpu_contiguous(*norms, op, "norms");
                 TORCH_CHECK_VALUE(k >= 0 && k < norms->numel(), op, ": norm index ", k, " out of range");
                 g.norm = norms->data_ptr<double>() + k;
                 keep.tensors.push_back(*norms);
               }
               d.push_back(g);
             }
             std::vector<sch::StagedGrad> s;
             for (const auto& [entry, accum, grad, overwrite] : staged) {
               s.push_back(staged_grad(entry, accum, grad, overwrite, op, keep));
             }
             for (const auto& [entry, offset, grad, overwrite] : staged_tier) {
               s.push_back(staged_tier_grad(entry, offset, grad, overwrite, op, keep));
             }
             TORCH_CHECK_VALUE(staged_tier.empty() || !accum_tier.is_none(), op,
                               ": staged_tier needs accum_tier (the accumulator's disk tier)");
             sch::TierState tier = tier_state_of(py::none(), -1, accum_tier, accum_unit, keep);
             auto outcome = std::make_shared<sch::GradOutcome>();
             sch::Task t;
             t.klass = sch::TaskClass::kGrad;
             t.gate = gate_of(ready, keep);
             t.run = sch::accumulate_task(std::move(ledger), unit, std::move(d), std::move(s), outcome,
                                          aten_parallel_for, std::move(tier));
             t.keep = make_keep(std::move(keep));
             return std::make_tuple(w.submit(std::move(t)), outcome);
           },
           py::arg("ledger"), py::arg("unit"), py::arg("direct"), py::arg("staged"), py::arg("ready") = py::none(),
           py::arg("staged_tier") = std::vector<std::tuple<int64_t, int64_t, at::Tensor, bool>>{},
           py::arg("accum_tier") = py::none(), py::arg("accum_unit") = -1,
           "Gradient task: direct = [(entry, norms float64 tensor or None, index into norms)] landed in the "
           "compute section; staged = [(entry, accum fp32, grad bf16/fp32 staging slice, overwrite)] summed "
           "into the accumulator (Ledger.accumulated with the squared norm); staged_tier = [(entry, element "
           "offset, grad, overwrite)] summed into unit accum_unit of the DiskTier accum_tier (acquired by the "
           "task, released dirty). Returns (TaskHandle, GradOutcome).")
      .def("submit_move_to_accumulator",
           [](PyWorker& w, std::shared_ptr<sch::Ledger> ledger, int64_t unit,
              const std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor>>& moved,
              const std::vector<std::tuple<int64_t, int64_t, at::Tensor>>& moved_tier, py::object state_tier,
              int64_t state_unit, py::object accum_tier, int64_t accum_unit) {
             constexpr const char* op = "Worker.submit_move_to_accumulator";
             Keep keep;
             std::vector<sch::StagedGrad> s;
             std::vector<std::tuple<at::Tensor, at::Tensor>> pairs;
             for (const auto& [entry, accum, master, compute] : moved) {
               s.push_back(staged_grad(entry, accum, compute, sch::StagedGrad{}.overwrite, op, keep));
               pairs.emplace_back(master, compute);
             }
             std::vector<sch::WeightsBack> back = weights_back_of(pairs, keep, op);
             std::vector<std::tuple<int64_t, at::Tensor>> tier_pairs;
             for (const auto& [entry, offset, compute] : moved_tier) {
               s.push_back(staged_tier_grad(entry, offset, compute, sch::StagedGrad{}.overwrite, op, keep));
               tier_pairs.emplace_back(offset, compute);
             }
             for (auto& w : weights_back_tier_of(tier_pairs, keep, op)) back.push_back(w);
             TORCH_CHECK_VALUE(moved_tier.empty() || (!state_tier.is_none() && !accum_tier.is_none()), op,
                               ": moved_tier needs state_tier and accum_tier");
             sch::TierState tier = tier_state_of(state_tier, state_unit, accum_tier, accum_unit, keep);
             sch::Task t;
             t.klass = sch::TaskClass::kGrad;
             t.run = sch::move_to_accumulator_task(std::move(ledger), unit, std::move(s), std::move(back),
                                                   aten_parallel_for, std::move(tier));
             t.keep = make_keep(std::move(keep));
             return w.submit(std::move(t));
           },
           py::arg("ledger"), py::arg("unit"), py::arg("moved"),
           py::arg("moved_tier") = std::vector<std::tuple<int64_t, int64_t, at::Tensor>>{},
           py::arg("state_tier") = py::none(), py::arg("state_unit") = -1, py::arg("accum_tier") = py::none(),
           py::arg("accum_unit") = -1,
           "Gradient task: moved = [(entry, accum fp32, master fp32, compute slice holding the gradient)]: the "
           "gradient is summed into the accumulator (overwrite; Ledger.moved_to_accumulator), then the compute "
           "slice is rewritten from the master. moved_tier = [(entry, element offset, compute slice)]: the "
           "same with the accumulator and the master on disk (DiskTiers accum_tier / state_tier). Returns a "
           "TaskHandle.")
      .def("submit_adam",
           [](PyWorker& w, std::shared_ptr<sch::Ledger> ledger, int64_t unit,
              const std::vector<std::tuple<int64_t, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                           std::optional<at::Tensor>, double, double, double, double, double,
                                           int64_t>>& items,
              double grad_scale, const std::vector<std::tuple<at::Tensor, at::Tensor>>& restore,
              const std::vector<int64_t>& ledger_entries, std::shared_ptr<sch::GradOutcome> finite_from,
              const std::vector<std::tuple<at::Tensor, at::Tensor>>& restore_on_skip, int klass, int64_t key,
              py::object ready,
              const std::vector<std::tuple<int64_t, int64_t, std::optional<at::Tensor>, at::Tensor, double, double,
                                           double, double, double, int64_t>>& tier_items,
              const std::vector<std::tuple<int64_t, at::Tensor>>& restore_tier,
              const std::vector<std::tuple<int64_t, at::Tensor>>& restore_on_skip_tier, py::object state_tier,
              int64_t state_unit, py::object accum_tier, int64_t accum_unit) {
             constexpr const char* op = "Worker.submit_adam";
             Keep keep;
             sch::AdamTask task;
             task.unit = unit;
             task.grad_scale = static_cast<float>(grad_scale);
             for (const auto& [entry, master, exp_avg, exp_avg_sq, grad, compute, lr, b1, b2, eps, wd, step] : items) {
               const int64_t n = master.numel();
               check_fp32_state(master, op, "master", n);
               check_fp32_state(exp_avg, op, "exp_avg", n);
               check_fp32_state(exp_avg_sq, op, "exp_avg_sq", n);
               sch::AdamItem it;
               it.entry = entry;
               it.numel = n;
               it.args.master = master.data_ptr<float>();
               it.args.exp_avg = exp_avg.data_ptr<float>();
               it.args.exp_avg_sq = exp_avg_sq.data_ptr<float>();
               it.args.grad_dtype = grad_dtype_of(grad, op, n);
               it.args.grad = grad.data_ptr();
               if (compute.has_value()) {  // None: no compute copy written (a master-streamed unit)
                 it.args.out_dtype = out_dtype_of(*compute, op, "compute", n);
                 it.args.compute_out = compute->data_ptr();
                 keep.tensors.push_back(*compute);
               } else {
                 it.args.out_dtype = ca::OutDtype::kNone;
                 it.args.compute_out = nullptr;
               }
               it.hyper = megatrain::bindings::adam_hyper(lr, b1, b2, eps, wd, step);
               for (const at::Tensor* t : {&master, &exp_avg, &exp_avg_sq, &grad}) keep.tensors.push_back(*t);
               task.items.push_back(it);
             }
             for (const auto& [entry, offset, grad, compute, lr, b1, b2, eps, wd, step] : tier_items) {
               TORCH_CHECK_VALUE(offset >= 0, op, ": a tier offset must be >= 0, got ", offset);
               const int64_t n = compute.numel();
               sch::AdamItem it;
               it.entry = entry;
               it.numel = n;
               it.tier_offset = offset;
               it.grad_from_tier = !grad.has_value();
               if (grad.has_value()) {
                 it.args.grad_dtype = grad_dtype_of(*grad, op, n);
                 it.args.grad = grad->data_ptr();
                 keep.tensors.push_back(*grad);
               }
               it.args.out_dtype = out_dtype_of(compute, op, "compute", n);
               it.args.compute_out = compute.data_ptr();
               it.hyper = megatrain::bindings::adam_hyper(lr, b1, b2, eps, wd, step);
               keep.tensors.push_back(compute);
               task.items.push_back(it);
             }
             task.restore = weights_back_of(restore, keep, op);
             task.restore_on_skip = weights_back_of(restore_on_skip, keep, op);
             for (auto& w : weights_back_tier_of(restore_tier, keep, op)) task.restore.push_back(w);
             for (auto& w : weights_back_tier_of(restore_on_skip_tier, keep, op)) task.restore_on_skip.push_back(w);
             TORCH_CHECK_VALUE((tier_items.empty() && restore_tier.empty() && restore_on_skip_tier.empty()) ||
                                   !state_tier.is_none(),
                               op, ": tier_items / restore_tier need state_tier (the unit's DiskTier)");
             task.tier = tier_state_of(state_tier, state_unit, accum_tier, accum_unit, keep);
             task.ledger_entries = ledger_entries;
             task.finite_from = std::move(finite_from);
             auto outcome = std::make_shared<sch::UpdateOutcome>();
             task.outcome = outcome;
             sch::Task t;
             t.klass = class_of(klass);
             t.key = key;
             t.gate = gate_of(ready, keep);
             t.run = sch::adam_task(ledger, std::move(task), aten_parallel_for);
             t.keep = make_keep(std::move(keep));
             for (int64_t i : ledger_entries) ledger->queue_update(unit, i);
             try {
               return std::make_tuple(w.submit(std::move(t)), outcome);
             } catch (...) {
               for (int64_t i : ledger_entries) ledger->cancel_update(unit, i);
               throw;
             }
           },
           py::arg("ledger"), py::arg("unit"), py::arg("items"), py::arg("grad_scale"),
           py::arg("restore") = std::vector<std::tuple<at::Tensor, at::Tensor>>{},
           py::arg("ledger_entries") = std::vector<int64_t>{}, py::arg("finite_from") = nullptr,
           py::arg("restore_on_skip") = std::vector<std::tuple<at::Tensor, at::Tensor>>{}, py::arg("klass") = 1,
           py::arg("key") = 0, py::arg("ready") = py::none(),
           py::arg("tier_items") = std::vector<std::tuple<int64_t, int64_t, std::optional<at::Tensor>, at::Tensor,
                                                          double, double, double, double, double, int64_t>>{},
           py::arg("restore_tier") = std::vector<std::tuple<int64_t, at::Tensor>>{},
           py::arg("restore_on_skip_tier") = std::vector<std::tuple<int64_t, at::Tensor>>{},
           py::arg("state_tier") = py::none(), py::arg("state_unit") = -1, py::arg("accum_tier") = py::none(),
           py::arg("accum_unit") = -1,
           "Update task: items = [(entry, master, exp_avg, exp_avg_sq, grad, compute, lr, beta1, beta2, eps, "
           "weight_decay, step)] (adamw_step_'s arguments) with grad_scale; then restore = [(master, compute)]. "
           "finite_from: a GradOutcome; non-finite skips the update and writes restore_on_skip instead. "
           "Queues ledger_entries' updates in the ledger. A unit whose fp32 state is on disk: tier_items = "
           "[(entry, element offset, grad (None: the accumulator on disk), compute, lr, ...)], restore_tier / "
           "restore_on_skip_tier = [(element offset of the master, compute)]; unit state_unit of the DiskTier "
           "state_tier (and accum_unit of accum_tier) is acquired by the task and released dirty after an "
           "update. Returns (TaskHandle, UpdateOutcome).")
      .def("wait_grads", [](PyWorker& w) { w.blocking([&] { w.get().wait_grads(check_signals); }); },
           "Block until every queued gradient task ran (GIL released).")
      .def("drain", [](PyWorker& w) { w.blocking([&] { w.get().drain(check_signals); }); },
           "Block until every queued task ran (GIL released).")
      .def("wait", [](PyWorker& w, std::shared_ptr<sch::TaskHandle> t) {
             w.blocking([&] { w.get().wait(t, check_signals); });
           },
           py::arg("task"), "Block until task ran (GIL released).")
      .def("check", [](PyWorker& w) { w.release_finished(); w.get().check(); },
           "Raise WorkerFailed if a task failed (sticky).")
      .def_property_readonly("failed", [](PyWorker& w) { return static_cast<bool>(w.get().error()); })
      .def_property_readonly("error_message", [](PyWorker& w) { return w.get().error_message(); })
      .def_property_readonly("grads_pending", [](PyWorker& w) { return w.get().grads_pending(); })
      .def_property_readonly("unfinished", [](PyWorker& w) { return w.get().unfinished(); })
      .def("close", &PyWorker::close, "Run what is queued, then join the thread (idempotent).");

  py::enum_<sch::GradPlace>(m, "GradPlace")
      .value("none", sch::GradPlace::kNone)
      .value("on_device", sch::GradPlace::kOnDevice)
      .value("in_flight_staging", sch::GradPlace::kInFlightStaging)
      .value("in_flight_direct", sch::GradPlace::kInFlightDirect)
      .value("direct", sch::GradPlace::kDirect)
      .value("accumulated", sch::GradPlace::kAccumulated);
  py::enum_<sch::UpdateState>(m, "UpdateState")
      .value("none", sch::UpdateState::kNone)
      .value("queued", sch::UpdateState::kQueued)
      .value("running", sch::UpdateState::kRunning)
      .value("done", sch::UpdateState::kDone);

  py::class_<sch::EntryState>(m, "EntryState")
      .def_readonly("place", &sch::EntryState::place)
      .def_readonly("micro_batches", &sch::EntryState::micro_batches)
      .def_readonly("in_flight", &sch::EntryState::in_flight)
      .def_readonly("grad_sq", &sch::EntryState::grad_sq)
      .def_readonly("norm_known", &sch::EntryState::norm_known)
      .def_readonly("finite", &sch::EntryState::finite)
      .def_readonly("eager", &sch::EntryState::eager)
      .def_readonly("update", &sch::EntryState::update);

  py::class_<sch::Ledger, std::shared_ptr<sch::Ledger>>(m, "Ledger",
                                                        "Per-entry gradient state machines (scheduler/ledger.h); "
                                                        "an illegal transition raises LedgerError.")
      .def(py::init<std::vector<int64_t>>(), py::arg("entries_per_unit"))
      .def_property_readonly("num_units", &sch::Ledger::num_units)
      .def("num_entries", &sch::Ledger::num_entries, py::arg("unit"))
      .def("get", &sch::Ledger::get, py::arg("unit"), py::arg("entry"))
      .def("states", &sch::Ledger::states, py::arg("unit"), "Every entry's EntryState of unit, in order.")
      .def("begin_d2h", &sch::Ledger::begin_d2h, py::arg("unit"), py::arg("entry"), py::arg("direct"))
      .def("on_device", &sch::Ledger::on_device, py::arg("unit"), py::arg("entry"))
      .def("mark_eager", &sch::Ledger::mark_eager, py::arg("unit"), py::arg("entry"))
      .def("landed_direct", &sch::Ledger::landed_direct, py::arg("unit"), py::arg("entry"), py::arg("grad_sq"),
           py::arg("norm_known"))
      .def("accumulated", &sch::Ledger::accumulated, py::arg("unit"), py::arg("entry"), py::arg("grad_sq"))
      .def("moved_to_accumulator", &sch::Ledger::moved_to_accumulator, py::arg("unit"), py::arg("entry"),
           py::arg("grad_sq"))
      .def("record_norm", &sch::Ledger::record_norm, py::arg("unit"), py::arg("entry"), py::arg("grad_sq"))
      .def("reset", &sch::Ledger::reset, py::arg("unit"), py::arg("entry"))
      .def("queue_update", &sch::Ledger::queue_update, py::arg("unit"), py::arg("entry"))
      .def("cancel_update", &sch::Ledger::cancel_update, py::arg("unit"), py::arg("entry"))
      .def("start_update", &sch::Ledger::start_update, py::arg("unit"), py::arg("entry"))
      .def("finish_update", &sch::Ledger::finish_update, py::arg("unit"), py::arg("entry"))
      .def("any_in_compute", &sch::Ledger::any_in_compute, py::arg("unit"))
      .def("update_pending", &sch::Ledger::update_pending, py::arg("unit"))
      .def("finite", &sch::Ledger::finite, py::arg("unit"), py::arg("entries"))
      .def("grad_sq", &sch::Ledger::grad_sq, py::arg("unit"));
}

}  // namespace bindings
}  // namespace megatrain
