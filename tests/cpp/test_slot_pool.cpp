// The device slot pool's state machine: every transition (load, acquire, release, forget, drop),
// which copy engine calls each makes (the events a CUDA engine records and waits for), reuse
// order, and every illegal call refused without changing the slot. CPU only: a recording copy
// engine stands in for the CUDA streams; HostCopyEngine does the real copies.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "megatrain/scheduler/slot_pool.h"
#include "megatrain/scheduler/streams.h"

namespace sch = megatrain::scheduler;

namespace {

// Logs every call as a string ("load 1 wait_free=1 sync=0", "wait_ready 1 stream=0x..", ...).
struct Log {
  std::vector<std::string> calls;
  bool fail_next_load = false;
  bool ready = true;
};

class RecordingEngine : public sch::CopyEngine {
 public:
  explicit RecordingEngine(Log* log) : log_(log) {}
  void add_slot(int slot) override { log_->calls.push_back("add " + std::to_string(slot)); }
  void load(int slot, void*, const void*, int64_t bytes, bool wait_free, const sch::LoadOptions& o) override {
    if (log_->fail_next_load) {
      log_->fail_next_load = false;
      throw std::runtime_error("copy failed");
    }
    log_->calls.push_back("load " + std::to_string(slot) + " bytes=" + std::to_string(bytes) +
                          " wait_free=" + std::to_string(wait_free) + " sync=" + std::to_string(o.sync));
  }
  void wait_ready(int slot, void* stream) override {
    log_->calls.push_back("wait_ready " + std::to_string(slot) + " stream=" + std::to_string(reinterpret_cast<uintptr_t>(stream)));
  }
  void record_free(int slot, void* stream) override {
    log_->calls.push_back("record_free " + std::to_string(slot) + " stream=" + std::to_string(reinterpret_cast<uintptr_t>(stream)));
  }
  bool ready(int) override { return log_->ready; }

 private:
  Log* log_;
};

void* const kStream = reinterpret_cast<void*>(uintptr_t{0x50});

struct Fixture {
  Log log;
  std::vector<char> buffers = std::vector<char>(4 * 64);
  std::unique_ptr<sch::SlotPool> pool = std::make_unique<sch::SlotPool>(std::make_unique<RecordingEngine>(&log));
  char src[64] = {};

  // `n` slots of template 7 (64 bytes each), then `m` of template 9.
  void add(int n, int m = 0) {
    for (int i = 0; i < n + m; ++i) pool->add_slot(i < n ? 7 : 9, buffers.data() + 64 * i, 64);
    log.calls.clear();
  }
  std::string last() const { return log.calls.empty() ? "" : log.calls.back(); }
};

}  // namespace

TEST(SlotPool, NewSlotsAreEmptyAndTheEngineGetsOneAddPerSlot) {
  Fixture f;
  EXPECT_EQ(f.pool->add_slot(7, f.buffers.data(), 64), 0);
  EXPECT_EQ(f.pool->add_slot(7, f.buffers.data() + 64, 64), 1);
  EXPECT_EQ(f.log.calls, (std::vector<std::string>{"add 0", "add 1"}));
  EXPECT_EQ(f.pool->num_slots(), 2);
  const sch::SlotState s = f.pool->state(1);
  EXPECT_EQ(s.template_id, 7);
  EXPECT_EQ(s.unit, -1);
  EXPECT_EQ(s.version, -1);
  EXPECT_EQ(s.in_use, 0);
  EXPECT_FALSE(s.free_recorded);
  EXPECT_EQ(f.pool->find(7, 0, 0), -1);
  EXPECT_EQ(f.pool->pick(7), 0);
  EXPECT_EQ(f.pool->pick(9), -1);  // no slot of that template
}

TEST(SlotPool, AddSlotRefusesANullOrEmptyBuffer) {
  Fixture f;
  EXPECT_THROW(f.pool->add_slot(7, nullptr, 64), std::invalid_argument);
  EXPECT_THROW(f.pool->add_slot(7, f.buffers.data(), 0), std::invalid_argument);
  EXPECT_EQ(f.pool->num_slots(), 0);
  EXPECT_THROW(sch::SlotPool(nullptr), std::invalid_argument);
}

TEST(SlotPool, FirstLoadDoesNotWaitForAFreeEventAndTheSlotHoldsTheUnitAtItsVersion) {
  Fixture f;
  f.add(2);
  f.pool->load(0, /*unit=*/3, /*version=*/5, f.src, 48);
  EXPECT_EQ(f.last(), "load 0 bytes=48 wait_free=0 sync=0");
  EXPECT_EQ(f.pool->find(7, 3, 5), 0);
  EXPECT_EQ(f.pool->find(7, 3, 4), -1);  // another version: stale or not loaded
  EXPECT_EQ(f.pool->find(7, 2, 5), -1);
  EXPECT_EQ(f.pool->find(9, 3, 5), -1);
  EXPECT_EQ(f.pool->state(0).last_use, 1);
  EXPECT_EQ(f.pool->clock(), 1);
  EXPECT_EQ(f.pool->state(0).in_use, 0);  // loaded (a prefetch) but not in use yet
}

TEST(SlotPool, SyncIsPassedToTheEngine) {
  Fixture f;
  f.add(1);
  sch::LoadOptions o;
  o.sync = true;
  f.pool->load(0, 1, 0, f.src, 64, o);
  EXPECT_EQ(f.last(), "load 0 bytes=64 wait_free=0 sync=1");
}

TEST(SlotPool, AcquireMakesTheComputeStreamWaitForWeightsReadyAndCountsTheUse) {
  Fixture f;
  f.add(2);
  f.pool->load(1, 3, 0, f.src, 64);
  f.pool->acquire(1, kStream);
  EXPECT_EQ(f.last(), "wait_ready 1 stream=80");
  EXPECT_EQ(f.pool->state(1).in_use, 1);
  EXPECT_EQ(f.pool->state(1).last_use, 2);
  f.pool->acquire(1, kStream);  // nested use (a layer called twice)
  EXPECT_EQ(f.pool->state(1).in_use, 2);
  EXPECT_EQ(f.pool->pick(7), 0);  // an in-use slot is never overwritten
}

TEST(SlotPool, AcquireOfAnEmptySlotIsRefused) {
  Fixture f;
  f.add(1);
  EXPECT_THROW(f.pool->acquire(0, kStream), std::logic_error);
  EXPECT_EQ(f.pool->state(0).in_use, 0);
  EXPECT_TRUE(f.log.calls.empty());
}

TEST(SlotPool, OnlyTheLastReleaseRecordsBufferFreeAndTheNextLoadWaitsForIt) {
  Fixture f;
  f.add(1);
  f.pool->load(0, 3, 0, f.src, 64);
  f.pool->acquire(0, kStream);
  f.pool->acquire(0, kStream);
  f.log.calls.clear();
  EXPECT_EQ(f.pool->release(0, kStream), 1);
  EXPECT_TRUE(f.log.calls.empty());  // still in use: nothing recorded
  EXPECT_FALSE(f.pool->state(0).free_recorded);
  EXPECT_EQ(f.pool->release(0, kStream), 0);
  EXPECT_EQ(f.last(), "record_free 0 stream=80");
  EXPECT_TRUE(f.pool->state(0).free_recorded);
  EXPECT_EQ(f.pool->find(7, 3, 0), 0);  // released, still holds the unit: a later acquire hits
  f.pool->load(0, 4, 0, f.src, 64);
  EXPECT_EQ(f.last(), "load 0 bytes=64 wait_free=1 sync=0");
  EXPECT_EQ(f.pool->find(7, 3, 0), -1);
  EXPECT_EQ(f.pool->find(7, 4, 0), 0);
}

TEST(SlotPool, ReleaseWithForgetEmptiesTheSlot) {
  Fixture f;
  f.add(1);
  f.pool->load(0, 3, 2, f.src, 64);
  f.pool->acquire(0, kStream);
  f.pool->acquire(0, kStream);
  EXPECT_EQ(f.pool->release(0, kStream, /*forget=*/true), 1);
  EXPECT_EQ(f.pool->find(7, 3, 2), 0);  // forget applies when the last use ends
  EXPECT_EQ(f.pool->release(0, kStream, /*forget=*/true), 0);
  EXPECT_EQ(f.pool->find(7, 3, 2), -1);
  EXPECT_EQ(f.pool->state(0).unit, -1);
  EXPECT_TRUE(f.pool->state(0).free_recorded);  // the buffer_free is recorded either way
}

TEST(SlotPool, ReleaseOfASlotNotInUseIsRefused) {
  Fixture f;
  f.add(1);
  EXPECT_THROW(f.pool->release(0, kStream), std::logic_error);
  f.pool->load(0, 3, 0, f.src, 64);
  EXPECT_THROW(f.pool->release(0, kStream), std::logic_error);
  EXPECT_EQ(f.pool->state(0).in_use, 0);
  EXPECT_FALSE(f.pool->state(0).free_recorded);
}

TEST(SlotPool, PickTakesTheLeastRecentlyUsedFreeSlotAndSparesProtectedOnes) {
  Fixture f;
  f.add(3);
  EXPECT_EQ(f.pool->pick(7), 0);  // all unused: the first added
  f.pool->load(0, 10, 0, f.src, 64);  // clock 1
  f.pool->load(1, 11, 0, f.src, 64);  // clock 2
  f.pool->load(2, 12, 0, f.src, 64);  // clock 3
  EXPECT_EQ(f.pool->pick(7), 0);
  f.pool->acquire(0, kStream);  // clock 4: slot 0 now the most recent (and in use)
  f.pool->release(0, kStream);
  EXPECT_EQ(f.pool->pick(7), 1);
  EXPECT_EQ(f.pool->pick(7, {1}), 2);
  EXPECT_EQ(f.pool->pick(7, {1, 2}), 0);
  EXPECT_EQ(f.pool->pick(7, {0, 1, 2}), -1);
  f.pool->acquire(1, kStream);
  f.pool->acquire(2, kStream);
  f.pool->acquire(0, kStream);
  EXPECT_EQ(f.pool->pick(7), -1);  // all in use
}

TEST(SlotPool, TemplatesHaveTheirOwnSlots) {
  Fixture f;
  f.add(1, 1);
  f.pool->load(0, 3, 0, f.src, 64);
  f.pool->acquire(0, kStream);
  EXPECT_EQ(f.pool->pick(7), -1);
  EXPECT_EQ(f.pool->pick(9), 1);
  f.pool->load(1, 3, 0, f.src, 64);  // same unit id in another template's slot: found only there
  EXPECT_EQ(f.pool->find(9, 3, 0), 1);
  EXPECT_EQ(f.pool->find(7, 3, 0), 0);
}

TEST(SlotPool, LoadIntoASlotInUseIsRefusedWithoutChangingIt) {
  Fixture f;
  f.add(1);
  f.pool->load(0, 3, 0, f.src, 64);
  f.pool->acquire(0, kStream);
  f.log.calls.clear();
  EXPECT_THROW(f.pool->load(0, 4, 0, f.src, 64), std::logic_error);
  EXPECT_TRUE(f.log.calls.empty());
  EXPECT_EQ(f.pool->find(7, 3, 0), 0);
  EXPECT_EQ(f.pool->state(0).in_use, 1);
  EXPECT_EQ(f.pool->clock(), 2);
}

TEST(SlotPool, LoadOfMoreBytesThanTheSlotOrFromNullIsRefused) {
  Fixture f;
  f.add(1);
  EXPECT_THROW(f.pool->load(0, 3, 0, f.src, 65), std::invalid_argument);
  EXPECT_THROW(f.pool->load(0, 3, 0, nullptr, 64), std::invalid_argument);
  EXPECT_THROW(f.pool->load(0, 3, 0, f.src, 0), std::invalid_argument);
  EXPECT_THROW(f.pool->load(1, 3, 0, f.src, 64), std::out_of_range);
  EXPECT_TRUE(f.log.calls.empty());
  EXPECT_EQ(f.pool->state(0).unit, -1);
}

TEST(SlotPool, AFailedCopyLeavesTheSlotEmpty) {
  Fixture f;
  f.add(1);
  f.pool->load(0, 3, 0, f.src, 64);
  f.log.fail_next_load = true;
  EXPECT_THROW(f.pool->load(0, 4, 0, f.src, 64), std::runtime_error);
  EXPECT_EQ(f.pool->find(7, 3, 0), -1);  // the old contents may be partly overwritten
  EXPECT_EQ(f.pool->find(7, 4, 0), -1);
  EXPECT_EQ(f.pool->state(0).unit, -1);
  EXPECT_EQ(f.pool->clock(), 1);
  EXPECT_EQ(f.pool->pick(7), 0);
}

TEST(SlotPool, DroppedTemplatesAreNeverUsedAgain) {
  Fixture f;
  f.add(2, 1);
  f.pool->load(0, 3, 0, f.src, 64);
  f.pool->acquire(0, kStream);
  EXPECT_THROW(f.pool->drop_template(7), std::logic_error);  // slot 0 is in use
  EXPECT_FALSE(f.pool->state(1).dropped);
  f.pool->release(0, kStream);
  f.pool->drop_template(7);
  EXPECT_TRUE(f.pool->state(0).dropped);
  EXPECT_TRUE(f.pool->state(1).dropped);
  EXPECT_EQ(f.pool->find(7, 3, 0), -1);
  EXPECT_EQ(f.pool->pick(7), -1);
  EXPECT_THROW(f.pool->load(0, 3, 0, f.src, 64), std::logic_error);
  EXPECT_THROW(f.pool->acquire(0, kStream), std::logic_error);
  EXPECT_EQ(f.pool->pick(9), 2);  // the other template is untouched
}

TEST(SlotPool, ReadyAsksTheEngine) {
  Fixture f;
  f.add(1);
  EXPECT_TRUE(f.pool->ready(0));
  f.log.ready = false;
  EXPECT_FALSE(f.pool->ready(0));
  EXPECT_THROW(f.pool->ready(1), std::out_of_range);
}

TEST(HostCopyEngine, LoadCopiesTheBytesAfterBeforeCopyRan) {
  std::vector<unsigned char> dst(32, 0), src(32);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<unsigned char>(i + 1);
  sch::SlotPool pool(std::make_unique<sch::HostCopyEngine>());
  pool.add_slot(0, dst.data(), 32);
  sch::LoadOptions o;
  bool copied_before = true;
  o.before_copy = [&] { copied_before = dst[0] != 0; };
  pool.load(0, 1, 0, src.data(), 24, o);
  EXPECT_FALSE(copied_before);
  EXPECT_EQ(std::memcmp(dst.data(), src.data(), 24), 0);
  EXPECT_EQ(dst[24], 0);  // only `bytes` bytes
  pool.acquire(0, nullptr);
  EXPECT_TRUE(pool.ready(0));
  EXPECT_EQ(pool.release(0, nullptr), 0);
  EXPECT_TRUE(pool.state(0).free_recorded);
}

TEST(HostCopyEngine, ANullZeroByteLoadIsFilledByBeforeCopyAndOnlyWithIt) {
  // A master-streamed unit: the caller's before_copy fills the slot (its fp32 master cast on the device).
  std::vector<unsigned char> dst(32, 0);
  sch::SlotPool pool(std::make_unique<sch::HostCopyEngine>());
  pool.add_slot(0, dst.data(), 32);
  EXPECT_THROW(pool.load(0, 1, 0, nullptr, 0), std::invalid_argument);  // no filler: refused
  EXPECT_EQ(pool.state(0).unit, -1);
  sch::LoadOptions o;
  o.before_copy = [&] { std::fill(dst.begin(), dst.end(), 7); };
  pool.load(0, 1, 3, nullptr, 0, o);
  EXPECT_EQ(dst[31], 7);
  EXPECT_EQ(pool.find(0, 1, 3), 0);
}

TEST(Streams, WithoutCudaEveryEntryPointSaysSo) {
  if (sch::streams_have_cuda()) GTEST_SKIP() << "built with CUDA";
  EXPECT_THROW(sch::CudaEvent(false, -1), std::runtime_error);
  EXPECT_THROW(sch::CudaCopyEngine(kStream, 0), std::runtime_error);
  EXPECT_THROW(sch::enqueue_copies(kStream, 0, std::nullopt, sch::CopyKind::kDeviceToHost, {}, {}, nullptr),
               std::runtime_error);
  EXPECT_THROW(sch::stream_wait_event(kStream, nullptr, 0), std::runtime_error);
}
