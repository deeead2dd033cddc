#include "megatrain/scheduler/worker.h"

#include <chrono>
#include <thread>
#include <utility>

#include "megatrain/common/cuda_utils.h"

namespace megatrain {
namespace scheduler {
namespace {

std::string describe_default(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

// A query that throws counts as closed: the task is taken when nothing else can run, and its
// wait() (which meets the same error) fails the worker with that message instead of
// terminating the thread.
bool is_open(const Gate& g) {
  if (!g.query) return true;
  try {
    return g.query();
  } catch (...) {
    return false;
  }
}

}  // namespace

Gate after_task(TaskRef after) {
  Gate g;
  g.query = [after] { return after->done(); };
  // A gradient task may run on a thread in wait_grads() while the worker takes an update gated
  // on it, so the wait is a real one.
  g.wait = [after] {
    while (!after->done()) std::this_thread::sleep_for(std::chrono::microseconds(50));
  };
  return g;
}

Gate after_cuda_event(void* event) {
  Gate g;
  g.query = [event] { return common::cuda_event_query(event); };
  g.wait = [event] { common::cuda_event_synchronize(event); };
  return g;
}

Worker::Worker(WorkerOptions options) : options_(std::move(options)) {
  if (!options_.describe) options_.describe = describe_default;
  thread_ = std::thread([this] { run_loop(); });
}

Worker::~Worker() {
  try {
    close();
  } catch (...) {  // destructors do not throw
  }
}

TaskRef Worker::submit(Task task) {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) throw_failed();
  if (stop_) throw std::logic_error("megatrain CPU worker: submit after close()");
  Queued q{std::move(task), next_seq_, nullptr};
  q.handle = std::shared_ptr<TaskHandle>(new TaskHandle(next_seq_));
  ++next_seq_;
  ++unfinished_;
  TaskRef ref = q.handle;
  if (q.task.klass == TaskClass::kGrad) {
    ++grads_pending_;
    grads_.push_back(std::move(q));
  } else {
    updates_.push_back(std::move(q));
  }
  cv_.notify_all();
  return ref;
}

bool Worker::pick(Queued* out, bool* gated) {
  *gated = false;
  // Gradient tasks run one at a time, in order: none is taken while one runs (on a waiter).
  const bool grad_free = !grads_.empty() && !grad_running_;
  if (grad_free && is_open(grads_.front().task.gate)) {
    *out = std::move(grads_.front());
    grads_.pop_front();
    grad_running_ = true;
    return true;
  }
  // Earliest deadline among the ready updates; else among all of them.
  auto best = updates_.end();
  auto any = updates_.end();
  for (auto it = updates_.begin(); it != updates_.end(); ++it) {
    const bool earlier_any = any == updates_.end() || it->task.key < any->task.key ||
                             (it->task.key == any->task.key && it->seq < any->seq);
    if (earlier_any) any = it;
    if (best != updates_.end() && !(it->task.key < best->task.key ||
                                    (it->task.key == best->task.key && it->seq < best->seq))) {
      continue;
    }
    if (is_open(it->task.gate)) best = it;
  }
  if (best != updates_.end()) {
    *out = std::move(*best);
    updates_.erase(best);
    return true;
  }
  if (grad_free) {  // blocks on its copy: no later work can be ready before it
    *out = std::move(grads_.front());
    grads_.pop_front();
    grad_running_ = true;
    *gated = true;
    return true;
  }
  // A waiter runs the gradient tasks (wait_grads): what is queued behind them waits for them.
  if (!grads_.empty() || any == updates_.end()) return false;
  *out = std::move(*any);
  updates_.erase(any);
  *gated = true;
  return true;
}

void Worker::run_task(Queued& q, bool gated, bool skip) {
  if (!skip) {
    try {
      if (gated && q.task.gate.wait) q.task.gate.wait();
      if (q.task.run) q.task.run();
    } catch (...) {
      std::exception_ptr e = std::current_exception();
      std::string msg = options_.describe(e);
      std::lock_guard<std::mutex> lock(mu_);
      if (!error_) {
        error_ = e;
        error_message_ = std::move(msg);
      }
    }
  }
  q.task.run = nullptr;
  q.task.gate = Gate{};
  std::lock_guard<std::mutex> lock(mu_);
  if (q.task.keep) released_.push_back(std::move(q.task.keep));
  q.handle->done_.store(true, std::memory_order_release);
  --unfinished_;
  if (q.task.klass == TaskClass::kGrad) {
    --grads_pending_;
    grad_running_ = false;
  }
  cv_.notify_all();
}

void Worker::run_loop() {
  if (options_.thread_init) {
    try {
      options_.thread_init();
    } catch (...) {
      std::lock_guard<std::mutex> lock(mu_);
      error_ = std::current_exception();
      error_message_ = options_.describe(error_);
    }
  }
  for (;;) {
    Queued q;
    bool gated = false;
    bool skip = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      for (;;) {
        if (pick(&q, &gated)) break;
        if (stop_ && grads_.empty() && updates_.empty()) return;  // stop_ and nothing left
        cv_.wait(lock);
      }
      skip = static_cast<bool>(error_);
    }
    run_task(q, gated, skip);
  }
}

void Worker::throw_failed() const {
  throw WorkerFailed(
      "megatrain CPU worker failed: " + error_message_ +
      ". The tasks queued after it were not run, so the host-memory training state may be partly "
      "updated and this model cannot train on: build it again (megatrain.wrap) and load the last "
      "checkpoint (megatrain.load_checkpoint)");
}

void Worker::wait_impl(const std::function<bool()>& done, const std::function<void()>& poll,
                       int poll_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (error_) throw_failed();
    if (done()) return;
    if (poll) {
      cv_.wait_for(lock, std::chrono::milliseconds(poll_ms > 0 ? poll_ms : 1));
      if (error_) throw_failed();
      if (done()) return;
      lock.unlock();
      poll();  // may throw (an interrupt): the wait ends
      lock.lock();
    } else {
      cv_.wait(lock);
    }
  }
}

void Worker::wait_grads(const std::function<void()>& poll, int poll_ms) {
  // The waiter runs the oldest gradient task itself when no gradient task is running: the
  // worker may be inside an update (tens of ms) that the task would otherwise wait behind, while
  // the caller (optimizer.step()) has device work to launch once the gradients are in.
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (error_) throw_failed();
    if (grads_pending_ == 0) return;
    if (!grad_running_ && !grads_.empty()) {
      Queued q = std::move(grads_.front());
      grads_.pop_front();
      grad_running_ = true;
      lock.unlock();
      run_task(q, !is_open(q.task.gate), false);
      lock.lock();
      continue;
    }
    if (poll) {
      cv_.wait_for(lock, std::chrono::milliseconds(poll_ms > 0 ? poll_ms : 1));
      if (error_) throw_failed();
      if (grads_pending_ == 0) return;
      lock.unlock();
      poll();  // may throw (an interrupt): the wait ends
      lock.lock();
    } else {
      cv_.wait(lock);
    }
  }
}

void Worker::drain(const std::function<void()>& poll, int poll_ms) {
  wait_impl([this] { return unfinished_ == 0; }, poll, poll_ms);
}

void Worker::wait(const TaskRef& task, const std::function<void()>& poll, int poll_ms) {
  if (!task) return;
  wait_impl([&task] { return task->done(); }, poll, poll_ms);
}

void Worker::wait_until(const std::function<bool()>& done, const std::function<void()>& poll,
                        int poll_ms) {
  wait_impl(done, poll, poll_ms);
}

void Worker::check() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (error_) throw_failed();
}

std::exception_ptr Worker::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

std::string Worker::error_message() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_message_;
}

void Worker::close() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (closed_) return;
    closed_ = true;
    stop_ = true;
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
}

bool Worker::closed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

std::vector<std::shared_ptr<void>> Worker::collect_released() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::shared_ptr<void>> out;
  out.swap(released_);
  return out;
}

int64_t Worker::grads_pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return grads_pending_;
}

int64_t Worker::unfinished() const {
  std::lock_guard<std::mutex> lock(mu_);
  return unfinished_;
}

}  // namespace scheduler
}  // namespace megatrain
