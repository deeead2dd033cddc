// The worker's kernel tasks over raw host pointers (torch-free): accumulate a unit's gradients,
// AdamW over a unit's entries, and the compute copy rewritten from the fp32 masters. They run
// the cpu_adam drivers directly (no GIL, no dispatcher) and record what they did in the Ledger.
// The pointers must stay valid until the task ran (the bindings keep their tensors in Task::keep).
//
// A unit whose fp32 state is in the disk tier (TierState): the task acquires the unit from the
// tier when it runs (blocking until its read is done; the worker holds no lock meanwhile), runs
// the same kernels on the tier's buffer and releases it afterwards (dirty, i.e. written behind,
// where it wrote). Its items then name the fp32 sections by element offset (tier_offset) instead
// of by pointer; the kernels and their order are the host-store path's, so the bits are too.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "megatrain/cpu_adam/adam_driver.h"
#include "megatrain/disk_tier/disk_tier.h"
#include "megatrain/scheduler/ledger.h"

namespace megatrain {
namespace scheduler {

/// \brief Where a unit's fp32 state lives when it is not in the host store: unit `state_unit` of
/// `state` holds master, exp_avg, exp_avg_sq (its sections 0, 1, 2); unit `accum_unit` of `accum`
/// holds the fp32 gradient accumulator (its section 0). Null tiers: not on disk.
struct TierState {
  std::shared_ptr<disk_tier::DiskTier> state;
  int64_t state_unit = -1;
  std::shared_ptr<disk_tier::DiskTier> accum;
  int64_t accum_unit = -1;
};

/// \brief Seconds of `t` on std::chrono::steady_clock since that clock's epoch: the clock of the
/// outcomes' started_s / finished_s (a per-step timeline of the worker's tasks).
inline double steady_seconds(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count();
}

/// \brief steady_seconds() of now.
inline double steady_now() { return steady_seconds(std::chrono::steady_clock::now()); }

/// \brief What a gradient task found, read by the update planned on that gradient (a later
/// zero_grad may reset the ledger before the update runs).
struct GradOutcome {
  std::atomic<bool> finite{true};  ///< every gradient this task landed has a finite norm
  std::atomic<bool> ran{false};
  std::atomic<double> seconds{0.0};  ///< wall time of the task's kernels (set when it ran)
  std::atomic<double> started_s{-1.0};   ///< steady_seconds() when its kernels started (-1 before)
  std::atomic<double> finished_s{-1.0};  ///< steady_seconds() when its kernels ended (-1 before)
};

/// \brief What an update task did, read by the optimizer at its next sync point.
struct UpdateOutcome {
  std::atomic<bool> skipped{false};  ///< a non-finite gradient: the update was not applied
  std::atomic<bool> ran{false};
  std::atomic<double> seconds{0.0};  ///< wall time of the update (set when it ran)
  std::atomic<double> started_s{-1.0};   ///< steady_seconds() when the update started (-1 before)
  std::atomic<double> finished_s{-1.0};  ///< steady_seconds() when the update ended (-1 before)
};

/// \brief A gradient D2H'd into pinned staging, to be summed into the fp32 accumulator.
struct StagedGrad {
  int64_t entry = 0;
  float* accum = nullptr;          ///< [numel] fp32 accumulator slice
  const void* grad = nullptr;      ///< [numel] fp32 / bf16 staging slice
  cpu_adam::GradDtype grad_dtype = cpu_adam::GradDtype::kBFloat16;
  int64_t numel = 0;
  bool overwrite = true;           ///< Ledger::begin_d2h's answer
  /// >= 0: accum is element tier_offset of the accumulator unit of the task's TierState.
  int64_t tier_offset = -1;
};

/// \brief A gradient D2H'd straight into the compute section.
struct DirectGrad {
  int64_t entry = 0;
  /// Host float64 L2 norm of the gradient (reduced on the device and copied with it), read when
  /// the task runs; null: no norm needed (no clipping, no finite check).
  const double* norm = nullptr;
};

/// \brief The compute copy of one entry rewritten from its fp32 master.
struct WeightsBack {
  const float* master = nullptr;
  void* compute = nullptr;
  cpu_adam::OutDtype compute_dtype = cpu_adam::OutDtype::kBFloat16;
  int64_t numel = 0;
  /// >= 0: master is element tier_offset of the master section of the task's TierState.
  int64_t tier_offset = -1;
};

/// \brief One entry's fused AdamW (same arguments as the adamw_step_ op).
struct AdamItem {
  int64_t entry = 0;
  cpu_adam::AdamArgs args;  ///< nt_out / prefetch_bytes are set by the driver
  cpu_adam::AdamHyper hyper;
  int64_t numel = 0;
  /// >= 0: master / exp_avg / exp_avg_sq are element tier_offset of the task's TierState's
  /// sections (args' pointers for them are ignored).
  int64_t tier_offset = -1;
  /// With tier_offset: the gradient is the fp32 accumulator on disk at the same offset (args.grad
  /// ignored); false: args.grad (a direct gradient in the compute section).
  bool grad_from_tier = false;
};

/// \brief The gradient task of one unit: ledger landed_direct (norm^2 from `direct[k].norm`)
/// for the direct entries, then accumulate each staged gradient (Ledger::accumulated with its
/// squared norm), in the order given; sets `outcome` (finite over all of them) when done.
/// With `tier.accum` set, the staged gradients with a tier_offset are summed into the accumulator
/// unit on disk (acquired for the task, released dirty).
std::function<void()> accumulate_task(std::shared_ptr<Ledger> ledger, int64_t unit,
                                      std::vector<DirectGrad> direct, std::vector<StagedGrad> staged,
                                      std::shared_ptr<GradOutcome> outcome,
                                      cpu_adam::ParallelFor pfor = {}, TierState tier = {});

/// \brief Moves direct gradients (in the compute section) into the accumulator and rewrites the
/// compute copy from the masters: per entry grad_accumulate(overwrite) then weights back;
/// Ledger::moved_to_accumulator. `moved[k].grad` must point at the compute slice of `back[k]`.
/// With `tier`: the tier_offset fields name the accumulator / master on disk.
std::function<void()> move_to_accumulator_task(std::shared_ptr<Ledger> ledger, int64_t unit,
                                               std::vector<StagedGrad> moved, std::vector<WeightsBack> back,
                                               cpu_adam::ParallelFor pfor = {}, TierState tier = {});

/// \brief An update task of one unit.
struct AdamTask {
  int64_t unit = 0;
  std::vector<AdamItem> items;        ///< updated in this order
  float grad_scale = 1.0f;            ///< the clip coefficient (1: none), applied in the kernel
  std::vector<WeightsBack> restore;   ///< after the update: direct entries that were not updated
  std::vector<int64_t> ledger_entries;  ///< queued in the ledger (start/finish_update)
  /// Skip the update when this gradient task found a non-finite gradient (null: never skip).
  std::shared_ptr<GradOutcome> finite_from;
  std::vector<WeightsBack> restore_on_skip;  ///< the direct entries' weights, when skipped
  /// Set when the update was skipped (the optimizer reads it at its next sync point).
  std::shared_ptr<UpdateOutcome> outcome;
  /// The unit's fp32 state on disk (items / restore with tier_offset); the state unit is released
  /// dirty when an item was updated, clean otherwise; the accumulator always clean.
  TierState tier;
};

/// \brief The update task: start_update of ledger_entries; if finite_from says non-finite (and
/// there are items), restore_on_skip and set outcome->skipped; else AdamW of each item with grad_scale,
/// then restore; finish_update.
std::function<void()> adam_task(std::shared_ptr<Ledger> ledger, AdamTask task, cpu_adam::ParallelFor pfor = {});

/// \brief Rewrites compute copies from the masters (zero_grad of gradients never used).
std::function<void()> weights_back_task(std::vector<WeightsBack> back);

}  // namespace scheduler
}  // namespace megatrain
