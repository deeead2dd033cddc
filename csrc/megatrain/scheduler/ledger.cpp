#include "megatrain/scheduler/ledger.h"

#include <cmath>
#include <utility>

namespace megatrain {
namespace scheduler {

const char* grad_place_name(GradPlace p) {
  switch (p) {
    case GradPlace::kNone: return "none";
    case GradPlace::kOnDevice: return "on_device";
    case GradPlace::kInFlightStaging: return "in_flight_staging";
    case GradPlace::kInFlightDirect: return "in_flight_direct";
    case GradPlace::kDirect: return "direct";
    case GradPlace::kAccumulated: return "accumulated";
  }
  return "?";
}

const char* update_state_name(UpdateState s) {
  switch (s) {
    case UpdateState::kNone: return "none";
    case UpdateState::kQueued: return "queued";
    case UpdateState::kRunning: return "running";
    case UpdateState::kDone: return "done";
  }
  return "?";
}

Ledger::Ledger(std::vector<int64_t> entries_per_unit) {
  entries_.reserve(entries_per_unit.size());
  for (int64_t n : entries_per_unit) {
    if (n < 0) throw std::invalid_argument("Ledger: a unit cannot have a negative entry count");
    entries_.emplace_back(static_cast<size_t>(n));
  }
}

int64_t Ledger::num_entries(int64_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (unit < 0 || unit >= num_units()) {
    throw std::out_of_range("Ledger: unit " + std::to_string(unit) + " out of range [0, " +
                            std::to_string(num_units()) + ")");
  }
  return static_cast<int64_t>(entries_[unit].size());
}

EntryState& Ledger::at(int64_t unit, int64_t entry, const char* op) {
  if (unit < 0 || unit >= num_units() || entry < 0 ||
      entry >= static_cast<int64_t>(entries_[unit].size())) {
    throw std::out_of_range(std::string("Ledger.") + op + ": no entry (" + std::to_string(unit) +
                            ", " + std::to_string(entry) + ")");
  }
  return entries_[unit][entry];
}

void Ledger::illegal(int64_t unit, int64_t entry, const char* op, const EntryState& s) const {
  throw LedgerError(std::string("megatrain gradient ledger: illegal transition ") + op +
                    " of unit " + std::to_string(unit) + " entry " + std::to_string(entry) +
                    " (gradient " + grad_place_name(s.place) + ", " +
                    std::to_string(s.in_flight) + " in flight, update " +
                    update_state_name(s.update) + ")");
}

namespace {
// A finished update belongs to a window that is over: the next gradient (or reset) starts afresh.
void forget_done(EntryState& s) {
  if (s.update == UpdateState::kDone) s.update = UpdateState::kNone;
}
}  // namespace

std::vector<EntryState> Ledger::states(int64_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (unit < 0 || unit >= num_units()) {
    throw std::out_of_range("Ledger.states: unit " + std::to_string(unit) + " out of range [0, " +
                            std::to_string(num_units()) + ")");
  }
  return entries_[unit];
}

EntryState Ledger::get(int64_t unit, int64_t entry) const {
  std::lock_guard<std::mutex> lock(mu_);
  return const_cast<Ledger*>(this)->at(unit, entry, "get");
}

bool Ledger::begin_d2h(int64_t unit, int64_t entry, bool direct) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "begin_d2h");
  const bool overwrite = s.place == GradPlace::kNone;
  if (direct) {
    if (s.place != GradPlace::kNone) illegal(unit, entry, "begin_d2h(direct)", s);
    s.place = GradPlace::kInFlightDirect;
  } else {
    if (s.place != GradPlace::kNone && s.place != GradPlace::kAccumulated &&
        s.place != GradPlace::kInFlightStaging) {
      illegal(unit, entry, "begin_d2h(staged)", s);
    }
    s.place = GradPlace::kInFlightStaging;
  }
  s.in_flight += 1;
  s.micro_batches += 1;
  forget_done(s);
  return overwrite;
}

void Ledger::on_device(int64_t unit, int64_t entry) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "on_device");
  if (s.place != GradPlace::kNone && s.place != GradPlace::kOnDevice) illegal(unit, entry, "on_device", s);
  s.place = GradPlace::kOnDevice;
  s.micro_batches += 1;
  forget_done(s);
}

void Ledger::mark_eager(int64_t unit, int64_t entry) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "mark_eager");
  if (s.micro_batches == 0) illegal(unit, entry, "mark_eager", s);
  s.eager = true;
}

namespace {
void set_norm(EntryState& s, double grad_sq) {
  s.grad_sq = grad_sq;
  s.norm_known = true;
  s.finite = std::isfinite(grad_sq);
}
}  // namespace

void Ledger::landed_direct(int64_t unit, int64_t entry, double grad_sq, bool norm_known) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "landed_direct");
  if (s.place != GradPlace::kInFlightDirect) illegal(unit, entry, "landed_direct", s);
  s.place = GradPlace::kDirect;
  s.in_flight = 0;
  if (norm_known) set_norm(s, grad_sq);
}

void Ledger::accumulated(int64_t unit, int64_t entry, double grad_sq) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "accumulated");
  if (s.place != GradPlace::kInFlightStaging || s.in_flight < 1) illegal(unit, entry, "accumulated", s);
  s.in_flight -= 1;
  if (s.in_flight == 0) s.place = GradPlace::kAccumulated;
  set_norm(s, grad_sq);
}

void Ledger::moved_to_accumulator(int64_t unit, int64_t entry, double grad_sq) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "moved_to_accumulator");
  if (s.place != GradPlace::kDirect) illegal(unit, entry, "moved_to_accumulator", s);
  s.place = GradPlace::kAccumulated;
  set_norm(s, grad_sq);
}

void Ledger::record_norm(int64_t unit, int64_t entry, double grad_sq) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "record_norm");
  if (s.place != GradPlace::kOnDevice && s.place != GradPlace::kDirect) illegal(unit, entry, "record_norm", s);
  set_norm(s, grad_sq);
}

void Ledger::reset(int64_t unit, int64_t entry) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, "reset");
  if (s.place == GradPlace::kInFlightStaging || s.place == GradPlace::kInFlightDirect) {
    illegal(unit, entry, "reset", s);
  }
  const UpdateState update = s.update;
  s = EntryState{};
  s.update = update;
  forget_done(s);
}

void Ledger::move_update(int64_t unit, int64_t entry, const char* op, UpdateState from_a, UpdateState from_b,
                         UpdateState to) {
  std::lock_guard<std::mutex> lock(mu_);
  EntryState& s = at(unit, entry, op);
  if (s.update != from_a && s.update != from_b) illegal(unit, entry, op, s);
  s.update = to;
}

void Ledger::queue_update(int64_t unit, int64_t entry) {
  move_update(unit, entry, "queue_update", UpdateState::kNone, UpdateState::kDone, UpdateState::kQueued);
}

void Ledger::cancel_update(int64_t unit, int64_t entry) {
  move_update(unit, entry, "cancel_update", UpdateState::kQueued, UpdateState::kQueued, UpdateState::kNone);
}

void Ledger::start_update(int64_t unit, int64_t entry) {
  move_update(unit, entry, "start_update", UpdateState::kQueued, UpdateState::kQueued, UpdateState::kRunning);
}

void Ledger::finish_update(int64_t unit, int64_t entry) {
  move_update(unit, entry, "finish_update", UpdateState::kRunning, UpdateState::kRunning, UpdateState::kDone);
}

bool Ledger::any_in_compute(int64_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const EntryState& s : entries_.at(unit)) {
    if ((s.place == GradPlace::kInFlightDirect || s.place == GradPlace::kDirect) && s.update == UpdateState::kNone) {
      return true;
    }
  }
  return false;
}

bool Ledger::update_pending(int64_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const EntryState& s : entries_.at(unit)) {
    if (s.update == UpdateState::kQueued || s.update == UpdateState::kRunning) return true;
  }
  return false;
}

bool Ledger::finite(int64_t unit, const std::vector<int64_t>& entries) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& row = entries_.at(unit);
  for (int64_t i : entries) {
    const EntryState& s = row.at(static_cast<size_t>(i));
    if (s.norm_known && !s.finite) return false;
  }
  return true;
}

std::vector<double> Ledger::grad_sq(int64_t unit) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<double> out;
  for (const EntryState& s : entries_.at(unit)) out.push_back(s.norm_known ? s.grad_sq : 0.0);
  return out;
}

}  // namespace scheduler
}  // namespace megatrain
