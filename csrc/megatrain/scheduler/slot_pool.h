// The device slot pool: which device slot holds which unit's compute copy at which version, which
// slots the compute stream is using, and which one a load may overwrite (torch-free).
//
// A slot is a device buffer of one layer template (shape signature); a pool holds num_slots of
// them per template. Forward loads layer i+1 into a free slot while layer i computes (backward:
// i-1), so a slot moves through
//
//   empty --load--> holds (unit, version) --acquire--> in use (count > 0) --release--> held, free
//     ^                 |  (weights_ready recorded         (compute stream waits     (buffer_free recorded
//     |                 |   on the H2D stream)              for weights_ready)        on the compute stream)
//     +--release(forget)+  a later load of another unit waits for buffer_free on the H2D stream
//
// A unit's version is the caller's (it bumps it when the host compute copy changes); a slot holding
// an older version is never found again and is overwritten like an empty one. The device side (the
// copy, the events, the waits) is a CopyEngine: CUDA streams and events (streams.h), or
// synchronous host copies (the CPU backend and the tests).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

namespace megatrain {
namespace scheduler {

/// \brief Two CUDA events (cudaEvent_t, created with timing) recorded around a copy, or null.
struct CopyTiming {
  void* start = nullptr;
  void* end = nullptr;
};

/// \brief What a load does besides the copy.
struct LoadOptions {
  /// `src` is temporary (pageable, rebuilt weights): the load returns after the copy completed.
  bool sync = false;
  CopyTiming timing;
  /// Called once the copy stream waits for the slot's buffer_free, before the copy is enqueued
  /// (the race-hunting delay, MEGATRAIN_DEBUG_RACES). Empty: nothing.
  std::function<void()> before_copy;
};

/// \brief The device side of a SlotPool: one H2D copy per load and the two events of each slot.
class CopyEngine {
 public:
  virtual ~CopyEngine() = default;
  /// \brief A new slot (index = number of slots added before it): create its events.
  virtual void add_slot(int slot) = 0;
  /// \brief Copy `bytes` bytes from host `src` to the slot's device buffer `dst`: after the
  /// slot's buffer_free event when `wait_free`, then records the slot's weights_ready.
  virtual void load(int slot, void* dst, const void* src, int64_t bytes, bool wait_free,
                    const LoadOptions& options) = 0;
  /// \brief `compute_stream` (a cudaStream_t, or null on the CPU) waits for the slot's weights_ready.
  virtual void wait_ready(int slot, void* compute_stream) = 0;
  /// \brief Records the slot's buffer_free on `compute_stream`.
  virtual void record_free(int slot, void* compute_stream) = 0;
  /// \brief Non-blocking: whether the slot's last load completed.
  virtual bool ready(int slot) = 0;
};

/// \brief The CPU backend: loads are std::memcpy (complete on return), events are no-ops.
class HostCopyEngine : public CopyEngine {
 public:
  void add_slot(int) override {}
  void load(int slot, void* dst, const void* src, int64_t bytes, bool wait_free,
            const LoadOptions& options) override;
  void wait_ready(int, void*) override {}
  void record_free(int, void*) override {}
  bool ready(int) override { return true; }
};

/// \brief One slot's state (SlotPool::state).
struct SlotState {
  int64_t template_id = 0;
  void* buffer = nullptr;     ///< device buffer (owned by the caller; never dereferenced here)
  int64_t bytes = 0;          ///< its size
  int64_t unit = -1;          ///< unit whose compute copy it holds (-1: none)
  int64_t version = -1;       ///< that unit's version at the load
  int64_t in_use = 0;         ///< acquires not yet released
  int64_t last_use = 0;       ///< pool clock at its last load / acquire (least recently used is overwritten first)
  bool free_recorded = false; ///< a buffer_free was recorded: the next load waits for it
  bool dropped = false;       ///< its template was dropped (drop_template): never used again
};

/// \brief The slot state machine (see the file comment). Thread-safe (one mutex); the
/// CopyEngine calls, LoadOptions::before_copy included, run under it and must not re-enter.
class SlotPool {
 public:
  /// \param[in] engine the device side (HostCopyEngine, CudaCopyEngine); owned.
  /// \throws std::invalid_argument if `engine` is null.
  explicit SlotPool(std::unique_ptr<CopyEngine> engine);
  SlotPool(const SlotPool&) = delete;
  SlotPool& operator=(const SlotPool&) = delete;

  /// \brief Adds an empty slot of `template_id` over the caller's device buffer.
  /// \param[in] buffer device buffer of `bytes` bytes, alive until drop_template or the pool dies.
  /// \return the slot's index (0, 1, ... in the order added).
  /// \throws std::invalid_argument for a null buffer or bytes <= 0.
  int add_slot(int64_t template_id, void* buffer, int64_t bytes);
  /// \brief The slots of `template_id` are never found, picked or loaded again (their buffers may
  /// be freed once nothing in flight reads them).
  /// \throws std::logic_error if one of them is in use.
  void drop_template(int64_t template_id);

  /// \brief The first slot of `template_id` holding `unit` at `version`, or -1.
  int find(int64_t template_id, int64_t unit, int64_t version) const;
  /// \brief The slot a load of `template_id` would overwrite: not in use, not in `protect`, least
  /// recently used (the first of equals in the order added), or -1 when none is free.
  int pick(int64_t template_id, const std::vector<int>& protect = {}) const;
  /// \brief Loads `unit` at `version` into free `slot`: `bytes` bytes from host `src` (the
  /// unit's compute copy). The slot holds it from now on; the copy may still be running (the
  /// compute stream waits for it in acquire).
  /// `src` null and `bytes` 0 with options.before_copy set: the caller fills the slot itself from
  /// before_copy (run on the copy stream after buffer_free, before weights_ready is recorded: a
  /// master-streamed unit's fp32 master copied and cast on the device).
  /// \pre `src` stays valid until the copy completed (always, when options.sync).
  /// \throws std::logic_error if the slot is in use or dropped; std::invalid_argument if `bytes`
  ///         exceeds the slot's buffer or `src` is null (outside the case above); what the engine
  ///         throws (then the slot is empty).
  void load(int slot, int64_t unit, int64_t version, const void* src, int64_t bytes,
            const LoadOptions& options = {});
  /// \brief The compute stream's use of `slot` begins: it waits for the slot's weights_ready.
  /// \throws std::logic_error if the slot holds nothing or was dropped.
  void acquire(int slot, void* compute_stream);
  /// \brief One use of `slot` ended. The last one records buffer_free on `compute_stream`;
  /// `forget`: the slot then holds nothing (its contents were poisoned).
  /// \return the uses left.
  /// \throws std::logic_error if the slot is not in use.
  int64_t release(int slot, void* compute_stream, bool forget = false);
  /// \brief Whether the slot's last load completed (event query).
  bool ready(int slot);

  /// \brief A copy of the slot's state. \throws std::out_of_range for a bad index.
  SlotState state(int slot) const;
  int num_slots() const;
  /// \brief Loads and acquires so far (each advances it by one).
  int64_t clock() const;

 private:
  SlotState& at(int slot);  // mu_ held
  const SlotState& at(int slot) const;

  mutable std::mutex mu_;
  std::unique_ptr<CopyEngine> engine_;
  std::vector<SlotState> slots_;
  int64_t clock_ = 0;
};

}  // namespace scheduler
}  // namespace megatrain
