// The CPU worker: one std::thread that runs gradient tasks and optimizer updates by priority and
// readiness (torch-free; the bindings wrap Python callables and CUDA events into tasks).
//
// Order. Gradient tasks (D2H waits, accumulation, zero_grad bookkeeping) run in submission
// order, one at a time, and before updates: they free pinned staging buffers and are what
// optimizer.step() waits for. wait_grads() runs them on the waiting thread while the worker is
// inside an update, so step() does not wait behind one. Update tasks run earliest deadline
// first by (key, submission sequence): the key is the unit's position in the next forward
// (resident unit first, then layer 0, 1, ...). During backward the gradients arrive last layer
// first; when the CPU Adam falls behind, the layer the next forward needs soonest is updated
// first and the deep layers' updates overlap the next forward instead of delaying its start.
//
// Readiness. A task may carry a Gate: a non-blocking test (a CUDA event query, or "task X is
// done") and the blocking wait behind it. While the oldest gradient task's gate is closed (its
// D2H copy is still running), a ready update runs instead of blocking the thread on that copy;
// with no ready update, the oldest gradient task is taken anyway and its gate waited for (no
// later work can become ready before it).
//
// Failure. A task that throws stops the worker's work: the tasks queued after it are dequeued
// but not run, and every later submit / wait throws WorkerFailed with the first error's message
// (sticky: the host state may be partly updated).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace megatrain {
namespace scheduler {

/// \brief Gradient tasks run first, in submission order; updates earliest deadline first.
enum class TaskClass { kGrad = 0, kUpdate = 1 };

/// \brief When a task may start.
struct Gate {
  /// Non-blocking; true once the task can run without waiting. Empty: always open.
  std::function<bool()> query;
  /// Blocks until query() would return true. Empty: nothing to wait for.
  std::function<void()> wait;
};

/// \brief Completion of one submitted task, shared with waiters and with later tasks' gates.
class TaskHandle {
 public:
  /// \brief True once the task ran (or was skipped after a failure).
  bool done() const { return done_.load(std::memory_order_acquire); }
  /// \brief Submission sequence number (unique per worker, increasing).
  int64_t seq() const { return seq_; }

 private:
  friend class Worker;
  explicit TaskHandle(int64_t seq) : seq_(seq) {}
  std::atomic<bool> done_{false};
  int64_t seq_;
};

using TaskRef = std::shared_ptr<const TaskHandle>;

/// \brief A gate that opens once `after` ran (its wait polls for it: `after` may be a gradient
/// task that a thread in Worker::wait_grads runs while the worker takes the gated task).
Gate after_task(TaskRef after);

/// \brief A gate over a recorded CUDA event (a cudaEvent_t): query = cudaEventQuery, wait =
/// cudaEventSynchronize. The event must outlive the task (keep it in Task::keep).
/// \throws (when used) std::runtime_error in builds without CUDA.
Gate after_cuda_event(void* event);

/// \brief The message every call raises after a task failed.
class WorkerFailed : public std::runtime_error {
 public:
  explicit WorkerFailed(const std::string& what) : std::runtime_error(what) {}
};

/// \brief One unit of work for the worker.
struct Task {
  TaskClass klass = TaskClass::kGrad;
  int64_t key = 0;           ///< update deadline (smaller runs first); ignored for kGrad
  Gate gate;                 ///< when it may start
  std::function<void()> run; ///< the work; throwing fails the worker (sticky)
  /// Released by the thread that calls Worker::collect_released() (the bindings: a Python
  /// callable and the torch.cuda.Event behind a gate are released under the GIL, never on the
  /// worker thread).
  std::shared_ptr<void> keep;
};

/// \brief Options of a Worker.
struct WorkerOptions {
  /// Run once on the worker thread before its first task (the bindings set the kernels'
  /// intra-op thread count there: MEGATRAIN_ADAM_THREADS).
  std::function<void()> thread_init;
  /// Describes a failed task's exception for the sticky message (default: what()).
  std::function<std::string(std::exception_ptr)> describe;
};

/// \brief The CPU worker thread (see the file comment for the order and failure rules).
/// Thread-safe: submit / wait_* / check / close may be called from any thread but the worker's.
class Worker {
 public:
  explicit Worker(WorkerOptions options = {});
  /// \brief close(): runs what is queued, then joins. Never throws.
  ~Worker();
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  /// \brief Queues `task`.
  /// \return its handle (done() once it ran or was skipped).
  /// \throws WorkerFailed if an earlier task failed; std::logic_error after close().
  TaskRef submit(Task task);

  /// \brief Blocks until every queued gradient task ran (updates may still be queued). While
  /// no gradient task runs, the caller runs the oldest one itself (in order, one at a time),
  /// instead of waiting for the worker to finish the update it may be in.
  /// `poll` (optional) runs every `poll_ms` while waiting, without the worker's lock (the
  /// bindings check for KeyboardInterrupt there); an exception from it ends the wait.
  /// \throws WorkerFailed if a task failed (before or during the wait).
  void wait_grads(const std::function<void()>& poll = {}, int poll_ms = 200);
  /// \brief Blocks until every queued task ran. \throws as wait_grads.
  void drain(const std::function<void()>& poll = {}, int poll_ms = 200);
  /// \brief Blocks until `task` ran. \throws as wait_grads.
  void wait(const TaskRef& task, const std::function<void()>& poll = {}, int poll_ms = 200);
  /// \brief Blocks until `done()` holds (evaluated under the worker's lock after each task).
  /// \throws as wait_grads.
  void wait_until(const std::function<bool()>& done, const std::function<void()>& poll = {},
                  int poll_ms = 200);

  /// \brief Throws WorkerFailed if a task failed.
  void check() const;
  /// \brief The sticky failure (null if none).
  std::exception_ptr error() const;
  /// \brief The failure message every later call raises ("" if none).
  std::string error_message() const;

  /// \brief Runs what is queued (skipped after a failure), then joins the thread. Idempotent.
  void close();
  bool closed() const;

  /// \brief Task::keep of the tasks that finished since the last call (to be released by the caller).
  std::vector<std::shared_ptr<void>> collect_released();

  /// \brief Gradient tasks queued or running.
  int64_t grads_pending() const;
  /// \brief Tasks queued or running.
  int64_t unfinished() const;

 private:
  struct Queued {
    Task task;
    int64_t seq;
    std::shared_ptr<TaskHandle> handle;
  };

  void run_loop();
  bool pick(Queued* out, bool* gated);  // lock held; false: nothing may be taken now
  void run_task(Queued& q, bool gated, bool skip);  // lock not held; marks q done
  void wait_impl(const std::function<bool()>& done, const std::function<void()>& poll, int poll_ms);
  [[noreturn]] void throw_failed() const;  // lock held

  WorkerOptions options_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Queued> grads_;
  std::vector<Queued> updates_;
  std::vector<std::shared_ptr<void>> released_;
  int64_t next_seq_ = 0;
  int64_t grads_pending_ = 0;
  bool grad_running_ = false;  // a gradient task runs (on the worker or on a thread in wait_grads)
  int64_t unfinished_ = 0;
  bool stop_ = false;
  bool closed_ = false;
  std::exception_ptr error_;
  std::string error_message_;
  std::thread thread_;
};

}  // namespace scheduler
}  // namespace megatrain
