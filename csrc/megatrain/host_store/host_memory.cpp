#include "megatrain/host_store/host_memory.h"

#include <sys/resource.h>

#include <algorithm>
#include <cctype>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>

namespace megatrain {
namespace host_store {
namespace {

std::optional<std::string> read_first_line(const std::string& path) {
  std::ifstream f(path);
  if (!f) return std::nullopt;
  std::string line;
  std::getline(f, line);
  return line;
}

std::optional<int64_t> read_int_file(const std::string& path) {
  auto line = read_first_line(path);
  if (!line || line->empty() || *line == "max") return std::nullopt;
  try {
    return static_cast<int64_t>(std::stoll(*line));
  } catch (const std::exception&) {
    return std::nullopt;
  }
}

// Relative cgroup path of this process for the v2 unified hierarchy ("0::/path"), or
// for the v1 memory controller ("N:memory:/path").
std::string cgroup_relative_path(bool v2) {
  std::ifstream f("/proc/self/cgroup");
  std::string line;
  while (std::getline(f, line)) {
    const auto c1 = line.find(':');
    const auto c2 = line.find(':', c1 + 1);
    if (c1 == std::string::npos || c2 == std::string::npos) continue;
    const std::string controllers = line.substr(c1 + 1, c2 - c1 - 1);
    const std::string path = line.substr(c2 + 1);
    if (v2 && line.compare(0, 3, "0::") == 0) return path;
    if (!v2) {
      std::stringstream ss(controllers);
      std::string c;
      while (std::getline(ss, c, ',')) {
        if (c == "memory") return path;
      }
    }
  }
  return "/";
}

std::string human_gib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

[[noreturn]] void fail(const std::string& what, int64_t needed, int64_t available,
                       const std::string& limit, const std::string& advice) {
  std::ostringstream os;
  os << "megatrain " << what << ": needs " << needed << " bytes (" << human_gib(needed)
     << ") of host memory but only " << available << " bytes (" << human_gib(available)
     << ") are available under the " << limit << ". " << advice
     << " Nothing was allocated.";
  throw HostMemoryError(os.str(), needed, available, limit);
}

}  // namespace

MemoryAvailability query_memory_availability() {
  MemoryAvailability m;
  {
    std::ifstream f("/proc/meminfo");
    std::string key;
    int64_t kib = 0;
    std::string unit;
    while (f >> key >> kib) {
      std::getline(f, unit);
      if (key == "MemAvailable:") {
        m.mem_available_bytes = kib * 1024;
        break;
      }
    }
  }
  // cgroup v2: walk from our cgroup up to the root; the tightest ancestor limit applies.
  if (read_first_line("/sys/fs/cgroup/cgroup.controllers")) {
    std::string rel = cgroup_relative_path(true);
    for (;;) {
      const std::string dir = "/sys/fs/cgroup" + (rel == "/" ? std::string() : rel);
      auto limit = read_int_file(dir + "/memory.max");
      if (limit) {
        auto usage = read_int_file(dir + "/memory.current");
        const int64_t remaining = *limit - usage.value_or(0);
        const bool tighter = !m.cgroup_limit_bytes ||
                             remaining < *m.cgroup_limit_bytes - m.cgroup_usage_bytes.value_or(0);
        if (tighter) {
          m.cgroup_limit_bytes = limit;
          m.cgroup_usage_bytes = usage;
          m.cgroup_path = dir + "/memory.max";
        }
      }
      if (rel == "/" || rel.empty()) break;
      const auto slash = rel.find_last_of('/');
      rel = slash == 0 ? "/" : rel.substr(0, slash);
    }
  } else {
    // cgroup v1: an "unlimited" limit reads as a huge page-rounded number.
    const std::string rel = cgroup_relative_path(false);
    for (const std::string& dir : {"/sys/fs/cgroup/memory" + (rel == "/" ? std::string() : rel),
                                   std::string("/sys/fs/cgroup/memory")}) {
      auto limit = read_int_file(dir + "/memory.limit_in_bytes");
      if (limit && *limit < (int64_t{1} << 60)) {
        m.cgroup_limit_bytes = limit;
        m.cgroup_usage_bytes = read_int_file(dir + "/memory.usage_in_bytes");
        m.cgroup_path = dir + "/memory.limit_in_bytes";
        break;
      }
    }
  }
  struct rlimit rl;
  if (getrlimit(RLIMIT_MEMLOCK, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    m.memlock_bytes = static_cast<int64_t>(rl.rlim_cur);
  }
  return m;
}

bool host_memory_check_disabled() {
  const char* env = std::getenv("MEGATRAIN_SKIP_HOST_MEMORY_CHECK");
  return env != nullptr && std::string(env) == "1";
}

void check_host_budget(int64_t needed_bytes, bool will_pin, int64_t memory_limit_bytes,
                       const std::string& what, bool system_limits) {
  if (memory_limit_bytes >= 0 && needed_bytes > memory_limit_bytes) {
    fail(what, needed_bytes, memory_limit_bytes, "memory_limit_bytes override",
         "Raise memory_limit_bytes, or pass -1 to check against the system limits instead.");
  }
  if (!system_limits || host_memory_check_disabled()) return;
  MemoryAvailability m = query_memory_availability();
  if (memory_limit_bytes >= 0) {  // the override replaces the MemAvailable / cgroup checks
    m.mem_available_bytes = -1;
    m.cgroup_limit_bytes.reset();
  }
  const auto short_fall = host_budget_shortfall(needed_bytes, will_pin ? needed_bytes : 0, 0, m);
  if (short_fall) throw_budget_error(what, needed_bytes, *short_fall);
}

std::optional<BudgetShortfall> host_budget_shortfall(int64_t needed_bytes, int64_t pinned_bytes,
                                                     int64_t reclaimable_bytes,
                                                     const MemoryAvailability& m) {
  const int64_t credit = std::max<int64_t>(0, reclaimable_bytes);
  const std::string freed =
      credit ? " (plus " + std::to_string(credit) + " bytes (" + human_gib(credit) +
                   ") of the model's own weights, freed while the store is filled)"
             : std::string();
  if (m.mem_available_bytes >= 0 && needed_bytes > m.mem_available_bytes + credit) {
    return BudgetShortfall{m.mem_available_bytes, "MemAvailable limit (/proc/meminfo)" + freed, "memory",
                           "Free host memory or train a smaller model; if this VM grows its RAM lazily, set "
                           "MEGATRAIN_SKIP_HOST_MEMORY_CHECK=1.",
                           credit};
  }
  if (m.cgroup_limit_bytes) {
    const int64_t remaining = *m.cgroup_limit_bytes - m.cgroup_usage_bytes.value_or(0);
    if (needed_bytes > remaining + credit) {
      return BudgetShortfall{remaining, "cgroup memory limit (" + m.cgroup_path + ", minus current usage)" + freed,
                             "memory", "Raise the container's memory limit or train a smaller model.", credit};
    }
  }
  if (pinned_bytes > 0 && m.memlock_bytes && pinned_bytes > *m.memlock_bytes) {
    return BudgetShortfall{*m.memlock_bytes, "locked-memory limit (RLIMIT_MEMLOCK, ulimit -l)", "memlock",
                           "Raise it (ulimit -l unlimited, docker --ulimit memlock=-1).", 0};
  }
  return std::nullopt;
}

void throw_budget_error(const std::string& what, int64_t needed_bytes, const BudgetShortfall& short_fall) {
  fail(what, needed_bytes, short_fall.available_bytes, short_fall.limit, short_fall.advice);
}

int64_t huge_page_bytes(const void* addr, int64_t bytes) {
  std::ifstream f("/proc/self/smaps");
  if (!f) return -1;
  const uint64_t lo = reinterpret_cast<uintptr_t>(addr);
  const uint64_t hi = lo + static_cast<uint64_t>(bytes < 0 ? 0 : bytes);
  int64_t total = 0;
  uint64_t overlap = 0;  // bytes of the current mapping inside [lo, hi)
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty()) continue;
    const auto dash = line.find('-');
    const auto space = line.find(' ');
    if (dash != std::string::npos && space != std::string::npos && dash < space &&
        std::isxdigit(static_cast<unsigned char>(line[0]))) {
      // A mapping header: "start-end perms offset dev inode [path]".
      const uint64_t start = std::stoull(line.substr(0, dash), nullptr, 16);
      const uint64_t end = std::stoull(line.substr(dash + 1, space - dash - 1), nullptr, 16);
      const uint64_t a = std::max(start, lo), b = std::min(end, hi);
      overlap = b > a ? b - a : 0;
      continue;
    }
    if (overlap > 0 && line.compare(0, 14, "AnonHugePages:") == 0) {
      const int64_t kib = std::stoll(line.substr(14));
      total += std::min<int64_t>(kib * 1024, static_cast<int64_t>(overlap));
    }
  }
  return total;
}

std::string transparent_hugepage_mode() {
  auto line = read_first_line("/sys/kernel/mm/transparent_hugepage/enabled");
  if (!line) return "unknown";
  const auto open = line->find('[');
  const auto close = line->find(']', open);
  if (open == std::string::npos || close == std::string::npos) return "unknown";
  return line->substr(open + 1, close - open - 1);
}

}  // namespace host_store
}  // namespace megatrain
