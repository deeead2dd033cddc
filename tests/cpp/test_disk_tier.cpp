#include <gtest/gtest.h>

#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "temp_dir.h"
#include "megatrain/disk_tier/disk_tier.h"
#include "megatrain/host_store/host_store.h"

namespace dt = megatrain::disk_tier;
namespace fs = std::filesystem;

namespace {

struct TempDir : megatrain_test::TempDir {
  TempDir() : megatrain_test::TempDir("megatrain_disk_tier") {}
};

std::vector<dt::UnitLayout> mixed_units() {
  // Section sizes not multiples of 4 KiB, a unit without sections, a unit spanning many chunks.
  return {
      {{100, 5000, 4096, 1}},
      {{3 * 8192 + 12}},
      {{}},
      {{0, 7}},
      {{(1 << 20) + 20, 333, 4095}},
  };
}

std::vector<std::vector<unsigned char>> random_state(const dt::UnitLayout& u, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<std::vector<unsigned char>> out;
  for (int64_t b : u.section_bytes) {
    std::vector<unsigned char> s(static_cast<size_t>(b));
    for (auto& c : s) c = static_cast<unsigned char>(rng());
    out.push_back(std::move(s));
  }
  return out;
}

void store(const std::vector<void*>& ptrs, const std::vector<std::vector<unsigned char>>& data) {
  ASSERT_EQ(ptrs.size(), data.size());
  for (size_t s = 0; s < ptrs.size(); ++s) std::memcpy(ptrs[s], data[s].data(), data[s].size());
}

void expect_equal(const std::vector<void*>& ptrs, const std::vector<std::vector<unsigned char>>& data,
                  const std::string& what) {
  ASSERT_EQ(ptrs.size(), data.size()) << what;
  for (size_t s = 0; s < ptrs.size(); ++s) {
    EXPECT_EQ(std::memcmp(ptrs[s], data[s].data(), data[s].size()), 0) << what << " section " << s;
  }
}

bool all_zero(const void* p, int64_t bytes) {
  const unsigned char* c = static_cast<const unsigned char*>(p);
  for (int64_t i = 0; i < bytes; ++i) {
    if (c[i] != 0) return false;
  }
  return true;
}

bool wait_for_state(const dt::DiskTier& tier, int64_t u, const std::string& state) {
  for (int i = 0; i < 2000 && tier.unit_state(u) != state; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return tier.unit_state(u) == state;
}

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(DiskTier, FileBytesRoundEachSectionTo4KiBPlusAHeaderPage) {
  EXPECT_EQ(dt::DiskTier::file_bytes({{100, 4096, 0, 4097}}), 4096 + 4096 + 4096 + 0 + 8192);
  EXPECT_EQ(dt::DiskTier::file_bytes({{}}), 4096);
  EXPECT_EQ(dt::DiskTier::bytes_required(mixed_units()),
            (4096 + 4096 + 8192 + 4096 + 4096) + (4096 + 28672) + 4096 + (4096 + 0 + 4096) +
                (4096 + 1052672 + 4096 + 4096));
  EXPECT_EQ(dt::DiskTier::pool_bytes(mixed_units(), 3), 3 * (4096 + 1052672 + 4096 + 4096));
}

TEST(DiskTier, StateLayoutsOfAHostStoreLayoutAreItsFp32Sections) {
  namespace hs = megatrain::host_store;
  const std::vector<hs::UnitSpec> units = {{{"w", {33, 17}}, {"b", {33}}}, {{"e", {101, 3}}}};
  hs::HostStoreOptions o;
  o.with_grad_accum = true;
  const hs::StoreLayout layout = hs::HostStore::layout_required(units, o);
  const auto all = dt::state_layouts(layout, true);
  ASSERT_EQ(all.size(), 2u);
  hs::HostStore store(units, o);
  for (int64_t u = 0; u < 2; ++u) {
    ASSERT_EQ(all[u].section_bytes.size(), 4u);
    for (int64_t b : all[u].section_bytes) EXPECT_EQ(b, store.unit_state_numel(u) * 4);
    // Rounded to 4 KiB, each section is exactly the store's section of that unit.
    EXPECT_EQ(dt::DiskTier::file_bytes(all[u]) - 4096,
              store.unit_section_bytes(u, hs::Section::kMaster) + store.unit_section_bytes(u, hs::Section::kExpAvg) +
                  store.unit_section_bytes(u, hs::Section::kExpAvgSq) +
                  store.unit_section_bytes(u, hs::Section::kGradAccum));
  }
  const auto one = dt::state_layouts(layout, false, {1});
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].section_bytes, std::vector<int64_t>(3, store.unit_state_numel(1) * 4));
  EXPECT_THROW(dt::state_layouts(layout, false, {2}), std::out_of_range);
}

TEST(DiskTier, RoundTripIsBitExactForUnitsOfDifferentSizes) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 2;
  o.io_threads = 3;
  o.chunk_bytes = 3 * 4096;  // the 1 MiB unit moves in many chunks across the threads
  const auto units = mixed_units();
  dt::DiskTier tier(d.str(), units, o);
  std::vector<std::vector<std::vector<unsigned char>>> expected;
  for (int64_t u = 0; u < tier.num_units(); ++u) {
    EXPECT_EQ(tier.unit_state(u), "empty");
    auto ptrs = tier.acquire(u);
    for (size_t s = 0; s < ptrs.size(); ++s) {
      EXPECT_EQ(reinterpret_cast<uintptr_t>(ptrs[s]) % 4096, 0u);
      EXPECT_TRUE(all_zero(ptrs[s], units[u].section_bytes[s])) << "never-written unit " << u;
    }
    expected.push_back(random_state(units[u], 1000 + static_cast<uint32_t>(u)));
    store(ptrs, expected.back());
    tier.release(u, /*dirty=*/true);
  }
  tier.flush();
  tier.drop_cached();
  for (int64_t u = 0; u < tier.num_units(); ++u) {
    EXPECT_EQ(tier.unit_state(u), "on_disk");
    EXPECT_EQ(static_cast<int64_t>(fs::file_size(tier.unit_path(u))), dt::DiskTier::file_bytes(units[u]));
  }
  for (int64_t u = tier.num_units() - 1; u >= 0; --u) {
    auto ptrs = tier.acquire(u);
    expect_equal(ptrs, expected[u], "unit " + std::to_string(u));
    tier.release(u, /*dirty=*/false);
  }
  const auto st = tier.stats();
  EXPECT_EQ(st.unit_writes, tier.num_units());
  EXPECT_EQ(st.unit_reads, tier.num_units());
  EXPECT_EQ(st.bytes_read, dt::DiskTier::bytes_required(units));
  EXPECT_EQ(st.bytes_written, dt::DiskTier::bytes_required(units));
  EXPECT_EQ(st.zero_fills, tier.num_units());
  std::printf("[ info     ] %s: direct_io=%d %s\n", d.str().c_str(), tier.direct_io() ? 1 : 0,
              tier.direct_io_note().c_str());
}

TEST(DiskTier, BufferedIoWhenODirectIsOffRoundTripsAndSaysWhy) {
  TempDir d;
  dt::DiskTierOptions o;
  o.direct_io = false;
  dt::DiskTier tier(d.str(), {{{5000, 12}}}, o);
  EXPECT_FALSE(tier.direct_io());
  EXPECT_NE(tier.direct_io_note().find("not requested"), std::string::npos);
  const auto data = random_state(tier.layout(0), 7);
  store(tier.acquire(0), data);
  tier.release(0, true);
  tier.flush();
  tier.drop_cached();
  expect_equal(tier.acquire(0), data, "buffered");
  tier.release(0, false);
  EXPECT_EQ(tier.stats().unit_reads, 1);
}

TEST(DiskTier, PrefetchThenAcquireSeesTheLastReleasedData) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 2;
  dt::DiskTier tier(d.str(), {{{20000}}, {{30000}}, {{40000}}}, o);
  std::vector<std::vector<std::vector<unsigned char>>> v(3);
  for (int64_t u = 0; u < 3; ++u) {
    v[u] = random_state(tier.layout(u), 10 + static_cast<uint32_t>(u));
    store(tier.acquire(u), v[u]);
    tier.release(u, true);
  }
  tier.flush();
  tier.drop_cached();
  tier.prefetch(1);
  ASSERT_TRUE(wait_for_state(tier, 1, "cached"));
  EXPECT_EQ(tier.stats().unit_reads, 1);
  auto p = tier.acquire(1);
  expect_equal(p, v[1], "prefetched unit 1");
  EXPECT_EQ(tier.stats().cache_hits, 1);
  EXPECT_EQ(tier.stats().unit_reads, 1);  // the acquire read nothing more
  // A second version, written behind, then evicted by other units, then prefetched again.
  auto v1b = random_state(tier.layout(1), 99);
  store(p, v1b);
  tier.release(1, true);
  // Let the write-behind land: a buffer still being written is not an eviction candidate, so
  // otherwise unit 2 could take unit 0's buffer instead and unit 1 would stay cached.
  // (A read racing a write in flight is AcquireAfterWriteBehindWaitsForTheWriteAndSeesTheNewData.)
  tier.flush();
  for (int64_t u : {0, 2}) {
    auto q = tier.acquire(u);
    expect_equal(q, v[u], "unit " + std::to_string(u));
    tier.release(u, false);
  }
  ASSERT_EQ(tier.unit_state(1), "on_disk");  // its buffer went to units 0 and 2 (LRU)
  tier.prefetch(1);
  expect_equal(tier.acquire(1), v1b, "unit 1 after write-behind, eviction and prefetch");
  tier.release(1, false);
}

TEST(DiskTier, AcquireAfterWriteBehindWaitsForTheWriteAndSeesTheNewData) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 1;
  o.chunk_bytes = 4096;
  std::atomic<int> slow_writes{0};
  o.fault_hook = [&](dt::IoOp op, int64_t unit, int64_t, int64_t) {
    if (op == dt::IoOp::kWrite && unit == 0) {
      ++slow_writes;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return 0;
  };
  dt::DiskTier tier(d.str(), {{{5 * 4096}}, {{4096}}}, o);
  const auto a = random_state(tier.layout(0), 1);
  store(tier.acquire(0), a);
  tier.release(0, true);
  EXPECT_EQ(tier.unit_state(0), "writing");
  auto p = tier.acquire(0);  // waits for the write; same buffer, no read
  EXPECT_EQ(tier.stats().unit_writes, 1);
  EXPECT_EQ(tier.stats().unit_reads, 0);
  expect_equal(p, a, "first version");
  const auto b = random_state(tier.layout(0), 2);
  store(p, b);
  tier.release(0, true);
  tier.acquire(1);  // one buffer: unit 0 must be written and evicted first
  EXPECT_EQ(tier.unit_state(0), "on_disk");
  tier.release(1, false);
  expect_equal(tier.acquire(0), b, "second version, read back from the file");
  tier.release(0, false);
  EXPECT_EQ(tier.stats().unit_reads, 1);
  EXPECT_EQ(slow_writes.load(), 2 * 6);  // two writes of header + 5 pages, one hook call per chunk
}

TEST(DiskTier, PoolExhaustionBlocksUntilAWriteFreesABufferThenProceeds) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 1;
  o.fault_hook = [](dt::IoOp op, int64_t unit, int64_t, int64_t) {
    if (op == dt::IoOp::kWrite && unit == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    return 0;
  };
  dt::DiskTier tier(d.str(), {{{8192}}, {{8192}}}, o);
  const auto a = random_state(tier.layout(0), 3);
  store(tier.acquire(0), a);
  tier.release(0, true);
  std::atomic<bool> got{false};
  std::string state_of_0_after;
  const auto t0 = std::chrono::steady_clock::now();
  std::thread t([&] {
    tier.acquire(1);
    got = true;
    state_of_0_after = tier.unit_state(0);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  EXPECT_FALSE(got.load()) << "acquire(1) returned while the only buffer was still being written";
  t.join();
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_TRUE(got.load());
  EXPECT_GE(waited, 0.25);
  EXPECT_EQ(state_of_0_after, "on_disk");
  EXPECT_GE(tier.stats().acquire_wait_seconds, 0.2);
  tier.release(1, false);
  expect_equal(tier.acquire(0), a, "unit 0 after the blocked acquire");
  tier.release(0, false);
}

TEST(DiskTier, MisuseThrowsInsteadOfDeadlocking) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 2;
  dt::DiskTier tier(d.str(), {{{100}}, {{100}}, {{100}}}, o);
  tier.acquire(0);
  EXPECT_THROW(tier.acquire(0), std::logic_error);
  tier.acquire(1);
  const std::string msg = message_of([&] { tier.acquire(2); });
  EXPECT_NE(msg.find("all 2 buffers are acquired"), std::string::npos) << msg;
  EXPECT_THROW(tier.release(2, false), std::logic_error);
  EXPECT_THROW(tier.acquire(3), std::out_of_range);
  EXPECT_THROW(tier.prefetch(-1), std::out_of_range);
  tier.release(0, false);
  tier.release(1, false);
  tier.acquire(2);  // a buffer is free again
  tier.release(2, false);
  EXPECT_EQ(tier.unit_state(0), "empty");  // clean release of a never-written unit
}

TEST(DiskTier, BadOptionsAreRefusedBeforeAnythingIsCreated) {
  TempDir d;
  const std::string sub = d.str() + "/tier";
  dt::DiskTierOptions o;
  o.num_buffers = 0;
  EXPECT_THROW(dt::DiskTier(sub, {{{100}}}, o), std::invalid_argument);
  o = {};
  o.io_threads = 0;
  EXPECT_THROW(dt::DiskTier(sub, {{{100}}}, o), std::invalid_argument);
  EXPECT_THROW(dt::DiskTier(sub, {{{-1}}}, {}), std::invalid_argument);
  EXPECT_THROW(dt::DiskTier("", {{{1}}}, {}), std::invalid_argument);
  EXPECT_FALSE(fs::exists(sub));
}

TEST(DiskTier, InjectedENOSPCIsAClearErrorAndTheFailureIsSticky) {
  TempDir d;
  dt::DiskTierOptions o;
  o.fault_hook = [](dt::IoOp op, int64_t unit, int64_t, int64_t) {
    return op == dt::IoOp::kWrite && unit == 1 ? ENOSPC : 0;
  };
  dt::DiskTier tier(d.str(), {{{4096}}, {{4096}}}, o);
  store(tier.acquire(0), random_state(tier.layout(0), 5));
  tier.release(0, true);
  tier.flush();  // unit 0 is fine
  store(tier.acquire(1), random_state(tier.layout(1), 6));
  tier.release(1, true);
  int err = 0;
  std::string msg;
  try {
    tier.flush();
  } catch (const dt::DiskTierError& e) {
    err = e.errno_value();
    msg = e.what();
  }
  EXPECT_EQ(err, ENOSPC);
  EXPECT_NE(msg.find("ENOSPC"), std::string::npos) << msg;
  EXPECT_NE(msg.find(tier.unit_path(1)), std::string::npos) << msg;
  EXPECT_NE(msg.find("free space under"), std::string::npos) << msg;
  EXPECT_NE(msg.find("restart from the last checkpoint"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << "one line";
  // Sticky: every later call throws the same error, even for the healthy unit.
  EXPECT_EQ(message_of([&] { tier.acquire(0); }), msg);
  EXPECT_EQ(message_of([&] { tier.prefetch(0); }), msg);
  EXPECT_EQ(message_of([&] { tier.flush(); }), msg);
}

TEST(DiskTier, FileSizeLimitGivesEFBIGWithAdvice) {
  TempDir d;
  struct rlimit old;
  ASSERT_EQ(getrlimit(RLIMIT_FSIZE, &old), 0);
  void (*old_handler)(int) = ::signal(SIGXFSZ, SIG_IGN);
  dt::DiskTierOptions o;
  o.preallocate = false;  // the limit must bite in the write path, not at creation
  o.chunk_bytes = 1 << 20;
  std::string msg;
  int err = 0;
  {
    dt::DiskTier tier(d.str(), {{{256 * 1024}}}, o);
    struct rlimit lim = old;
    lim.rlim_cur = 64 * 1024;
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &lim), 0);
    store(tier.acquire(0), random_state(tier.layout(0), 8));
    tier.release(0, true);
    try {
      tier.flush();
    } catch (const dt::DiskTierError& e) {
      msg = e.what();
      err = e.errno_value();
    }
    ASSERT_EQ(setrlimit(RLIMIT_FSIZE, &old), 0);
    EXPECT_THROW(tier.acquire(0), dt::DiskTierError);
  }
  ::signal(SIGXFSZ, old_handler);
  EXPECT_EQ(err, EFBIG) << msg;
  EXPECT_NE(msg.find("ulimit -f"), std::string::npos) << msg;
}

TEST(DiskTier, InjectedEIOOnReadIsStickyAndNamesTheFile) {
  TempDir d;
  std::atomic<bool> fail_reads{false};
  dt::DiskTierOptions o;
  o.fault_hook = [&](dt::IoOp op, int64_t, int64_t, int64_t) {
    return op == dt::IoOp::kRead && fail_reads.load() ? EIO : 0;
  };
  dt::DiskTier tier(d.str(), {{{12345}}}, o);
  store(tier.acquire(0), random_state(tier.layout(0), 9));
  tier.release(0, true);
  tier.flush();
  tier.drop_cached();
  fail_reads = true;
  tier.prefetch(0);
  const std::string msg = message_of([&] { tier.acquire(0); });
  EXPECT_NE(msg.find("EIO"), std::string::npos) << msg;
  EXPECT_NE(msg.find("read of " + tier.unit_path(0)), std::string::npos) << msg;
  EXPECT_EQ(message_of([&] { tier.flush(); }), msg);
}

TEST(DiskTier, TruncatedFileGivesAShortReadError) {
  TempDir d;
  dt::DiskTier tier(d.str(), {{{16 * 4096}}}, {});
  store(tier.acquire(0), random_state(tier.layout(0), 11));
  tier.release(0, true);
  tier.flush();
  tier.drop_cached();
  fs::resize_file(tier.unit_path(0), 8192);
  const std::string msg = message_of([&] { tier.acquire(0); });
  EXPECT_NE(msg.find("short read"), std::string::npos) << msg;
  EXPECT_NE(msg.find(tier.unit_path(0)), std::string::npos) << msg;
}

TEST(DiskTier, AFileOfAnotherRunIsNeverTakenForState) {
  TempDir a, b;
  const std::vector<dt::UnitLayout> units = {{{8192}}};
  dt::DiskTier ta(a.str(), units, {});
  dt::DiskTier tb(b.str(), units, {});
  EXPECT_NE(ta.run_id(), tb.run_id());
  for (dt::DiskTier* t : {&ta, &tb}) {
    store(t->acquire(0), random_state(units[0], 12));
    t->release(0, true);
    t->flush();
    t->drop_cached();
  }
  fs::copy_file(tb.unit_path(0), ta.unit_path(0), fs::copy_options::overwrite_existing);
  const std::string msg = message_of([&] { ta.acquire(0); });
  EXPECT_NE(msg.find("not this run's header"), std::string::npos) << msg;
}

TEST(DiskTier, FreeSpaceCheckRefusesBeforeCreatingAnyFile) {
  TempDir d;
  const std::string sub = d.str() + "/not_yet";
  const std::vector<dt::UnitLayout> huge = {{{int64_t{1} << 49}}, {{4096}}};  // 512 TiB
  int64_t needed = -1, free_bytes = -1;
  std::string msg;
  try {
    dt::DiskTier tier(sub, huge, {});
  } catch (const dt::DiskSpaceError& e) {
    needed = e.needed_bytes();
    free_bytes = e.free_bytes();
    msg = e.what();
  }
  EXPECT_EQ(needed, dt::DiskTier::bytes_required(huge));
  EXPECT_GE(free_bytes, 0);
  EXPECT_LT(free_bytes, needed);
  EXPECT_NE(msg.find("Nothing was written"), std::string::npos) << msg;
  EXPECT_FALSE(fs::exists(sub)) << "the directory was created";
  // An existing directory stays empty.
  EXPECT_THROW(dt::DiskTier(d.str(), huge, {}), dt::DiskSpaceError);
  EXPECT_TRUE(fs::is_empty(d.path));
  // free_bytes() of a missing directory is its nearest existing ancestor's filesystem.
  EXPECT_GT(dt::DiskTier::free_bytes(sub), 0);
  EXPECT_NEAR(static_cast<double>(dt::DiskTier::free_bytes(sub)),
              static_cast<double>(dt::DiskTier::free_bytes(d.str())), 256.0 * 1024 * 1024);
}

TEST(DiskTier, TheDestructorRemovesTheFilesAndACreatedDirectory) {
  TempDir d;
  const std::string sub = d.str() + "/tier";
  std::string path;
  {
    dt::DiskTier tier(sub, {{{100}}, {{200}}}, {});
    path = tier.unit_path(1);
    EXPECT_TRUE(fs::exists(path));
  }
  EXPECT_FALSE(fs::exists(path));
  EXPECT_FALSE(fs::exists(sub));
}

TEST(DiskTier, StaleFilesOfAKilledRunAreRemovedOrRefused) {
  TempDir d;
  const std::vector<dt::UnitLayout> units = {{{8192}}, {{100}}};
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // A run that dies without running any destructor, right after writing its state.
    auto* tier = new dt::DiskTier(d.str(), units, {});
    store(tier->acquire(0), random_state(units[0], 13));
    tier->release(0, true);
    tier->flush();
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  const std::string f0 = d.str() + "/megatrain_unit_000000.tier";
  ASSERT_TRUE(fs::exists(f0));
  ASSERT_EQ(fs::file_size(f0), 3 * 4096u);

  dt::DiskTierOptions refuse;
  refuse.stale = dt::StalePolicy::kRefuse;
  const std::string msg = message_of([&] { dt::DiskTier t(d.str(), units, refuse); });
  EXPECT_NE(msg.find("2 disk-tier files of an earlier run"), std::string::npos) << msg;
  EXPECT_TRUE(fs::exists(f0));

  dt::DiskTier tier(d.str(), units, {});
  EXPECT_EQ(tier.stale_files_removed(), 2);
  EXPECT_EQ(tier.unit_state(0), "empty");  // nothing of the dead run is read
  auto p = tier.acquire(0);
  EXPECT_TRUE(all_zero(p[0], 8192));
  EXPECT_EQ(tier.stats().unit_reads, 0);
  tier.release(0, false);
}

TEST(DiskTier, AForeignFileWithATierNameIsLeftAloneAndRefused) {
  TempDir d;
  const std::string f = d.str() + "/megatrain_unit_000000.tier";
  { std::ofstream(f) << "user data"; }
  const std::string msg = message_of([&] { dt::DiskTier t(d.str(), {{{100}}}, {}); });
  EXPECT_NE(msg.find("is not a disk-tier file"), std::string::npos) << msg;
  std::ifstream in(f);
  std::string content;
  std::getline(in, content);
  EXPECT_EQ(content, "user data");
}

TEST(DiskTier, ASecondTierOnTheSameDirectoryIsRefused) {
  TempDir d;
  dt::DiskTier first(d.str(), {{{100}}}, {});
  const std::string msg = message_of([&] { dt::DiskTier second(d.str(), {{{100}}}, {}); });
  EXPECT_NE(msg.find("in use by another disk tier"), std::string::npos) << msg;
  EXPECT_TRUE(fs::exists(first.unit_path(0)));
}

// The engine's pattern: one thread (the CPU worker) acquires, updates and releases units dirty in
// turn while another (the thread running backward) prefetches any unit at any time and a third
// reads the counters; every unit still holds exactly what the worker last wrote.
TEST(DiskTier, ConcurrentPrefetchAndAcquireFromSeveralThreadsKeepEveryUnitsLastData) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 2;
  o.io_threads = 3;
  o.chunk_bytes = 8192;
  constexpr int64_t kUnits = 6, kFloats = 9000, kRounds = 12;
  std::vector<dt::UnitLayout> units(kUnits, dt::UnitLayout{{kFloats * 4, kFloats * 4}});
  dt::DiskTier tier(d.str(), units, o);
  auto fill = [&](const std::vector<void*>& p, float v) {
    for (void* s : p) std::fill_n(static_cast<float*>(s), kFloats, v);
  };
  auto holds = [&](const std::vector<void*>& p, float v) {
    for (void* s : p) {
      const float* f = static_cast<const float*>(s);
      if (!std::all_of(f, f + kFloats, [v](float x) { return x == v; })) return false;
    }
    return true;
  };
  std::atomic<bool> done{false};
  std::atomic<int64_t> wrong{0};
  std::thread prefetcher([&] {
    std::mt19937 rng(5);
    while (!done.load()) {
      tier.prefetch(static_cast<int64_t>(rng() % kUnits));
      std::this_thread::yield();
    }
  });
  std::thread reader([&] {
    while (!done.load()) {
      (void)tier.stats();
      (void)tier.unit_state(static_cast<int64_t>(tier.stats().unit_reads % kUnits));
      tier.check();
    }
  });
  for (int64_t r = 0; r < kRounds; ++r) {
    for (int64_t u = 0; u < kUnits; ++u) {
      auto p = tier.acquire(u);
      if (!holds(p, r == 0 ? 0.0f : static_cast<float>(r * 100 + u))) wrong.fetch_add(1);
      fill(p, static_cast<float>((r + 1) * 100 + u));
      tier.release(u, true);
    }
  }
  done = true;
  prefetcher.join();
  reader.join();
  EXPECT_EQ(wrong.load(), 0);
  tier.flush();
  tier.drop_cached();
  for (int64_t u = 0; u < kUnits; ++u) {
    auto p = tier.acquire(u);
    EXPECT_TRUE(holds(p, static_cast<float>(kRounds * 100 + u))) << "unit " << u;
    tier.release(u, false);
  }
  EXPECT_GT(tier.stats().unit_reads, kUnits);  // the state went through the files
}

// An acquire's own read is the acquirer's: a prefetch served the moment that read completes (the
// acquirer not awake yet) must not take its buffer, or the unit would be read again (the read
// amplification seen on the H200 before this rule: 2.6 reads per unit and step).
TEST(DiskTier, APrefetchNeverTakesTheBufferOfAUnitAnAcquireWaitsFor) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 1;
  o.io_threads = 1;
  std::atomic<bool> slow{false};
  o.fault_hook = [&](dt::IoOp op, int64_t u, int64_t, int64_t) {
    if (slow.load() && op == dt::IoOp::kRead && u == 0) std::this_thread::sleep_for(std::chrono::milliseconds(50));
    return 0;
  };
  dt::DiskTier tier(d.str(), {{{4096}}, {{4096}}}, o);
  for (int64_t u : {0, 1}) {
    std::memset(tier.acquire(u)[0], 10 + static_cast<int>(u), 4096);
    tier.release(u, true);
  }
  tier.flush();
  tier.drop_cached();
  const auto reads0 = tier.stats().unit_reads;
  slow = true;
  std::vector<void*> got;
  std::thread worker([&] { got = tier.acquire(0); });
  ASSERT_TRUE(wait_for_state(tier, 0, "reading"));
  tier.prefetch(1);  // queued: the only buffer is being read for the acquire
  worker.join();
  EXPECT_EQ(static_cast<unsigned char*>(got[0])[0], 10);
  EXPECT_EQ(tier.stats().unit_reads - reads0, 1) << "unit 0 was read once";
  EXPECT_EQ(tier.unit_state(1), "on_disk") << "the prefetch waits for the buffer";
  tier.release(0, false);
  ASSERT_TRUE(wait_for_state(tier, 1, "cached"));  // now served
  EXPECT_EQ(static_cast<unsigned char*>(tier.acquire(1)[0])[0], 11);
  tier.release(1, false);
  EXPECT_EQ(tier.stats().unit_reads - reads0, 2);
}

// A prefetch of a unit already in RAM keeps its buffer for it: the read-ahead of the next two
// updates, prefetch(1) then prefetch(2), with unit 1 cached and the other buffer held by unit 0's
// update, must not evict unit 1 to read unit 2 (unit 1's acquire then read it again and evicted
// unit 2, read ahead but not taken yet, which was read a second time: 3 reads for 2 units).
TEST(DiskTier, APrefetchKeepsAUnitAlreadyInRamForItsAcquire) {
  TempDir d;
  dt::DiskTierOptions o;
  o.num_buffers = 2;
  o.io_threads = 1;
  dt::DiskTier tier(d.str(), {{{4096}}, {{4096}}, {{4096}}}, o);
  for (int64_t u : {0, 1, 2}) {
    std::memset(tier.acquire(u)[0], 20 + static_cast<int>(u), 4096);
    tier.release(u, true);
  }
  tier.flush();
  tier.drop_cached();
  tier.acquire(1);
  tier.release(1, false);  // cached from the last step
  tier.acquire(0);         // the update running now holds the other buffer
  const auto reads0 = tier.stats().unit_reads;
  tier.prefetch(1);
  tier.prefetch(2);
  EXPECT_EQ(tier.unit_state(1), "cached") << "kept for its acquire";
  EXPECT_EQ(tier.unit_state(2), "on_disk") << "waits for a buffer";
  EXPECT_EQ(static_cast<unsigned char*>(tier.acquire(1)[0])[0], 21);
  tier.release(0, false);
  tier.release(1, true);
  EXPECT_EQ(static_cast<unsigned char*>(tier.acquire(2)[0])[0], 22);
  tier.release(2, false);
  EXPECT_EQ(tier.stats().unit_reads - reads0, 1) << "unit 2 only";
}
