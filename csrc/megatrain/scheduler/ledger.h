// The gradient ledger: one explicit state machine per entry (parameter) of every unit, shared by
// the thread that runs backward (submits gradients, plans updates), the CPU worker (lands and
// accumulates them, runs the updates) and the optimizer (reads norms at step()). Torch-free;
// every transition method checks its source state under one lock and throws LedgerError on an
// illegal transition, naming the entry, its state and the transition.
//
// Where an entry's gradient is (GradPlace), per optimizer window (from one step / zero_grad to
// the next):
//
//   kNone ──begin_d2h(direct)──▶ kInFlightDirect ──landed_direct──▶ kDirect ──moved_to_accumulator─┐
//     │                          (D2H into the entry's slice of the compute section)              │
//     ├──begin_d2h(staged)─▶ kInFlightStaging ──accumulated (last in flight)──▶ kAccumulated ◀────┘
//     │                      ▲  │ (D2H into pinned staging, then summed in fp32)       │
//     │                      └──┴──────begin_d2h(staged): one more in flight ──────────┘
//     └──on_device──▶ kOnDevice (a device-state layer: summed in the device accumulator) ─┐
//                         ▲──────────────────────on_device─────────────────────────────────┘
//   reset (zero_grad): kNone | kDirect | kAccumulated | kOnDevice ──▶ kNone (in-flight: illegal)
//
// The update of an entry (UpdateState): kNone / kDone ──queue_update──▶ kQueued ──start_update──▶
// kRunning ──finish_update──▶ kDone; kQueued ──cancel_update──▶ kNone (the worker refused it);
// kDone ──begin_d2h / on_device / reset──▶ kNone (that update's window is over).
// An update reads the gradient where it was when the update was queued and takes it over: a
// kInFlightDirect / kDirect gradient whose update is queued, running or done is no longer "in the
// compute section" (the update rewrites the compute copy). reset() of the window leaves a queued
// or running update as it is.
#pragma once

#include <cstdint>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

namespace megatrain {
namespace scheduler {

/// \brief Where an entry's gradient of the current window is.
enum class GradPlace : uint8_t {
  kNone,              ///< no gradient since the last step / zero_grad
  kOnDevice,          ///< summed in a device-state layer's device accumulator
  kInFlightStaging,   ///< D2H into a pinned staging buffer issued; not yet accumulated
  kInFlightDirect,    ///< D2H straight into the compute section issued; not yet landed
  kDirect,            ///< landed in the compute section (its weights are not there now)
  kAccumulated,       ///< summed into the fp32 gradient accumulator
};

/// \brief The state of an entry's optimizer update.
enum class UpdateState : uint8_t { kNone, kQueued, kRunning, kDone };

const char* grad_place_name(GradPlace p);
const char* update_state_name(UpdateState s);

/// \brief A snapshot of one entry's state.
struct EntryState {
  GradPlace place = GradPlace::kNone;
  int64_t micro_batches = 0;  ///< backward passes that delivered a gradient this window
  int64_t in_flight = 0;      ///< D2H copies issued and not yet landed / accumulated
  double grad_sq = 0.0;       ///< squared L2 norm of the gradient now held (0 until known)
  bool norm_known = false;    ///< grad_sq was recorded for the gradient now held
  bool finite = true;         ///< grad_sq is finite (no inf / NaN in the gradient)
  bool eager = false;         ///< its update was planned during backward (this window)
  UpdateState update = UpdateState::kNone;
};

/// \brief An illegal transition (a scheduler bug, never a user error).
class LedgerError : public std::logic_error {
 public:
  explicit LedgerError(const std::string& what) : std::logic_error(what) {}
};

/// \brief Per-entry gradient state machines of all units (see the file comment).
class Ledger {
 public:
  /// \param[in] entries_per_unit number of entries of unit u, for u in [0, units).
  explicit Ledger(std::vector<int64_t> entries_per_unit);

  int64_t num_units() const { return static_cast<int64_t>(entries_.size()); }
  int64_t num_entries(int64_t unit) const;
  /// \throws std::out_of_range for a bad (unit, entry).
  EntryState get(int64_t unit, int64_t entry) const;

  // ---- thread running backward, when the gradient is handed over
  /// \brief D2H issued: kNone -> kInFlightDirect (direct) or kNone | kAccumulated |
  /// kInFlightStaging -> kInFlightStaging (staged); in_flight and micro_batches += 1.
  /// \return the accumulate's overwrite flag: true when the accumulator holds nothing of this
  /// window (the entry was kNone).
  bool begin_d2h(int64_t unit, int64_t entry, bool direct);
  /// \brief A device-state layer's gradient was summed on the device: kNone | kOnDevice -> kOnDevice;
  /// micro_batches += 1.
  void on_device(int64_t unit, int64_t entry);
  /// \brief Its update is planned during backward (eager); requires micro_batches > 0.
  void mark_eager(int64_t unit, int64_t entry);

  // ---- worker, in the order the gradient tasks run
  /// \brief kInFlightDirect -> kDirect; records `grad_sq` when `norm_known`.
  void landed_direct(int64_t unit, int64_t entry, double grad_sq, bool norm_known);
  /// \brief One staged gradient was summed: in_flight -= 1; kInFlightStaging -> kAccumulated
  /// when none is left in flight; records the accumulator's squared norm.
  void accumulated(int64_t unit, int64_t entry, double grad_sq);
  /// \brief kDirect -> kAccumulated: the gradient moved from the compute section to the accumulator.
  void moved_to_accumulator(int64_t unit, int64_t entry, double grad_sq);
  /// \brief The squared norm of a kOnDevice / kDirect gradient, read back from the device.
  void record_norm(int64_t unit, int64_t entry, double grad_sq);

  /// \brief zero_grad: kNone | kDirect | kAccumulated | kOnDevice -> kNone; clears micro_batches,
  /// the norm and eager. Leaves the update state.
  void reset(int64_t unit, int64_t entry);

  // ---- updates
  void queue_update(int64_t unit, int64_t entry);   ///< kNone | kDone -> kQueued
  void cancel_update(int64_t unit, int64_t entry);  ///< kQueued -> kNone
  void start_update(int64_t unit, int64_t entry);   ///< kQueued -> kRunning
  void finish_update(int64_t unit, int64_t entry);  ///< kRunning -> kDone

  // ---- queries (one lock each)
  /// \brief Every entry of `unit`, in entry order (one lock).
  /// \throws std::out_of_range for a bad unit.
  std::vector<EntryState> states(int64_t unit) const;
  /// \brief Some entry of `unit` holds (or will hold) a gradient in the compute section that no
  /// update has taken over (kInFlightDirect / kDirect with update kNone).
  bool any_in_compute(int64_t unit) const;
  /// \brief Some entry of `unit` has an update queued or running.
  bool update_pending(int64_t unit) const;
  /// \brief Every entry in `entries` that holds a gradient has a finite norm.
  bool finite(int64_t unit, const std::vector<int64_t>& entries) const;
  /// \brief Squared norm of every entry of `unit` (0 for entries without a gradient).
  std::vector<double> grad_sq(int64_t unit) const;

 private:
  EntryState& at(int64_t unit, int64_t entry, const char* op);  // lock held
  // The update state from from_a or from_b to `to`, else LedgerError.
  void move_update(int64_t unit, int64_t entry, const char* op, UpdateState from_a, UpdateState from_b,
                   UpdateState to);
  [[noreturn]] void illegal(int64_t unit, int64_t entry, const char* op, const EntryState& s) const;

  mutable std::mutex mu_;
  std::vector<std::vector<EntryState>> entries_;
};

}  // namespace scheduler
}  // namespace megatrain
