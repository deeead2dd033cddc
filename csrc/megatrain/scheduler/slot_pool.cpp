#include "megatrain/scheduler/slot_pool.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

namespace megatrain {
namespace scheduler {

void HostCopyEngine::load(int, void* dst, const void* src, int64_t bytes, bool, const LoadOptions& options) {
  if (options.before_copy) options.before_copy();
  if (bytes > 0) std::memcpy(dst, src, static_cast<size_t>(bytes));
}

SlotPool::SlotPool(std::unique_ptr<CopyEngine> engine) : engine_(std::move(engine)) {
  if (!engine_) throw std::invalid_argument("SlotPool: the copy engine must not be null");
}

SlotState& SlotPool::at(int slot) {
  if (slot < 0 || slot >= static_cast<int>(slots_.size())) {
    throw std::out_of_range("SlotPool: slot " + std::to_string(slot) + " out of range [0, " +
                            std::to_string(slots_.size()) + ")");
  }
  return slots_[static_cast<size_t>(slot)];
}

const SlotState& SlotPool::at(int slot) const { return const_cast<SlotPool*>(this)->at(slot); }

int SlotPool::add_slot(int64_t template_id, void* buffer, int64_t bytes) {
  if (buffer == nullptr || bytes <= 0) {
    throw std::invalid_argument("SlotPool.add_slot: needs a device buffer of > 0 bytes, got " +
                                std::to_string(bytes) + " bytes" + (buffer ? "" : " at a null address"));
  }
  std::lock_guard<std::mutex> lock(mu_);
  const int index = static_cast<int>(slots_.size());
  engine_->add_slot(index);
  SlotState s;
  s.template_id = template_id;
  s.buffer = buffer;
  s.bytes = bytes;
  slots_.push_back(s);
  return index;
}

void SlotPool::drop_template(int64_t template_id) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const SlotState& s = slots_[i];
    if (s.template_id == template_id && !s.dropped && s.in_use > 0) {
      throw std::logic_error("SlotPool.drop_template: slot " + std::to_string(i) + " of template " +
                             std::to_string(template_id) + " is in use");
    }
  }
  for (SlotState& s : slots_) {
    if (s.template_id != template_id) continue;
    s.dropped = true;
    s.unit = -1;
    s.version = -1;
  }
}

int SlotPool::find(int64_t template_id, int64_t unit, int64_t version) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < slots_.size(); ++i) {
    const SlotState& s = slots_[i];
    if (!s.dropped && s.template_id == template_id && s.unit == unit && s.version == version) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

int SlotPool::pick(int64_t template_id, const std::vector<int>& protect) const {
  std::lock_guard<std::mutex> lock(mu_);
  int best = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const SlotState& s = slots_[i];
    if (s.dropped || s.template_id != template_id || s.in_use != 0) continue;
    if (std::find(protect.begin(), protect.end(), static_cast<int>(i)) != protect.end()) continue;
    if (best < 0 || s.last_use < slots_[static_cast<size_t>(best)].last_use) best = static_cast<int>(i);
  }
  return best;
}

void SlotPool::load(int slot, int64_t unit, int64_t version, const void* src, int64_t bytes,
                    const LoadOptions& options) {
  std::lock_guard<std::mutex> lock(mu_);
  SlotState& s = at(slot);
  if (s.dropped) throw std::logic_error("SlotPool.load: slot " + std::to_string(slot) + " was dropped");
  if (s.in_use != 0) {
    throw std::logic_error("SlotPool.load: slot " + std::to_string(slot) + " is in use (" +
                           std::to_string(s.in_use) + " acquires not released)");
  }
  // src null with 0 bytes: the caller's before_copy fills the slot (on the copy stream, after buffer_free).
  const bool filled_by_caller = src == nullptr && bytes == 0 && static_cast<bool>(options.before_copy);
  if (!filled_by_caller && (src == nullptr || bytes <= 0 || bytes > s.bytes)) {
    throw std::invalid_argument("SlotPool.load: " + std::to_string(bytes) + " bytes into slot " +
                                std::to_string(slot) + " of " + std::to_string(s.bytes) + " bytes" +
                                (src ? "" : " from a null address"));
  }
  s.unit = -1;  // overwritten from here on: holds nothing until the copy is enqueued
  s.version = -1;
  engine_->load(slot, s.buffer, src, bytes, s.free_recorded, options);
  s.unit = unit;
  s.version = version;
  s.last_use = ++clock_;
}

void SlotPool::acquire(int slot, void* compute_stream) {
  std::lock_guard<std::mutex> lock(mu_);
  SlotState& s = at(slot);
  if (s.dropped || s.unit < 0) {
    throw std::logic_error("SlotPool.acquire: slot " + std::to_string(slot) + " holds no unit");
  }
  engine_->wait_ready(slot, compute_stream);
  s.in_use += 1;
  s.last_use = ++clock_;
}

int64_t SlotPool::release(int slot, void* compute_stream, bool forget) {
  std::lock_guard<std::mutex> lock(mu_);
  SlotState& s = at(slot);
  if (s.in_use <= 0) {
    throw std::logic_error("SlotPool.release: slot " + std::to_string(slot) + " is not in use");
  }
  s.in_use -= 1;
  if (s.in_use == 0) {
    if (forget) {
      s.unit = -1;
      s.version = -1;
    }
    engine_->record_free(slot, compute_stream);
    s.free_recorded = true;
  }
  return s.in_use;
}

bool SlotPool::ready(int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  at(slot);
  return engine_->ready(slot);
}

SlotState SlotPool::state(int slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  return at(slot);
}

int SlotPool::num_slots() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(slots_.size());
}

int64_t SlotPool::clock() const {
  std::lock_guard<std::mutex> lock(mu_);
  return clock_;
}

}  // namespace scheduler
}  // namespace megatrain
