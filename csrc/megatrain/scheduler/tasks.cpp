#include "megatrain/scheduler/tasks.h"

#include <chrono>
#include <cmath>
#include <stdexcept>
#include <utility>

namespace megatrain {
namespace scheduler {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void write_back(const std::vector<WeightsBack>& back) {
  for (const WeightsBack& w : back) cpu_adam::weights_from_master(w.master, w.compute, w.compute_dtype, w.numel);
}

}  // namespace

std::function<void()> accumulate_task(std::shared_ptr<Ledger> ledger, int64_t unit,
                                      std::vector<DirectGrad> direct, std::vector<StagedGrad> staged,
                                      std::shared_ptr<GradOutcome> outcome, cpu_adam::ParallelFor pfor) {
  return [ledger = std::move(ledger), unit, direct = std::move(direct), staged = std::move(staged),
          outcome = std::move(outcome), pfor = std::move(pfor)] {
    const auto t0 = std::chrono::steady_clock::now();
    bool finite = true;
    for (const DirectGrad& d : direct) {
      // The device reduced the L2 norm; its square is taken here in double, as Python's float(n) ** 2.
      const double sq = d.norm != nullptr ? (*d.norm) * (*d.norm) : 0.0;
      ledger->landed_direct(unit, d.entry, sq, d.norm != nullptr);
      finite = finite && std::isfinite(sq);
    }
    for (const StagedGrad& s : staged) {
      const double sq = cpu_adam::grad_accumulate_tensor(s.accum, s.grad, s.grad_dtype, s.overwrite, s.numel, pfor);
      ledger->accumulated(unit, s.entry, sq);
      finite = finite && std::isfinite(sq);
    }
    if (outcome) {
      outcome->finite.store(finite);
      outcome->seconds.store(seconds_since(t0));
      outcome->ran.store(true);
    }
  };
}

std::function<void()> move_to_accumulator_task(std::shared_ptr<Ledger> ledger, int64_t unit,
                                               std::vector<StagedGrad> moved, std::vector<WeightsBack> back,
                                               cpu_adam::ParallelFor pfor) {
  if (moved.size() != back.size()) {
    throw std::invalid_argument("move_to_accumulator_task: one WeightsBack per moved gradient");
  }
  return [ledger = std::move(ledger), unit, moved = std::move(moved), back = std::move(back),
          pfor = std::move(pfor)] {
    for (size_t k = 0; k < moved.size(); ++k) {
      const StagedGrad& s = moved[k];
      const double sq = cpu_adam::grad_accumulate_tensor(s.accum, s.grad, s.grad_dtype, true, s.numel, pfor);
      ledger->moved_to_accumulator(unit, s.entry, sq);
    }
    write_back(back);
  };
}

std::function<void()> adam_task(std::shared_ptr<Ledger> ledger, AdamTask task, cpu_adam::ParallelFor pfor) {
  return [ledger = std::move(ledger), task = std::move(task), pfor = std::move(pfor)] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int64_t i : task.ledger_entries) ledger->start_update(task.unit, i);
    const bool skip = task.finite_from && !task.items.empty() && !task.finite_from->finite.load();
    if (skip) {
      // A non-finite gradient never reaches the masters: the unit's update is skipped.
      write_back(task.restore_on_skip);
      if (task.outcome) task.outcome->skipped.store(true);
    } else {
      for (const AdamItem& it : task.items) {
        cpu_adam::AdamHyper h = it.hyper;
        h.grad_scale = task.grad_scale;
        cpu_adam::adamw_tensor(it.args, h, it.numel, pfor);
      }
      write_back(task.restore);
    }
    for (int64_t i : task.ledger_entries) ledger->finish_update(task.unit, i);
    if (task.outcome) {
      task.outcome->seconds.store(seconds_since(t0));
      task.outcome->ran.store(true);
    }
  };
}

std::function<void()> weights_back_task(std::vector<WeightsBack> back) {
  return [back = std::move(back)] { write_back(back); };
}

}  // namespace scheduler
}  // namespace megatrain
