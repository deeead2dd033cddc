// Host-resident training state: one page-aligned arena holding, per unit (a decoder layer or a
// resident group), one contiguous block of sections
//   [compute (bf16|fp32)] [master fp32] [exp_avg fp32] [exp_avg_sq fp32] [grad_accum fp32]?
// ("layer-contiguous tiling", DESIGN.md section 1); in large units the sections are staggered
// by a small gap (kSkewMinSectionBytes). A frozen entry (a parameter that never trains: a LoRA
// base, a frozen embedding) has a place in the compute section only; the fp32 sections of its
// unit hold the trainable entries alone. Torch-free.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/common/tuning.h"
#include "megatrain/host_store/host_memory.h"

namespace megatrain {
namespace host_store {

/// \brief Page-aligned host allocation of a fixed size, page-locked once (cudaHostRegister) when
/// requested, built with CUDA and a device is present. Zero-filled (fresh anonymous mapping).
class PinnedBuffer {
 public:
  /// \param[in] bytes size in bytes (rounded up to whole pages internally).
  /// \param[in] pin page-lock for DMA if CUDA is compiled in and a device is visible.
  /// \param[in] memory_limit_bytes budget override (see check_host_budget), -1 for system limits.
  /// \param[in] what name used in error messages.
  /// \param[in] shared_fd -1: a private anonymous mapping; else a file descriptor of a file of at
  ///            least `bytes` bytes (a /dev/shm file, a memfd) mapped MAP_SHARED: every process that
  ///            maps the same file sees the same pages (one store per node for data parallel
  ///            ranks). The caller keeps ownership of the descriptor (it may close it afterwards).
  /// \param[in] check_budget false: skip the MemAvailable / cgroup / memlock check (the caller
  ///            counted these bytes in its own check_host_budget, with a credit this buffer does
  ///            not know of); the memory_limit_bytes override is checked either way.
  /// \throws HostMemoryError if the budget check or the mapping fails (nothing stays allocated);
  ///         std::runtime_error if page-locking fails.
  PinnedBuffer(int64_t bytes, bool pin, int64_t memory_limit_bytes = -1,
               const std::string& what = "pinned buffer", int shared_fd = -1, bool check_budget = true);
  ~PinnedBuffer();
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;

  void* data() const { return data_; }
  int64_t bytes() const { return bytes_; }          ///< requested size
  int64_t mapped_bytes() const { return mapped_; }  ///< page-rounded size actually mapped
  bool is_pinned() const { return pinned_; }
  /// \brief Whether the mapping is 2 MiB aligned and advised MADV_HUGEPAGE (buffers >= 2 MiB,
  /// MEGATRAIN_HUGEPAGES not 0). Whether the kernel then backs it with huge pages depends on its
  /// THP mode (/sys/kernel/mm/transparent_hugepage/enabled); see huge_page_bytes().
  bool hugepage_advised() const { return hugepage_advised_; }
  /// \brief Whether the buffer is a MAP_SHARED mapping of a caller's file (shared_fd).
  bool is_shared() const { return shared_; }

  /// \brief Page-lock a buffer created with pin=false (after it was filled: registering first
  /// faults every page in while the caller's source may still occupy memory). No-op when already
  /// pinned, empty, or CUDA is absent.
  /// \return whether the buffer is pinned afterwards.
  /// \throws std::runtime_error if page-locking fails.
  bool pin();

  /// \brief Number of successful mappings made by PinnedBuffer in this process (tests use it to
  /// prove a failed budget check allocated nothing).
  static int64_t allocation_count();

 private:
  void* data_ = nullptr;
  int64_t bytes_ = 0;
  int64_t mapped_ = 0;
  bool pinned_ = false;
  bool hugepage_advised_ = false;
  bool shared_ = false;
};

/// \brief One tensor of a unit: name, shape, and whether it is frozen (compute copy only).
struct TensorSpec {
  std::string name;
  std::vector<int64_t> shape;
  bool frozen = false;
};
using UnitSpec = std::vector<TensorSpec>;

enum class ComputeDtype { kBFloat16, kFloat32 };

enum class Section { kCompute = 0, kMaster = 1, kExpAvg = 2, kExpAvgSq = 3, kGradAccum = 4 };
constexpr int kNumSections = 5;

/// \brief "compute", "master", "exp_avg", "exp_avg_sq", "grad_accum".
const char* section_name(Section s);
/// \throws std::invalid_argument for an unknown name.
Section parse_section(const std::string& name);

struct HostStoreOptions {
  ComputeDtype compute_dtype = ComputeDtype::kBFloat16;
  bool with_grad_accum = false;  ///< add the fp32 gradient accumulator section
  bool pin = false;              ///< page-lock the whole arena (one registration)
  int64_t memory_limit_bytes = -1;  ///< budget override; -1: MemAvailable / cgroup / memlock
  /// false: skip the MemAvailable / cgroup / memlock check (the caller already ran it for the
  /// arena, e.g. with the credit of the model weights it frees while filling the store).
  bool check_budget = true;
  /// Stagger the sections of large units (MEGATRAIN_STORE_SKEW, common/tuning.h): see
  /// HostStore::kSkewMinSectionBytes.
  bool skew_sections = common::tuning().store_skew;
  /// -1: a private anonymous arena; else the arena is this file mapped MAP_SHARED (see
  /// PinnedBuffer; the file must hold at least layout_required(...).total_bytes bytes, rounded up
  /// to whole pages).
  int shared_fd = -1;
  /// Per unit (empty: none): the unit's fp32 sections (master, exp_avg, exp_avg_sq, grad_accum)
  /// are kept outside the store (the disk tier, csrc/megatrain/disk_tier/): the arena holds its
  /// compute section only, while unit_state_numel and the entries' state offsets still describe
  /// the fp32 layout that lives elsewhere.
  std::vector<bool> state_offloaded;
  /// Per unit (empty: none): the unit has no compute section in the arena (0 bytes; section_data
  /// of it throws). Its compute copy is derived elsewhere: a "master-streamed" unit's slot is
  /// filled from its fp32 master (cast on the device), or a device-exclusive layer keeps it on
  /// the device only. The entries' compute offsets still describe the layout a compute copy of
  /// the unit would have (unit_numel is unchanged), so device slots keep the same layout.
  std::vector<bool> compute_absent;
};

/// \brief What a store of given units and options would hold, without allocating it
/// (HostStore::layout_required): the numbers its constructor computes.
struct StoreLayout {
  int64_t total_bytes = 0;   ///< arena bytes (sections, their 4 KiB padding, skew gaps)
  int64_t total_numel = 0;   ///< unpadded parameter count
  int64_t frozen_numel = 0;  ///< unpadded parameter count of the frozen entries
  std::array<int64_t, kNumSections> section_bytes{};  ///< per section, summed over units (0: absent)
  std::vector<int64_t> unit_numel;        ///< padded compute-section elements per unit
  std::vector<int64_t> unit_state_numel;  ///< padded fp32-section elements per unit (also of the
                                          ///< units whose fp32 sections are offloaded)
};

/// \brief A tensor's place in its unit.
struct Entry {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel;
  int64_t offset;        ///< element offset inside the unit's compute section, a multiple of 64
  int64_t state_offset;  ///< element offset inside the unit's fp32 sections (-1: frozen); equal to
                         ///< offset in a unit without frozen entries
};

class HostStore : public std::enable_shared_from_this<HostStore> {
 public:
  static constexpr int64_t kAlignElements = 64;
  static constexpr int64_t kSectionAlignBytes = 4096;
  /// With skew_sections, a unit whose fp32 sections are >= kSkewMinSectionBytes starts section s
  /// at an arena offset == kSkewBaseBytes + s * kSkewStepBytes (mod kSkewPeriodBytes), padding
  /// before it as needed (< kSkewPeriodBytes, zero, unused): element i of master / exp_avg /
  /// exp_avg_sq / grad_accum is then never a multiple of a large power of two away from the same
  /// element of another section (model dimensions make back-to-back sections exactly that, and
  /// streaming such arrays together loses a large share of the host bandwidth to cache-set and
  /// DRAM-bank conflicts), and the bf16 compute section is off the 2 MiB-aligned staging buffers
  /// (pinned_empty) that carry bf16 gradients. Smaller units stay back to back.
  static constexpr int64_t kSkewMinSectionBytes = int64_t{16} << 20;
  static constexpr int64_t kSkewPeriodBytes = int64_t{256} << 10;
  static constexpr int64_t kSkewStepBytes = 17 * 4096;
  static constexpr int64_t kSkewBaseBytes = 8 * 4096;

  /// \brief Plans the layout, checks the host budget, then maps (and optionally pins) one arena.
  /// \throws std::invalid_argument for negative dimensions or sizes that overflow int64.
  /// \throws HostMemoryError if the arena does not fit (nothing allocated).
  HostStore(std::vector<UnitSpec> units, HostStoreOptions options);
  ~HostStore();
  HostStore(const HostStore&) = delete;
  HostStore& operator=(const HostStore&) = delete;

  /// \brief Arena bytes the given units and options need (what the budget check compares).
  static int64_t bytes_required(const std::vector<UnitSpec>& units, const HostStoreOptions& options);
  /// \brief The whole layout the given units and options produce (sizes per section and unit),
  /// from the same planning as the constructor; nothing allocated.
  /// \throws std::invalid_argument for negative dimensions or sizes that overflow int64.
  static StoreLayout layout_required(const std::vector<UnitSpec>& units, const HostStoreOptions& options);

  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  /// \brief Padded flat length (elements) of the compute section of unit u.
  int64_t unit_numel(int64_t u) const;
  /// \brief Padded flat length (elements) of the fp32 sections of unit u (== unit_numel without
  /// frozen entries).
  int64_t unit_state_numel(int64_t u) const;
  const std::vector<Entry>& entries(int64_t u) const;
  bool has_section(Section s) const;
  /// \brief Whether unit u's fp32 sections are kept outside the store (HostStoreOptions::state_offloaded).
  bool state_offloaded(int64_t u) const;
  /// \brief Whether unit u has no compute section in the store (HostStoreOptions::compute_absent).
  bool compute_absent(int64_t u) const;
  /// \brief Start of section s of unit u (4 KiB aligned).
  /// \throws std::out_of_range for a bad unit; std::invalid_argument for an absent section (an
  ///         fp32 section of a unit whose fp32 state is offloaded, the compute section of a unit
  ///         with compute_absent, included).
  void* section_data(int64_t u, Section s) const;
  /// \brief Bytes per element of section s (2 for a bf16 compute section, else 4).
  int64_t element_size(Section s) const;
  /// \brief Bytes of section s in unit u including its padding up to 4 KiB (not the skew gap
  /// before it, see kSkewMinSectionBytes).
  int64_t unit_section_bytes(int64_t u, Section s) const;
  /// \brief Bytes of section s summed over all units (0 when absent).
  int64_t section_bytes(Section s) const;
  int64_t total_bytes() const { return total_bytes_; }
  int64_t pinned_bytes() const { return is_pinned() ? total_bytes_ : 0; }
  bool is_pinned() const { return arena_ && arena_->is_pinned(); }
  /// \brief Unpadded parameter count summed over all entries.
  int64_t total_numel() const { return total_numel_; }
  /// \brief Unpadded parameter count of the frozen entries.
  int64_t frozen_numel() const { return frozen_numel_; }
  /// \brief Page-lock the arena now (a store created with pin=false, filled first).
  /// \return whether it is pinned afterwards. \throws std::runtime_error if page-locking fails.
  bool pin() { return arena_ ? arena_->pin() : false; }
  /// \brief total_bytes / total_numel (0 when there are no parameters).
  double bytes_per_param() const;
  const HostStoreOptions& options() const { return options_; }
  void* arena_data() const { return arena_ ? arena_->data() : nullptr; }
  bool hugepage_advised() const { return arena_ && arena_->hugepage_advised(); }
  bool is_shared() const { return arena_ && arena_->is_shared(); }

 private:
  struct UnitLayout {
    std::vector<Entry> entries;
    int64_t numel = 0;        ///< compute section elements
    int64_t state_numel = 0;  ///< fp32 section elements
    bool state_offloaded = false;  ///< the fp32 sections are not in the arena
    bool compute_absent = false;   ///< the compute section is not in the arena
    int64_t base_bytes = 0;  ///< byte offset of the unit block in the arena
    std::array<int64_t, kNumSections> section_offset_bytes{};  ///< relative to base
    std::array<int64_t, kNumSections> section_bytes{};
  };
  static std::vector<UnitLayout> plan(const std::vector<UnitSpec>& units,
                                      const HostStoreOptions& options, int64_t* total_bytes,
                                      int64_t* total_numel, int64_t* frozen_numel = nullptr);
  void check_unit(int64_t u) const;

  HostStoreOptions options_;
  std::vector<UnitLayout> units_;
  int64_t total_bytes_ = 0;
  int64_t total_numel_ = 0;
  int64_t frozen_numel_ = 0;
  std::unique_ptr<PinnedBuffer> arena_;
};

}  // namespace host_store
}  // namespace megatrain
