// The CPU worker: order (gradient tasks FIFO and first, updates earliest deadline first),
// readiness (gates skipped while closed, the blocking rule), failure (sticky) and close.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "megatrain/scheduler/worker.h"

namespace sch = megatrain::scheduler;
using sch::Task;
using sch::TaskClass;

namespace {

// A gate the test opens by hand; wait() blocks until it is open and counts its calls.
struct ManualGate {
  std::atomic<bool> open{false};
  std::atomic<int> waits{0};
  sch::Gate gate() {
    sch::Gate g;
    g.query = [this] { return open.load(); };
    g.wait = [this] {
      waits.fetch_add(1);
      while (!open.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    };
    return g;
  }
};

// Records the order tasks ran in.
struct Log {
  std::mutex mu;
  std::vector<std::string> order;
  std::function<void()> add(std::string s) {
    return [this, s] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(s);
    };
  }
};

Task grad(std::function<void()> run, sch::Gate gate = {}) {
  Task t;
  t.klass = TaskClass::kGrad;
  t.run = std::move(run);
  t.gate = std::move(gate);
  return t;
}

Task update(int64_t key, std::function<void()> run, sch::Gate gate = {}) {
  Task t;
  t.klass = TaskClass::kUpdate;
  t.key = key;
  t.run = std::move(run);
  t.gate = std::move(gate);
  return t;
}

// Holds the worker inside a first task until release() (so the queue fills behind it).
struct Hold {
  ManualGate g;
  Task task() {
    return grad([this] { g.gate().wait(); });
  }
  void release() { g.open = true; }
};

}  // namespace

TEST(Worker, GradientTasksRunFirstInOrderThenUpdatesByDeadline) {
  sch::Worker w;
  Log log;
  Hold hold;
  w.submit(hold.task());
  w.submit(update(5, log.add("u5")));
  w.submit(update(1, log.add("u1a")));
  w.submit(update(3, log.add("u3")));
  w.submit(update(1, log.add("u1b")));  // same key: submission order
  w.submit(grad(log.add("g0")));
  w.submit(grad(log.add("g1")));
  hold.release();
  w.drain();
  EXPECT_EQ(log.order, (std::vector<std::string>{"g0", "g1", "u1a", "u1b", "u3", "u5"}));
  EXPECT_EQ(w.unfinished(), 0);
}

TEST(Worker, ReadyUpdateRunsWhileOldestGradientWaitsForItsCopy) {
  sch::Worker w;
  Log log;
  Hold hold;
  ManualGate copy;  // the D2H copy of the gradient task
  w.submit(hold.task());
  w.submit(grad(log.add("g_waiting"), copy.gate()));
  w.submit(grad(log.add("g_next")));
  w.submit(update(2, log.add("u2")));
  w.submit(update(1, log.add("u1")));
  hold.release();
  // Both updates run before the copy is done; the gradient tasks stay queued in order.
  for (int i = 0; i < 2000 && w.unfinished() > 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  {
    std::lock_guard<std::mutex> lock(log.mu);
    EXPECT_EQ(log.order, (std::vector<std::string>{"u1", "u2"}));
  }
  EXPECT_EQ(w.grads_pending(), 2);
  copy.open = true;
  w.wait_grads();
  EXPECT_EQ(log.order, (std::vector<std::string>{"u1", "u2", "g_waiting", "g_next"}));
}

TEST(Worker, WithNoReadyUpdateTheOldestGradientIsTakenAndItsCopyWaitedFor) {
  sch::Worker w;
  Log log;
  Hold hold;
  ManualGate copy;
  ManualGate later;  // an update that is not ready either
  w.submit(hold.task());
  w.submit(grad(log.add("g"), copy.gate()));
  w.submit(update(0, log.add("u"), later.gate()));
  hold.release();
  for (int i = 0; i < 2000 && copy.waits.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(copy.waits.load(), 1);  // blocked on the copy, not spinning over the queue
  EXPECT_EQ(later.waits.load(), 0);
  copy.open = true;
  w.wait_grads();
  later.open = true;
  w.drain();
  EXPECT_EQ(log.order, (std::vector<std::string>{"g", "u"}));
}

TEST(Worker, UpdateGatedOnItsGradientTaskWaitsForIt) {
  sch::Worker w;
  Log log;
  Hold hold;
  ManualGate copy;
  w.submit(hold.task());
  sch::TaskRef g = w.submit(grad(log.add("g"), copy.gate()));
  w.submit(update(0, log.add("u_after_g"), sch::after_task(g)));
  w.submit(update(9, log.add("u_free")));
  hold.release();
  for (int i = 0; i < 2000 && w.unfinished() > 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_FALSE(g->done());
  copy.open = true;
  w.drain();
  EXPECT_EQ(log.order, (std::vector<std::string>{"u_free", "g", "u_after_g"}));
  EXPECT_TRUE(g->done());
}

TEST(Worker, WaitForOneTaskAndWaitUntil) {
  sch::Worker w;
  std::atomic<int> n{0};
  Hold hold;
  w.submit(hold.task());
  sch::TaskRef t = w.submit(update(0, [&] { n = 7; }));
  EXPECT_FALSE(t->done());
  std::thread opener([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    hold.release();
  });
  w.wait(t);
  EXPECT_TRUE(t->done());
  EXPECT_EQ(n.load(), 7);
  w.wait_until([&] { return n.load() == 7; });
  opener.join();
  EXPECT_GT(t->seq(), 0);
}

TEST(Worker, PollRunsDuringLongWaitsAndItsExceptionEndsTheWait) {
  sch::Worker w;
  Hold hold;
  w.submit(hold.task());
  int polls = 0;
  EXPECT_THROW(w.drain([&] { if (++polls == 3) throw std::runtime_error("interrupted"); }, 1),
               std::runtime_error);
  EXPECT_EQ(polls, 3);
  hold.release();
  w.drain();
}

TEST(Worker, FailureIsStickyLaterTasksAreSkippedAndEveryCallRaises) {
  sch::Worker w;
  std::atomic<int> ran{0};
  Hold hold;
  w.submit(hold.task());
  w.submit(grad([] { throw std::runtime_error("simulated accumulate failure"); }));
  sch::TaskRef after = w.submit(grad([&] { ran += 1; }));
  w.submit(update(0, [&] { ran += 1; }));
  hold.release();
  try {
    w.drain();
    FAIL() << "drain() did not raise";
  } catch (const sch::WorkerFailed& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("megatrain CPU worker failed: simulated accumulate failure"), std::string::npos) << msg;
    EXPECT_NE(msg.find("cannot train on"), std::string::npos) << msg;
  }
  EXPECT_EQ(ran.load(), 0);
  // drain() raises as soon as the failure is recorded; the worker then skips the rest of the
  // queue, marking each task done (nobody waits for a skipped task forever).
  for (int i = 0; i < 5000 && w.unfinished() != 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  EXPECT_EQ(w.unfinished(), 0);
  EXPECT_TRUE(after->done());
  EXPECT_EQ(ran.load(), 0);
  EXPECT_THROW(w.submit(grad([] {})), sch::WorkerFailed);
  EXPECT_THROW(w.wait_grads(), sch::WorkerFailed);
  EXPECT_THROW(w.wait(after), sch::WorkerFailed);
  EXPECT_THROW(w.check(), sch::WorkerFailed);
  EXPECT_TRUE(static_cast<bool>(w.error()));
  EXPECT_EQ(w.error_message(), "simulated accumulate failure");
  w.close();
}

TEST(Worker, FailureWhileAWaiterWaitsWakesIt) {
  sch::Worker w;
  Hold hold;
  w.submit(hold.task());
  w.submit(update(0, [] { throw std::runtime_error("simulated adam failure"); }));
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    hold.release();
  });
  EXPECT_THROW(w.drain(), sch::WorkerFailed);  // no poll: woken by the failure, not by a timeout
  t.join();
}

TEST(Worker, DescribeNamesTheFailure) {
  sch::WorkerOptions o;
  o.describe = [](std::exception_ptr p) {
    try {
      std::rethrow_exception(p);
    } catch (const std::exception& e) {
      return std::string("RuntimeError('") + e.what() + "')";
    }
  };
  sch::Worker w(o);
  w.submit(grad([] { throw std::runtime_error("x"); }));
  EXPECT_THROW(w.drain(), sch::WorkerFailed);
  EXPECT_EQ(w.error_message(), "RuntimeError('x')");
}

TEST(Worker, GateWhoseQueryThrowsFailsTheWorkerInsteadOfTheProcess) {
  sch::Worker w;
  sch::Gate g;
  g.query = [] () -> bool { throw std::runtime_error("cudaEventQuery failed: bad event"); };
  g.wait = [] { throw std::runtime_error("cudaEventSynchronize failed: bad event"); };
  w.submit(grad([] {}, g));
  try {
    w.drain();
    FAIL() << "drain() did not raise";
  } catch (const sch::WorkerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("cudaEventSynchronize failed"), std::string::npos);
  }
}

TEST(Worker, CloseRunsWhatIsQueuedThenJoinsAndRefusesNewWork) {
  std::atomic<int> ran{0};
  sch::Worker w;
  Hold hold;
  w.submit(hold.task());
  for (int i = 0; i < 5; ++i) w.submit(update(i, [&] { ran += 1; }));
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    hold.release();
  });
  w.close();
  t.join();
  EXPECT_EQ(ran.load(), 5);
  EXPECT_TRUE(w.closed());
  EXPECT_THROW(w.submit(grad([] {})), std::logic_error);
  w.close();  // idempotent
}

TEST(Worker, DestructorJoinsAfterRunningQueuedTasks) {
  std::atomic<int> ran{0};
  {
    sch::Worker w;
    for (int i = 0; i < 3; ++i) w.submit(grad([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
      ran += 1;
    }));
  }
  EXPECT_EQ(ran.load(), 3);
}

TEST(Worker, ThreadInitRunsOnTheWorkerThreadBeforeTheFirstTask) {
  std::thread::id init_id, task_id;
  std::atomic<bool> init_ran{false};
  bool init_first = false;
  sch::WorkerOptions o;
  o.thread_init = [&] {
    init_id = std::this_thread::get_id();
    init_ran = true;
  };
  sch::Worker w(o);
  w.submit(grad([&] {
    task_id = std::this_thread::get_id();
    init_first = init_ran.load();
  }));
  w.drain();
  EXPECT_TRUE(init_first);
  EXPECT_EQ(init_id, task_id);
  EXPECT_NE(task_id, std::this_thread::get_id());
}

TEST(Worker, KeepIsHandedBackToTheCallerNotReleasedOnTheWorker) {
  sch::Worker w;
  auto kept = std::make_shared<int>(42);
  std::weak_ptr<int> weak = kept;
  Task t = grad([] {});
  t.keep = std::move(kept);
  w.submit(std::move(t));
  w.drain();
  EXPECT_FALSE(weak.expired());  // still alive: the worker did not drop it
  auto released = w.collect_released();
  ASSERT_EQ(released.size(), 1u);
  released.clear();
  EXPECT_TRUE(weak.expired());
  EXPECT_TRUE(w.collect_released().empty());
}

TEST(Worker, WaitGradsRunsTheOldestGradientTaskItselfWhileTheWorkerIsInAnUpdate) {
  sch::Worker w;
  ManualGate inside;   // the update runs until the test opens this
  std::atomic<bool> update_started{false};
  std::thread::id ran_on;
  w.submit(update(0, [&] {
    update_started = true;
    inside.gate().wait();
  }));
  for (int i = 0; i < 2000 && !update_started.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(update_started.load());
  Log log;
  w.submit(grad([&] { ran_on = std::this_thread::get_id(); log.add("g0")(); }));
  w.submit(grad(log.add("g1")));
  w.wait_grads();  // returns with the update still running
  EXPECT_EQ(ran_on, std::this_thread::get_id());
  EXPECT_EQ(log.order, (std::vector<std::string>{"g0", "g1"}));
  EXPECT_EQ(w.grads_pending(), 0);
  EXPECT_EQ(w.unfinished(), 1);
  inside.open = true;
  w.drain();
  EXPECT_EQ(w.unfinished(), 0);
}

TEST(Worker, AnUpdateGatedOnAGradientTaskThatAWaiterRunsWaitsForIt) {
  sch::Worker w;
  ManualGate hold;     // the worker is inside this update while the waiter takes the gradient task
  ManualGate in_grad;  // the gradient task runs until the test opens this
  std::atomic<bool> hold_started{false};
  std::atomic<bool> grad_done{false};
  std::atomic<bool> update_saw_grad_done{false};
  w.submit(update(0, [&] {
    hold_started = true;
    hold.gate().wait();
  }));
  for (int i = 0; i < 2000 && !hold_started.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_TRUE(hold_started.load());
  auto g = w.submit(grad([&] {
    in_grad.gate().wait();
    grad_done = true;
  }));
  w.submit(update(1, [&] { update_saw_grad_done = grad_done.load(); }, sch::after_task(g)));
  std::thread waiter([&] { w.wait_grads(); });
  for (int i = 0; i < 2000 && in_grad.waits.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  ASSERT_EQ(in_grad.waits.load(), 1);  // the waiter is inside the gradient task
  hold.open = true;                    // the worker now finds only the update gated on it
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(g->done());
  in_grad.open = true;
  waiter.join();
  w.drain();
  EXPECT_TRUE(update_saw_grad_done.load());
}

TEST(Worker, AFailureInAGradientTaskRunByTheWaiterIsStickyAndRaisedByTheWait) {
  sch::Worker w;
  ManualGate inside;
  std::atomic<bool> update_started{false};
  w.submit(update(0, [&] {
    update_started = true;
    inside.gate().wait();
  }));
  for (int i = 0; i < 2000 && !update_started.load(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::atomic<bool> later_ran{false};
  w.submit(grad([] { throw std::runtime_error("boom in a gradient task"); }));
  w.submit(grad([&] { later_ran = true; }));
  try {
    w.wait_grads();
    FAIL() << "wait_grads did not raise";
  } catch (const sch::WorkerFailed& e) {
    EXPECT_NE(std::string(e.what()).find("boom in a gradient task"), std::string::npos);
  }
  inside.open = true;
  EXPECT_THROW(w.drain(), sch::WorkerFailed);
  EXPECT_FALSE(later_ran.load());
}
