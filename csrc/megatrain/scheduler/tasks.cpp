#include "megatrain/scheduler/tasks.h"

#include <chrono>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace megatrain {
namespace scheduler {
namespace {

// Records a task's start (one clock read) in its outcome and, by finish(), its end and wall
// time (the second read). A null outcome: nothing is recorded, no clock is read after the start.
template <typename Outcome>
class TaskClock {
 public:
  explicit TaskClock(Outcome* outcome) : outcome_(outcome), t0_(std::chrono::steady_clock::now()) {
    if (outcome_) outcome_->started_s.store(steady_seconds(t0_));
  }
  void finish() {
    if (!outcome_) return;
    const auto t1 = std::chrono::steady_clock::now();
    outcome_->seconds.store(std::chrono::duration<double>(t1 - t0_).count());
    outcome_->finished_s.store(steady_seconds(t1));
  }

 private:
  Outcome* outcome_;
  std::chrono::steady_clock::time_point t0_;
};

// The tier units one task works on, acquired for its run. finish() releases them (dirty where
// written) and may throw the tier's sticky error; the destructor releases, clean and without
// throwing, what finish() did not (a task that threw before it).
class TierLease {
 public:
  TierLease(const TierState& tier, bool want_state, bool want_accum) : tier_(tier) {
    try {
      if (want_state && tier_.state) {
        state_ = tier_.state->acquire(tier_.state_unit);
        state_held_ = true;
      }
      if (want_accum && tier_.accum) {
        accum_ = tier_.accum->acquire(tier_.accum_unit);
        accum_held_ = true;
      }
    } catch (...) {
      release_quietly();
      throw;
    }
  }
  TierLease(const TierLease&) = delete;
  TierLease& operator=(const TierLease&) = delete;
  ~TierLease() { release_quietly(); }

  /// Section s (0 master, 1 exp_avg, 2 exp_avg_sq) of the state unit, + offset elements.
  float* state(size_t s, int64_t offset) const {
    if (!state_held_ || s >= state_.size()) {
      throw std::logic_error("scheduler task: an item names the disk tier's fp32 state, but the task has no state tier");
    }
    return static_cast<float*>(state_[s]) + offset;
  }
  float* accum(int64_t offset) const {
    if (!accum_held_ || accum_.empty()) {
      throw std::logic_error("scheduler task: an item names the disk tier's accumulator, but the task has no accumulator tier");
    }
    return static_cast<float*>(accum_[0]) + offset;
  }

  void finish(bool state_dirty, bool accum_dirty) {
    if (state_held_) {
      state_held_ = false;
      tier_.state->release(tier_.state_unit, state_dirty);
    }
    if (accum_held_) {
      accum_held_ = false;
      tier_.accum->release(tier_.accum_unit, accum_dirty);
    }
  }

 private:
  void release_quietly() noexcept {
    try {
      if (state_held_) {
        state_held_ = false;
        tier_.state->release(tier_.state_unit, false);
      }
    } catch (...) {
    }
    try {
      if (accum_held_) {
        accum_held_ = false;
        tier_.accum->release(tier_.accum_unit, false);
      }
    } catch (...) {
    }
  }

  const TierState& tier_;
  std::vector<void*> state_, accum_;
  bool state_held_ = false;
  bool accum_held_ = false;
};

bool any_tier(const std::vector<WeightsBack>& back) {
  for (const WeightsBack& w : back) {
    if (w.tier_offset >= 0) return true;
  }
  return false;
}

void write_back(const std::vector<WeightsBack>& back, const TierLease* lease = nullptr) {
  for (const WeightsBack& w : back) {
    const float* master = w.tier_offset >= 0 ? lease->state(0, w.tier_offset) : w.master;
    cpu_adam::weights_from_master(master, w.compute, w.compute_dtype, w.numel);
  }
}

float* accum_of(const StagedGrad& s, const TierLease& lease) {
  return s.tier_offset >= 0 ? lease.accum(s.tier_offset) : s.accum;
}

}  // namespace

std::function<void()> accumulate_task(std::shared_ptr<Ledger> ledger, int64_t unit,
                                      std::vector<DirectGrad> direct, std::vector<StagedGrad> staged,
                                      std::shared_ptr<GradOutcome> outcome, cpu_adam::ParallelFor pfor,
                                      TierState tier) {
  bool on_tier = false;
  for (const StagedGrad& g : staged) on_tier = on_tier || g.tier_offset >= 0;
  return [ledger = std::move(ledger), unit, direct = std::move(direct), staged = std::move(staged),
          outcome = std::move(outcome), pfor = std::move(pfor), tier = std::move(tier), on_tier] {
    TaskClock<GradOutcome> clock(outcome.get());
    TierLease lease(tier, false, on_tier);
    bool finite = true;
    for (const DirectGrad& d : direct) {
      // The device reduced the L2 norm; its square is taken here in double, as Python's float(n) ** 2.
      const double sq = d.norm != nullptr ? (*d.norm) * (*d.norm) : 0.0;
      ledger->landed_direct(unit, d.entry, sq, d.norm != nullptr);
      finite = finite && std::isfinite(sq);
    }
    for (const StagedGrad& s : staged) {
      const double sq =
          cpu_adam::grad_accumulate_tensor(accum_of(s, lease), s.grad, s.grad_dtype, s.overwrite, s.numel, pfor);
      ledger->accumulated(unit, s.entry, sq);
      finite = finite && std::isfinite(sq);
    }
    lease.finish(false, on_tier);
    if (outcome) {
      outcome->finite.store(finite);
      clock.finish();
      outcome->ran.store(true);
    }
  };
}

std::function<void()> move_to_accumulator_task(std::shared_ptr<Ledger> ledger, int64_t unit,
                                               std::vector<StagedGrad> moved, std::vector<WeightsBack> back,
                                               cpu_adam::ParallelFor pfor, TierState tier) {
  if (moved.size() != back.size()) {
    throw std::invalid_argument("move_to_accumulator_task: one WeightsBack per moved gradient");
  }
  bool on_tier = any_tier(back);
  for (const StagedGrad& g : moved) on_tier = on_tier || g.tier_offset >= 0;
  return [ledger = std::move(ledger), unit, moved = std::move(moved), back = std::move(back),
          pfor = std::move(pfor), tier = std::move(tier), on_tier] {
    TierLease lease(tier, on_tier, on_tier);
    for (size_t k = 0; k < moved.size(); ++k) {
      const StagedGrad& s = moved[k];
      const double sq =
          cpu_adam::grad_accumulate_tensor(accum_of(s, lease), s.grad, s.grad_dtype, true, s.numel, pfor);
      ledger->moved_to_accumulator(unit, s.entry, sq);
    }
    write_back(back, &lease);
    lease.finish(false, on_tier);
  };
}

std::function<void()> adam_task(std::shared_ptr<Ledger> ledger, AdamTask task, cpu_adam::ParallelFor pfor) {
  bool state_on_tier = any_tier(task.restore) || any_tier(task.restore_on_skip);
  bool accum_on_tier = false;
  for (const AdamItem& it : task.items) {
    state_on_tier = state_on_tier || it.tier_offset >= 0;
    accum_on_tier = accum_on_tier || (it.tier_offset >= 0 && it.grad_from_tier);
  }
  return [ledger = std::move(ledger), task = std::move(task), pfor = std::move(pfor), state_on_tier,
          accum_on_tier] {
    TaskClock<UpdateOutcome> clock(task.outcome.get());
    for (int64_t i : task.ledger_entries) ledger->start_update(task.unit, i);
    const bool skip = task.finite_from && !task.items.empty() && !task.finite_from->finite.load();
    // The accumulator is read only by an update that runs.
    TierLease lease(task.tier, state_on_tier, accum_on_tier && !skip);
    if (skip) {
      // A non-finite gradient never reaches the masters: the unit's update is skipped.
      write_back(task.restore_on_skip, &lease);
      if (task.outcome) task.outcome->skipped.store(true);
    } else {
      for (const AdamItem& it : task.items) {
        cpu_adam::AdamHyper h = it.hyper;
        h.grad_scale = task.grad_scale;
        cpu_adam::AdamArgs a = it.args;
        if (it.tier_offset >= 0) {
          a.master = lease.state(0, it.tier_offset);
          a.exp_avg = lease.state(1, it.tier_offset);
          a.exp_avg_sq = lease.state(2, it.tier_offset);
          if (it.grad_from_tier) {
            a.grad = lease.accum(it.tier_offset);
            a.grad_dtype = cpu_adam::GradDtype::kFloat32;
          }
        }
        cpu_adam::adamw_tensor(a, h, it.numel, pfor);
      }
      write_back(task.restore, &lease);
    }
    lease.finish(!skip && !task.items.empty(), false);
    for (int64_t i : task.ledger_entries) ledger->finish_update(task.unit, i);
    if (task.outcome) {
      clock.finish();
      task.outcome->ran.store(true);
    }
  };
}

std::function<void()> weights_back_task(std::vector<WeightsBack> back) {
  if (any_tier(back)) throw std::invalid_argument("weights_back_task: a master on disk needs an update task's TierState");
  return [back = std::move(back)] { write_back(back); };
}

}  // namespace scheduler
}  // namespace megatrain
