// Host memory budget: what the OS / cgroup / locked-memory limit lets us allocate, checked
// before any large allocation so failures are a clear error instead of an OOM kill.
#pragma once

#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>

namespace megatrain {
namespace host_store {

/// \brief Thrown when a requested host allocation does not fit a memory limit (nothing allocated).
class HostMemoryError : public std::runtime_error {
 public:
  HostMemoryError(const std::string& message, int64_t needed_bytes, int64_t available_bytes,
                  std::string limit_name)
      : std::runtime_error(message),
        needed_bytes_(needed_bytes),
        available_bytes_(available_bytes),
        limit_name_(std::move(limit_name)) {}
  int64_t needed_bytes() const { return needed_bytes_; }
  int64_t available_bytes() const { return available_bytes_; }
  const std::string& limit_name() const { return limit_name_; }

 private:
  int64_t needed_bytes_;
  int64_t available_bytes_;
  std::string limit_name_;
};

/// \brief Snapshot of the host memory limits that apply to this process.
struct MemoryAvailability {
  int64_t mem_available_bytes = -1;               ///< MemAvailable from /proc/meminfo (-1: unknown)
  std::optional<int64_t> cgroup_limit_bytes;      ///< cgroup v2 memory.max or v1 limit (none: unlimited)
  std::optional<int64_t> cgroup_usage_bytes;      ///< cgroup memory.current / usage_in_bytes
  std::optional<int64_t> memlock_bytes;           ///< soft RLIMIT_MEMLOCK (none: unlimited)
  std::string cgroup_path;                        ///< file the cgroup limit was read from
};

/// \brief Reads /proc/meminfo, the process's cgroup (v2, then v1) and RLIMIT_MEMLOCK.
MemoryAvailability query_memory_availability();

/// \brief The first host limit an allocation would exceed (see host_budget_shortfall).
struct BudgetShortfall {
  int64_t available_bytes = 0;  ///< bytes available under that limit (without the credit)
  std::string limit;            ///< its name, as the error message says it
  std::string kind;             ///< "memory" or "memlock"
  std::string advice;           ///< what to change
  int64_t credit_bytes = 0;     ///< reclaimable bytes counted as available
};

/// \brief The first limit of `m` that `needed_bytes` (of which `pinned_bytes` page-locked) would
/// exceed, or none: MemAvailable, then the cgroup limit minus its usage (both plus
/// `reclaimable_bytes`, memory the caller frees while the allocation is filled), then
/// RLIMIT_MEMLOCK for `pinned_bytes`. The one set of budget rules (check_host_budget and the
/// Python side, megatrain.runtime.host_memory, use it).
std::optional<BudgetShortfall> host_budget_shortfall(int64_t needed_bytes, int64_t pinned_bytes,
                                                     int64_t reclaimable_bytes,
                                                     const MemoryAvailability& m);

/// \brief Throws the HostMemoryError for `short_fall`: "megatrain <what>: needs N bytes ... only A
/// bytes are available under the <limit>. <advice> Nothing was allocated."
[[noreturn]] void throw_budget_error(const std::string& what, int64_t needed_bytes,
                                     const BudgetShortfall& short_fall);

/// \brief True when MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1 (VMs that grow RAM lazily).
bool host_memory_check_disabled();

/// \brief Checks that `needed_bytes` more bytes fit in host memory.
///
/// \param[in] needed_bytes bytes about to be allocated.
/// \param[in] will_pin whether they will be page-locked (then RLIMIT_MEMLOCK applies too).
/// \param[in] memory_limit_bytes if >= 0, replaces the MemAvailable / cgroup checks.
/// \param[in] what who allocates, for the message ("HostStore", "pinned buffer").
/// \param[in] system_limits false: only the memory_limit_bytes override is checked (the caller
///            checked these bytes against the system limits itself, with a credit of its own).
/// \throws HostMemoryError naming bytes needed vs available, which limit, and what to change.
/// The MemAvailable / cgroup / memlock checks are skipped when host_memory_check_disabled().
void check_host_budget(int64_t needed_bytes, bool will_pin, int64_t memory_limit_bytes,
                       const std::string& what, bool system_limits = true);

/// \brief Bytes of transparent huge pages backing [addr, addr + bytes): the AnonHugePages of
/// every mapping (/proc/self/smaps) that overlaps the range, each clamped to its overlap (exact
/// when the range is one whole mapping, an estimate when a mapping is shared with other data).
/// \return -1 if /proc/self/smaps cannot be read.
int64_t huge_page_bytes(const void* addr, int64_t bytes);

/// \brief The kernel's THP mode: the bracketed word of /sys/kernel/mm/transparent_hugepage/enabled
/// ("always", "madvise", "never"), or "unknown".
std::string transparent_hugepage_mode();

}  // namespace host_store
}  // namespace megatrain
