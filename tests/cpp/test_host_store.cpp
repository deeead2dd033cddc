#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "megatrain/common/tuning.h"
#include "megatrain/host_store/host_memory.h"
#include "megatrain/host_store/host_store.h"

namespace hs = megatrain::host_store;

namespace {

std::vector<hs::UnitSpec> odd_units() {
  // Shapes chosen so numels are not multiples of 64 and sections are not multiples of 4 KiB.
  return {
      {{"q_proj.weight", {33, 17}}, {"q_proj.bias", {33}}, {"norm.weight", {5}}},
      {{"embed.weight", {101, 3}}},
      {},
      {{"scalar", {}}, {"w", {1000, 3}}, {"empty", {0, 4}}},
  };
}

int64_t vm_rss_bytes() {
  std::ifstream f("/proc/self/status");
  std::string key;
  while (f >> key) {
    if (key == "VmRSS:") {
      int64_t kib;
      f >> kib;
      return kib * 1024;
    }
    std::getline(f, key);
  }
  return -1;
}

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

const hs::Section kAll[] = {hs::Section::kCompute, hs::Section::kMaster, hs::Section::kExpAvg,
                            hs::Section::kExpAvgSq, hs::Section::kGradAccum};

}  // namespace

TEST(HostStore, EverySectionIs4KiBAlignedAndEveryEntryOffsetIs64Elements) {
  for (auto dtype : {hs::ComputeDtype::kBFloat16, hs::ComputeDtype::kFloat32}) {
    hs::HostStoreOptions o;
    o.compute_dtype = dtype;
    o.with_grad_accum = true;
    hs::HostStore store(odd_units(), o);
    ASSERT_EQ(reinterpret_cast<uintptr_t>(store.arena_data()) % 4096, 0u);
    for (int64_t u = 0; u < store.num_units(); ++u) {
      for (hs::Section s : kAll) {
        EXPECT_EQ(reinterpret_cast<uintptr_t>(store.section_data(u, s)) % 4096, 0u)
            << "unit " << u << " section " << hs::section_name(s);
      }
      for (const hs::Entry& e : store.entries(u)) EXPECT_EQ(e.offset % 64, 0) << e.name;
    }
  }
}

TEST(HostStore, SectionsOfAUnitAreOneContiguousBlockInOrder) {
  hs::HostStoreOptions o;
  o.with_grad_accum = true;
  hs::HostStore store(odd_units(), o);
  const char* expected = static_cast<const char*>(store.arena_data());
  for (int64_t u = 0; u < store.num_units(); ++u) {
    for (hs::Section s : kAll) {
      EXPECT_EQ(static_cast<const char*>(store.section_data(u, s)), expected)
          << "unit " << u << " section " << hs::section_name(s);
      expected += store.unit_section_bytes(u, s);
    }
  }
  EXPECT_EQ(expected, static_cast<const char*>(store.arena_data()) + store.total_bytes());
}

TEST(HostStore, EntryViewAliasesArenaWriteThroughOneReadThroughAnother) {
  hs::HostStoreOptions o;
  o.compute_dtype = hs::ComputeDtype::kBFloat16;
  hs::HostStore store(odd_units(), o);
  const hs::Entry& e = store.entries(3)[1];  // "w"
  float* master = static_cast<float*>(store.section_data(3, hs::Section::kMaster)) + e.offset;
  master[0] = 1.5f;
  master[e.numel - 1] = -2.25f;
  // Same bytes reached from the arena base with the layout arithmetic.
  int64_t unit_base = 0;
  for (int64_t u = 0; u < 3; ++u) {
    for (hs::Section s : kAll) unit_base += store.unit_section_bytes(u, s);
  }
  const char* arena = static_cast<const char*>(store.arena_data());
  const float* again = reinterpret_cast<const float*>(
      arena + unit_base + store.unit_section_bytes(3, hs::Section::kCompute)) + e.offset;
  EXPECT_EQ(again[0], 1.5f);
  EXPECT_EQ(again[e.numel - 1], -2.25f);
  uint16_t* compute = static_cast<uint16_t*>(store.section_data(3, hs::Section::kCompute)) + e.offset;
  compute[3] = 0x3F80;
  EXPECT_EQ(reinterpret_cast<const uint16_t*>(arena + unit_base)[e.offset + 3], 0x3F80);
}

TEST(HostStore, PaddingAndFreshSectionsAreZero) {
  hs::HostStoreOptions o;
  o.with_grad_accum = true;
  hs::HostStore store(odd_units(), o);
  const unsigned char* p = static_cast<const unsigned char*>(store.arena_data());
  for (int64_t i = 0; i < store.total_bytes(); ++i) ASSERT_EQ(p[i], 0) << "byte " << i;
}

TEST(HostStore, AccountingEqualsLayoutArithmetic) {
  hs::HostStoreOptions o;
  o.compute_dtype = hs::ComputeDtype::kBFloat16;
  o.with_grad_accum = false;
  hs::HostStore store(odd_units(), o);
  // Unit numels: round64(561)+round64(33)+round64(5) = 576+64+64; round64(303) = 320; 0;
  // round64(1)+round64(3000)+round64(0) = 64+3008+0.
  const int64_t numel[] = {704, 320, 0, 3072};
  int64_t total = 0, compute = 0, master = 0;
  for (int u = 0; u < 4; ++u) {
    EXPECT_EQ(store.unit_numel(u), numel[u]);
    compute += round_up(numel[u] * 2, 4096);
    master += round_up(numel[u] * 4, 4096);
  }
  total = compute + 3 * master;
  EXPECT_EQ(store.section_bytes(hs::Section::kCompute), compute);
  EXPECT_EQ(store.section_bytes(hs::Section::kMaster), master);
  EXPECT_EQ(store.section_bytes(hs::Section::kExpAvgSq), master);
  EXPECT_EQ(store.section_bytes(hs::Section::kGradAccum), 0);
  EXPECT_EQ(store.total_bytes(), total);
  EXPECT_EQ(store.total_numel(), 561 + 33 + 5 + 303 + 1 + 3000 + 0);
  EXPECT_DOUBLE_EQ(store.bytes_per_param(), static_cast<double>(total) / store.total_numel());
  EXPECT_EQ(hs::HostStore::bytes_required(odd_units(), o), total);
  EXPECT_FALSE(store.is_pinned());  // pin=false
  EXPECT_EQ(store.pinned_bytes(), 0);
}

TEST(HostStore, LargeUnitsApproachFourteenBytesPerParamWithoutAccumulation) {
  hs::HostStoreOptions o;
  std::vector<hs::UnitSpec> units = {{{"w", {1024, 1024}}}, {{"w", {1024, 1024}}}};
  EXPECT_DOUBLE_EQ(hs::HostStore::bytes_required(units, o) / (2.0 * 1024 * 1024), 14.0);
  o.with_grad_accum = true;
  EXPECT_DOUBLE_EQ(hs::HostStore::bytes_required(units, o) / (2.0 * 1024 * 1024), 18.0);
}

TEST(HostStore, LayoutRequiredEqualsTheStoreItDescribes) {
  // Large units (skew gaps between sections), a frozen entry, with and without the accumulator.
  std::vector<hs::UnitSpec> units = {{{"a", {2048, 2048}}, {"b", {2048, 2048}, true}, {"c", {7}}},
                                     {{"a", {2048, 2048}}, {"b", {2048, 2048}, true}, {"c", {7}}},
                                     {{"e", {33, 5}, true}, {"h", {4096, 1024}}}};
  for (bool accum : {false, true}) {
    hs::HostStoreOptions o;
    o.with_grad_accum = accum;
    const hs::StoreLayout L = hs::HostStore::layout_required(units, o);
    hs::HostStore store(units, o);
    EXPECT_EQ(L.total_bytes, store.total_bytes());
    EXPECT_EQ(L.total_bytes, hs::HostStore::bytes_required(units, o));
    EXPECT_EQ(L.total_numel, store.total_numel());
    EXPECT_EQ(L.frozen_numel, store.frozen_numel());
    for (int s = 0; s < hs::kNumSections; ++s) {
      EXPECT_EQ(L.section_bytes[s], store.section_bytes(static_cast<hs::Section>(s))) << s;
    }
    ASSERT_EQ(L.unit_numel.size(), 3u);
    for (int u = 0; u < 3; ++u) {
      EXPECT_EQ(L.unit_numel[u], store.unit_numel(u));
      EXPECT_EQ(L.unit_state_numel[u], store.unit_state_numel(u));
    }
  }
}

TEST(HostStore, MemoryLimitOverrideTooSmallThrowsBudgetErrorWithNothingAllocated) {
  hs::HostStoreOptions o;
  o.memory_limit_bytes = 4096;
  const int64_t allocs = hs::PinnedBuffer::allocation_count();
  try {
    hs::HostStore store(odd_units(), o);
    FAIL() << "expected HostMemoryError";
  } catch (const hs::HostMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_EQ(e.available_bytes(), 4096);
    EXPECT_EQ(e.needed_bytes(), hs::HostStore::bytes_required(odd_units(), o));
    EXPECT_NE(msg.find(std::to_string(e.needed_bytes()) + " bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("4096 bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("memory_limit_bytes"), std::string::npos) << msg;
    EXPECT_NE(msg.find("Nothing was allocated"), std::string::npos) << msg;
  }
  EXPECT_EQ(hs::PinnedBuffer::allocation_count(), allocs);
}

TEST(HostMemory, CheckBudgetWithoutSystemLimitsChecksOnlyTheOverride) {
  // A caller that checked with a credit of its own (the engine: the model weights it frees while
  // filling the store) skips the system limits here; the explicit override still applies.
  const int64_t pebibyte = int64_t{1} << 50;
  EXPECT_NO_THROW(hs::check_host_budget(pebibyte, /*will_pin=*/true, -1, "test", /*system_limits=*/false));
  EXPECT_THROW(hs::check_host_budget(8192, false, 4096, "test", /*system_limits=*/false), hs::HostMemoryError);
  if (!hs::host_memory_check_disabled()) {
    EXPECT_THROW(hs::check_host_budget(pebibyte, false, -1, "test"), hs::HostMemoryError);
  }
}

TEST(HostStore, CheckBudgetOffStillHonoursTheMemoryLimitOverride) {
  hs::HostStoreOptions o;
  o.memory_limit_bytes = 4096;
  o.check_budget = false;
  const int64_t allocs = hs::PinnedBuffer::allocation_count();
  EXPECT_THROW(hs::HostStore store(odd_units(), o), hs::HostMemoryError);
  EXPECT_EQ(hs::PinnedBuffer::allocation_count(), allocs);
}

TEST(HostStore, OnePebibyteUnitThrowsBudgetErrorWithoutTouchingMemory) {
  if (hs::host_memory_check_disabled()) GTEST_SKIP() << "MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1";
  hs::HostStoreOptions o;
  const int64_t allocs = hs::PinnedBuffer::allocation_count();
  const int64_t rss = vm_rss_bytes();
  // 2^48 fp32 elements per section: far beyond any MemAvailable.
  std::vector<hs::UnitSpec> units = {{{"huge", {int64_t{1} << 24, int64_t{1} << 24}}}};
  EXPECT_THROW(hs::HostStore store(units, o), hs::HostMemoryError);
  EXPECT_EQ(hs::PinnedBuffer::allocation_count(), allocs);
  EXPECT_LT(vm_rss_bytes() - rss, int64_t{16} << 20);
}

TEST(HostStore, NegativeDimensionAndOverflowAreRejected) {
  hs::HostStoreOptions o;
  EXPECT_THROW(hs::HostStore({{{"w", {4, -1}}}}, o), std::invalid_argument);
  EXPECT_THROW(hs::HostStore::bytes_required({{{"w", {int64_t{1} << 40, int64_t{1} << 40}}}}, o),
               std::invalid_argument);
}

TEST(HostStore, GradAccumSectionAbsentUnlessRequested) {
  hs::HostStoreOptions o;
  hs::HostStore store(odd_units(), o);
  EXPECT_FALSE(store.has_section(hs::Section::kGradAccum));
  EXPECT_THROW(store.section_data(0, hs::Section::kGradAccum), std::invalid_argument);
  EXPECT_THROW(store.section_data(4, hs::Section::kMaster), std::out_of_range);
}

TEST(HostStore, SectionNamesParseAndUnknownNameIsRejected) {
  for (hs::Section s : kAll) EXPECT_EQ(hs::parse_section(hs::section_name(s)), s);
  EXPECT_THROW(hs::parse_section("momentum"), std::invalid_argument);
}

TEST(PinnedBuffer, PageAlignedZeroFilledAndUnpinnedWithoutCuda) {
  hs::PinnedBuffer buf(10000, /*pin=*/true);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % 4096, 0u);
  EXPECT_EQ(buf.bytes(), 10000);
  EXPECT_EQ(buf.mapped_bytes(), 12288);
  const unsigned char* p = static_cast<const unsigned char*>(buf.data());
  for (int i = 0; i < 10000; ++i) ASSERT_EQ(p[i], 0);
#ifndef MEGATRAIN_WITH_CUDA
  EXPECT_FALSE(buf.is_pinned());
#endif
}

TEST(HostMemory, AvailabilityIsReadFromProcMeminfo) {
  const hs::MemoryAvailability m = hs::query_memory_availability();
  EXPECT_GT(m.mem_available_bytes, 0);
  if (m.cgroup_limit_bytes) {
    EXPECT_GT(*m.cgroup_limit_bytes, 0);
  }
}

// --- transparent huge pages ----------------------------------------------------------------

namespace {
// Restores the process-wide switches after a test changes them.
struct TuningGuard {
  megatrain::common::Tuning saved = megatrain::common::tuning();
  ~TuningGuard() { megatrain::common::set_tuning(saved); }
};
}  // namespace

TEST(PinnedBuffer, LargeBufferIsTwoMiBAlignedAndHugePageAdvisedUnlessSwitchedOff) {
  TuningGuard guard;
  const int64_t bytes = (int64_t{6} << 20) + 12345;
  megatrain::common::Tuning t = guard.saved;
  t.hugepages = true;
  megatrain::common::set_tuning(t);
  {
    hs::PinnedBuffer buf(bytes, /*pin=*/false);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buf.data()) % (uintptr_t{2} << 20), 0u);
    EXPECT_TRUE(buf.hugepage_advised());
    EXPECT_EQ(buf.mapped_bytes(), round_up(bytes, 4096));
    unsigned char* p = static_cast<unsigned char*>(buf.data());
    for (int64_t i = 0; i < bytes; i += 4096) ASSERT_EQ(p[i], 0);
    std::memset(p, 1, static_cast<size_t>(bytes));  // the whole mapping is ours
    const int64_t huge = hs::huge_page_bytes(p, bytes);
    EXPECT_GE(huge, -1);
    EXPECT_LE(huge, bytes);
  }
  t.hugepages = false;
  megatrain::common::set_tuning(t);
  {
    hs::PinnedBuffer buf(bytes, /*pin=*/false);
    EXPECT_FALSE(buf.hugepage_advised());
    std::memset(buf.data(), 1, static_cast<size_t>(bytes));
    if (hs::transparent_hugepage_mode() != "unknown") {
      EXPECT_EQ(hs::huge_page_bytes(buf.data(), bytes), 0);  // MADV_NOHUGEPAGE
    }
  }
  hs::PinnedBuffer small(10000, /*pin=*/false);  // below 2 MiB: never advised
  EXPECT_FALSE(small.hugepage_advised());
}

TEST(Tuning, InvalidValuesAreRejected) {
  TuningGuard guard;
  megatrain::common::Tuning t = guard.saved;
  t.prefetch_bytes = -1;
  EXPECT_THROW(megatrain::common::set_tuning(t), std::invalid_argument);
  t.prefetch_bytes = 0;
  t.nt_min_numel = -5;
  EXPECT_THROW(megatrain::common::set_tuning(t), std::invalid_argument);
}

TEST(HostStore, LargeUnitSectionsAreStaggeredModulo256KiBAndSmallOnesBackToBack) {
  // 4M + 64 elements: fp32 sections of 16 MiB + 256 B (>= kSkewMinSectionBytes); the odd 64
  // keeps back-to-back offsets off the target residues.
  const int64_t n = (int64_t{1} << 22) + 64;
  std::vector<hs::UnitSpec> units = {{{"norm", {3000}}}, {{"w", {n}}}, {{"v", {n}}}};
  for (bool skew : {true, false}) {
    hs::HostStoreOptions o;
    o.with_grad_accum = true;
    o.skew_sections = skew;
    hs::HostStore store(units, o);
    EXPECT_EQ(store.bytes_required(units, o), store.total_bytes());
    const char* arena = static_cast<const char*>(store.arena_data());
    const char* end_prev = arena;
    for (int64_t u = 0; u < store.num_units(); ++u) {
      for (int s = 0; s < hs::kNumSections; ++s) {
        const auto sec = static_cast<hs::Section>(s);
        const char* p = static_cast<const char*>(store.section_data(u, sec));
        const int64_t off = p - arena;
        EXPECT_EQ(off % 4096, 0);
        EXPECT_GE(p, end_prev) << "unit " << u << " section " << s;  // in order, no overlap
        if (u == 0 || !skew) {
          EXPECT_EQ(p, end_prev) << "unit " << u << " section " << s;  // back to back
        } else {
          EXPECT_EQ(off % hs::HostStore::kSkewPeriodBytes,
                    (hs::HostStore::kSkewBaseBytes + s * hs::HostStore::kSkewStepBytes) %
                        hs::HostStore::kSkewPeriodBytes);
          EXPECT_LT(p - end_prev, hs::HostStore::kSkewPeriodBytes);
        }
        end_prev = p + store.unit_section_bytes(u, sec);
      }
    }
    EXPECT_LE(end_prev, arena + store.total_bytes());
    if (!skew) {
      EXPECT_EQ(end_prev, arena + store.total_bytes());
    }
    // Gaps are zero and views of one section never reach another.
    float* master = static_cast<float*>(store.section_data(1, hs::Section::kMaster));
    for (int64_t i = 0; i < n; ++i) master[i] = 1.0f;
    const float* m = static_cast<const float*>(store.section_data(1, hs::Section::kExpAvg));
    for (int64_t i = 0; i < n; i += 4099) ASSERT_EQ(m[i], 0.0f);
  }
  // The padding stays small next to the data.
  hs::HostStoreOptions on, off;
  on.skew_sections = true;
  off.skew_sections = false;
  const int64_t extra = hs::HostStore::bytes_required(units, on) - hs::HostStore::bytes_required(units, off);
  EXPECT_GT(extra, 0);
  EXPECT_LT(extra, 2 * 4 * hs::HostStore::kSkewPeriodBytes);
}

TEST(HostBudget, ShortfallRulesInOrderWithTheReclaimableCredit) {
  hs::MemoryAvailability m;
  m.mem_available_bytes = 1000;
  EXPECT_FALSE(hs::host_budget_shortfall(1000, 0, 0, m));
  auto s = hs::host_budget_shortfall(1001, 0, 0, m);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->kind, "memory");
  EXPECT_EQ(s->available_bytes, 1000);
  EXPECT_NE(s->limit.find("MemAvailable"), std::string::npos);
  EXPECT_FALSE(hs::host_budget_shortfall(1500, 0, 500, m));  // freed while the store is filled
  s = hs::host_budget_shortfall(1501, 0, 500, m);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->credit_bytes, 500);
  EXPECT_NE(s->limit.find("500 bytes"), std::string::npos) << s->limit;

  m.mem_available_bytes = -1;  // unknown: the cgroup limit minus its usage applies
  m.cgroup_limit_bytes = 10000;
  m.cgroup_usage_bytes = 9000;
  m.cgroup_path = "/sys/fs/cgroup/x/memory.max";
  s = hs::host_budget_shortfall(5000, 0, 0, m);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->available_bytes, 1000);
  EXPECT_NE(s->limit.find("/sys/fs/cgroup/x/memory.max"), std::string::npos);

  m.cgroup_limit_bytes.reset();
  m.memlock_bytes = 4096;  // the credit never counts for page-locked bytes
  EXPECT_FALSE(hs::host_budget_shortfall(1 << 20, 0, 1 << 30, m));
  s = hs::host_budget_shortfall(1 << 20, 8192, 1 << 30, m);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->kind, "memlock");
  EXPECT_EQ(s->credit_bytes, 0);
  try {
    hs::throw_budget_error("test", 1 << 20, *s);
    FAIL() << "expected HostMemoryError";
  } catch (const hs::HostMemoryError& e) {
    EXPECT_EQ(e.available_bytes(), 4096);
    EXPECT_NE(std::string(e.what()).find("Nothing was allocated"), std::string::npos);
  }
}

TEST(HostStore, OffloadedUnitsKeepTheirComputeSectionAndStateLayoutButNoFp32Bytes) {
  // Unit 1 (large: its sections would be skewed) keeps its fp32 state in the disk tier.
  std::vector<hs::UnitSpec> units = {{{"a", {33, 17}}, {"b", {5}, true}},
                                     {{"a", {2048, 2048}}, {"b", {9}, true}, {"c", {7}}},
                                     {{"e", {101, 3}}}};
  for (bool accum : {false, true}) {
    hs::HostStoreOptions all, off;
    all.with_grad_accum = off.with_grad_accum = accum;
    off.state_offloaded = {false, true, false};
    const hs::StoreLayout La = hs::HostStore::layout_required(units, all);
    const hs::StoreLayout Lo = hs::HostStore::layout_required(units, off);
    hs::HostStore full(units, all), store(units, off);
    EXPECT_EQ(Lo.total_bytes, store.total_bytes());
    EXPECT_EQ(Lo.unit_state_numel, La.unit_state_numel) << "the layout that lives on disk is still described";
    EXPECT_EQ(Lo.unit_numel, La.unit_numel);
    EXPECT_TRUE(store.state_offloaded(1));
    EXPECT_FALSE(store.state_offloaded(0));
    const int64_t state1 = round_up(full.unit_state_numel(1) * 4, 4096);
    EXPECT_EQ(La.section_bytes[static_cast<int>(hs::Section::kMaster)] - state1,
              Lo.section_bytes[static_cast<int>(hs::Section::kMaster)]);
    EXPECT_LE(Lo.total_bytes, La.total_bytes - (accum ? 4 : 3) * state1);
    for (int64_t u = 0; u < 3; ++u) {
      const auto& e0 = full.entries(u);
      const auto& e1 = store.entries(u);
      for (size_t i = 0; i < e0.size(); ++i) {
        EXPECT_EQ(e0[i].offset, e1[i].offset);
        EXPECT_EQ(e0[i].state_offset, e1[i].state_offset);
      }
    }
    EXPECT_EQ(store.unit_section_bytes(1, hs::Section::kMaster), 0);
    EXPECT_NE(store.section_data(1, hs::Section::kCompute), nullptr);
    EXPECT_THROW(store.section_data(1, hs::Section::kMaster), std::invalid_argument);
    EXPECT_THROW(store.section_data(1, hs::Section::kExpAvgSq), std::invalid_argument);
    EXPECT_NO_THROW(store.section_data(2, hs::Section::kMaster));
  }
  hs::HostStoreOptions bad;
  bad.state_offloaded = {true};
  EXPECT_THROW(hs::HostStore::layout_required(units, bad), std::invalid_argument);
}

TEST(HostStore, ComputeAbsentUnitsHaveNoComputeBytesAndKeepTheirLayout) {
  // Unit 1 is master-streamed (no compute section: 12 B/param); unit 2 both offloaded and compute_absent.
  std::vector<hs::UnitSpec> units = {{{"a", {33, 17}}},
                                     {{"a", {2048, 2048}}, {"c", {7}}},
                                     {{"e", {101, 3}}}};
  for (bool bf16 : {true, false}) {
    hs::HostStoreOptions all, ab;
    all.compute_dtype = ab.compute_dtype = bf16 ? hs::ComputeDtype::kBFloat16 : hs::ComputeDtype::kFloat32;
    ab.compute_absent = {false, true, true};
    ab.state_offloaded = {false, false, true};
    const hs::StoreLayout La = hs::HostStore::layout_required(units, all);
    const hs::StoreLayout Lb = hs::HostStore::layout_required(units, ab);
    hs::HostStore full(units, all), store(units, ab);
    EXPECT_EQ(Lb.total_bytes, store.total_bytes());
    EXPECT_EQ(Lb.unit_numel, La.unit_numel) << "the compute layout a slot holds is still described";
    EXPECT_EQ(Lb.unit_state_numel, La.unit_state_numel);
    const int64_t c1 = full.unit_section_bytes(1, hs::Section::kCompute);
    const int64_t c2 = full.unit_section_bytes(2, hs::Section::kCompute);
    EXPECT_EQ(c1, round_up(full.unit_numel(1) * (bf16 ? 2 : 4), 4096));
    EXPECT_EQ(store.unit_section_bytes(1, hs::Section::kCompute), 0);
    EXPECT_EQ(store.unit_section_bytes(2, hs::Section::kCompute), 0);
    EXPECT_EQ(store.section_bytes(hs::Section::kCompute), full.section_bytes(hs::Section::kCompute) - c1 - c2);
    EXPECT_EQ(store.section_bytes(hs::Section::kMaster) + full.unit_section_bytes(2, hs::Section::kMaster),
              full.section_bytes(hs::Section::kMaster));
    EXPECT_LE(store.total_bytes(), full.total_bytes() - c1);
    EXPECT_TRUE(store.compute_absent(1));
    EXPECT_FALSE(store.compute_absent(0));
    EXPECT_THROW(store.section_data(1, hs::Section::kCompute), std::invalid_argument);
    EXPECT_THROW(store.section_data(2, hs::Section::kCompute), std::invalid_argument);
    EXPECT_THROW(store.section_data(2, hs::Section::kMaster), std::invalid_argument);
    EXPECT_NO_THROW(store.section_data(1, hs::Section::kExpAvgSq));
    EXPECT_NO_THROW(store.section_data(0, hs::Section::kCompute));
    for (int64_t u = 0; u < 3; ++u) {
      for (size_t i = 0; i < full.entries(u).size(); ++i) {
        EXPECT_EQ(full.entries(u)[i].offset, store.entries(u)[i].offset);
        EXPECT_EQ(full.entries(u)[i].state_offset, store.entries(u)[i].state_offset);
      }
    }
  }
  hs::HostStoreOptions bad;
  bad.compute_absent = {true};
  EXPECT_THROW(hs::HostStore::layout_required(units, bad), std::invalid_argument);
}
