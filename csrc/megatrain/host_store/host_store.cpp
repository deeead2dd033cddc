#include "megatrain/host_store/host_store.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "megatrain/common/cuda_utils.h"
#include "megatrain/common/tuning.h"

namespace megatrain {
namespace host_store {
namespace {

std::atomic<int64_t> g_allocation_count{0};

int64_t checked_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) throw std::invalid_argument("host store size overflows int64");
  return r;
}

int64_t checked_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) throw std::invalid_argument("host store size overflows int64");
  return r;
}

int64_t round_up(int64_t x, int64_t m) { return checked_mul((checked_add(x, m - 1)) / m, m); }

int64_t page_size() {
  static const int64_t p = sysconf(_SC_PAGESIZE);
  return p;
}

constexpr int64_t kHugePageBytes = int64_t{2} << 20;

// Anonymous zero-filled mapping of `bytes` (a multiple of the page size). With `huge_aligned`,
// the start is 2 MiB aligned (map 2 MiB more, trim both ends) so that every whole 2 MiB of the
// buffer can be a transparent huge page; mmap alone only guarantees 4 KiB alignment.
void* map_anonymous(int64_t bytes, bool huge_aligned) {
  const size_t len = static_cast<size_t>(bytes);
  if (!huge_aligned) {
    return mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  }
  const size_t over = len + static_cast<size_t>(kHugePageBytes);
  void* raw = mmap(nullptr, over, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return raw;
  const uintptr_t start = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t aligned = (start + static_cast<uintptr_t>(kHugePageBytes) - 1) &
                            ~(static_cast<uintptr_t>(kHugePageBytes) - 1);
  const size_t head = aligned - start;
  const size_t tail = over - head - len;
  if (head > 0) munmap(raw, head);
  if (tail > 0) munmap(reinterpret_cast<void*>(aligned + len), tail);
  return reinterpret_cast<void*>(aligned);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// PinnedBuffer

PinnedBuffer::PinnedBuffer(int64_t bytes, bool pin, int64_t memory_limit_bytes,
                           const std::string& what, int shared_fd, bool check_budget)
    : bytes_(bytes) {
  if (bytes < 0) throw std::invalid_argument(what + ": negative size " + std::to_string(bytes));
  mapped_ = round_up(bytes, page_size());
  const bool will_pin = pin && common::cuda_device_present();
  check_host_budget(mapped_, will_pin, memory_limit_bytes, what, check_budget);
  if (mapped_ == 0) return;
  const bool huge = common::tuning().hugepages && shared_fd < 0;
  void* p = shared_fd >= 0 ? mmap(nullptr, static_cast<size_t>(mapped_), PROT_READ | PROT_WRITE,
                                  MAP_SHARED, shared_fd, 0)
                           : map_anonymous(mapped_, huge && mapped_ >= kHugePageBytes);
  shared_ = shared_fd >= 0;
  if (p == MAP_FAILED) {
    const int err = errno;
    throw HostMemoryError("megatrain " + what + ": mmap of " + std::to_string(mapped_) +
                              " bytes failed: " + std::strerror(err) +
                              ". Free host memory or reduce the model size.",
                          mapped_, -1, "mmap");
  }
#if defined(MADV_HUGEPAGE) && defined(MADV_NOHUGEPAGE)
  // A hint only (THP mode "madvise" needs it; "never" ignores it). Huge pages: fewer page faults
  // when the arena is first touched / registered and fewer TLB misses in the Adam pass.
  // MEGATRAIN_HUGEPAGES=0 asks for 4 KiB pages even under THP "always" (A/B benchmarks).
  if (mapped_ >= kHugePageBytes && !shared_) {
    hugepage_advised_ =
        madvise(p, static_cast<size_t>(mapped_), huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE) == 0 &&
        huge;
  }
#endif
  if (will_pin) {
    try {
      pinned_ = common::cuda_host_register(p, static_cast<size_t>(mapped_));
    } catch (...) {
      munmap(p, static_cast<size_t>(mapped_));
      throw;
    }
  }
  data_ = p;
  g_allocation_count.fetch_add(1);
}

PinnedBuffer::~PinnedBuffer() {
  if (data_ == nullptr) return;
  if (pinned_) {
    const std::string err = common::cuda_host_unregister(data_);
    if (!err.empty()) std::fprintf(stderr, "megatrain warning: PinnedBuffer: %s\n", err.c_str());
  }
  if (munmap(data_, static_cast<size_t>(mapped_)) != 0) {
    std::fprintf(stderr, "megatrain warning: PinnedBuffer: munmap failed: %s\n",
                 std::strerror(errno));
  }
}

bool PinnedBuffer::pin() {
  if (pinned_ || data_ == nullptr || !common::cuda_device_present()) return pinned_;
  pinned_ = common::cuda_host_register(data_, static_cast<size_t>(mapped_));
  return pinned_;
}

int64_t PinnedBuffer::allocation_count() { return g_allocation_count.load(); }

// ---------------------------------------------------------------------------------------------
// HostStore

const char* section_name(Section s) {
  switch (s) {
    case Section::kCompute:
      return "compute";
    case Section::kMaster:
      return "master";
    case Section::kExpAvg:
      return "exp_avg";
    case Section::kExpAvgSq:
      return "exp_avg_sq";
    case Section::kGradAccum:
      return "grad_accum";
  }
  return "unknown";
}

Section parse_section(const std::string& name) {
  for (int i = 0; i < kNumSections; ++i) {
    if (name == section_name(static_cast<Section>(i))) return static_cast<Section>(i);
  }
  throw std::invalid_argument("unknown host store section '" + name +
                              "', expected one of compute, master, exp_avg, exp_avg_sq, grad_accum");
}

std::vector<HostStore::UnitLayout> HostStore::plan(const std::vector<UnitSpec>& units,
                                                   const HostStoreOptions& options,
                                                   int64_t* total_bytes, int64_t* total_numel,
                                                   int64_t* frozen_numel) {
  if (!options.state_offloaded.empty() && options.state_offloaded.size() != units.size()) {
    throw std::invalid_argument("host store: state_offloaded has " + std::to_string(options.state_offloaded.size()) +
                                " flags for " + std::to_string(units.size()) + " units");
  }
  if (!options.compute_absent.empty() && options.compute_absent.size() != units.size()) {
    throw std::invalid_argument("host store: compute_absent has " + std::to_string(options.compute_absent.size()) +
                                " flags for " + std::to_string(units.size()) + " units");
  }
  std::vector<UnitLayout> layouts;
  layouts.reserve(units.size());
  int64_t cursor = 0;
  int64_t params = 0;
  int64_t frozen = 0;
  for (size_t u = 0; u < units.size(); ++u) {
    UnitLayout L;
    int64_t off = 0;
    int64_t state_off = 0;
    for (const TensorSpec& t : units[u]) {
      int64_t numel = 1;
      for (int64_t d : t.shape) {
        if (d < 0) {
          throw std::invalid_argument("host store unit " + std::to_string(u) + " tensor '" +
                                      t.name + "' has a negative dimension " + std::to_string(d));
        }
        numel = checked_mul(numel, d);
      }
      L.entries.push_back(Entry{t.name, t.shape, numel, off, t.frozen ? -1 : state_off});
      off = checked_add(off, round_up(numel, kAlignElements));
      if (!t.frozen) state_off = checked_add(state_off, round_up(numel, kAlignElements));
      params = checked_add(params, numel);
      if (t.frozen) frozen = checked_add(frozen, numel);
    }
    L.numel = off;
    L.state_numel = state_off;
    L.base_bytes = cursor;
    int64_t rel = 0;
    L.state_offloaded = !options.state_offloaded.empty() && options.state_offloaded[u];
    L.compute_absent = !options.compute_absent.empty() && options.compute_absent[u];
    const bool skew = options.skew_sections && !L.state_offloaded &&
                      checked_mul(L.state_numel, 4) >= kSkewMinSectionBytes;
    for (int s = 0; s < kNumSections; ++s) {
      const Section sec = static_cast<Section>(s);
      int64_t bytes = 0;
      const bool in_arena = sec == Section::kCompute ? !L.compute_absent : !L.state_offloaded;
      if (in_arena && (sec != Section::kGradAccum || options.with_grad_accum)) {
        const int64_t esize =
            (sec == Section::kCompute && options.compute_dtype == ComputeDtype::kBFloat16) ? 2 : 4;
        const int64_t n = sec == Section::kCompute ? L.numel : L.state_numel;
        bytes = round_up(checked_mul(n, esize), kSectionAlignBytes);
      }
      if (skew && bytes > 0) {
        const int64_t want = (kSkewBaseBytes + s * kSkewStepBytes) % kSkewPeriodBytes;
        const int64_t have = checked_add(cursor, rel) % kSkewPeriodBytes;
        rel = checked_add(rel, ((want - have) % kSkewPeriodBytes + kSkewPeriodBytes) % kSkewPeriodBytes);
      }
      L.section_offset_bytes[s] = rel;
      L.section_bytes[s] = bytes;
      rel = checked_add(rel, bytes);
    }
    cursor = checked_add(cursor, rel);
    layouts.push_back(std::move(L));
  }
  *total_bytes = cursor;
  *total_numel = params;
  if (frozen_numel != nullptr) *frozen_numel = frozen;
  return layouts;
}

int64_t HostStore::bytes_required(const std::vector<UnitSpec>& units,
                                  const HostStoreOptions& options) {
  int64_t total = 0, numel = 0;
  plan(units, options, &total, &numel);
  return total;
}

StoreLayout HostStore::layout_required(const std::vector<UnitSpec>& units,
                                       const HostStoreOptions& options) {
  StoreLayout out;
  const std::vector<UnitLayout> layouts =
      plan(units, options, &out.total_bytes, &out.total_numel, &out.frozen_numel);
  for (const UnitLayout& L : layouts) {
    for (int s = 0; s < kNumSections; ++s) {
      out.section_bytes[s] = checked_add(out.section_bytes[s], L.section_bytes[s]);
    }
    out.unit_numel.push_back(L.numel);
    out.unit_state_numel.push_back(L.state_numel);
  }
  return out;
}

HostStore::HostStore(std::vector<UnitSpec> units, HostStoreOptions options) : options_(options) {
  units_ = plan(units, options_, &total_bytes_, &total_numel_, &frozen_numel_);
  // PinnedBuffer runs the budget check before mapping anything.
  arena_ = std::make_unique<PinnedBuffer>(total_bytes_, options_.pin, options_.memory_limit_bytes,
                                          "HostStore", options_.shared_fd, options_.check_budget);
}

HostStore::~HostStore() = default;

void HostStore::check_unit(int64_t u) const {
  if (u < 0 || u >= num_units()) {
    throw std::out_of_range("host store unit index " + std::to_string(u) + " out of range [0, " +
                            std::to_string(num_units()) + ")");
  }
}

int64_t HostStore::unit_numel(int64_t u) const {
  check_unit(u);
  return units_[u].numel;
}

int64_t HostStore::unit_state_numel(int64_t u) const {
  check_unit(u);
  return units_[u].state_numel;
}

const std::vector<Entry>& HostStore::entries(int64_t u) const {
  check_unit(u);
  return units_[u].entries;
}

bool HostStore::has_section(Section s) const {
  return s != Section::kGradAccum || options_.with_grad_accum;
}

int64_t HostStore::element_size(Section s) const {
  return (s == Section::kCompute && options_.compute_dtype == ComputeDtype::kBFloat16) ? 2 : 4;
}

bool HostStore::state_offloaded(int64_t u) const {
  check_unit(u);
  return units_[u].state_offloaded;
}

bool HostStore::compute_absent(int64_t u) const {
  check_unit(u);
  return units_[u].compute_absent;
}

void* HostStore::section_data(int64_t u, Section s) const {
  check_unit(u);
  if (!has_section(s)) {
    throw std::invalid_argument(
        "host store has no grad_accum section (it was created with with_grad_accum=False)");
  }
  const UnitLayout& L = units_[u];
  if (L.state_offloaded && s != Section::kCompute) {
    throw std::invalid_argument("host store unit " + std::to_string(u) + " keeps its fp32 state (" +
                                section_name(s) + " included) outside the store, in the disk tier; only its "
                                "compute section is here");
  }
  if (L.compute_absent && s == Section::kCompute) {
    throw std::invalid_argument("host store unit " + std::to_string(u) + " has no compute section (compute_absent: "
                                "its compute copy is derived from the fp32 master or kept on the device)");
  }
  char* base = static_cast<char*>(arena_->data());
  if (base == nullptr) return nullptr;  // empty store
  return base + L.base_bytes + L.section_offset_bytes[static_cast<int>(s)];
}

int64_t HostStore::unit_section_bytes(int64_t u, Section s) const {
  check_unit(u);
  return units_[u].section_bytes[static_cast<int>(s)];
}

int64_t HostStore::section_bytes(Section s) const {
  int64_t total = 0;
  for (const UnitLayout& L : units_) total += L.section_bytes[static_cast<int>(s)];
  return total;
}

double HostStore::bytes_per_param() const {
  return total_numel_ == 0 ? 0.0
                           : static_cast<double>(total_bytes_) / static_cast<double>(total_numel_);
}

}  // namespace host_store
}  // namespace megatrain
