#include "megatrain/disk_tier/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <memory>
#include <random>
#include <sstream>

#include "megatrain/host_store/host_memory.h"

namespace megatrain {
namespace disk_tier {
namespace {

constexpr char kMagic[8] = {'M', 'T', 'T', 'I', 'E', 'R', '\0', '\1'};
constexpr uint32_t kVersion = 1;

// The first bytes of every tier file; the rest of its 4 KiB page is zero.
struct FileHeader {
  char magic[8];
  uint32_t version;
  uint32_t header_bytes;
  uint64_t run_id[2];
  int64_t unit;
  int64_t num_units;
  int64_t file_bytes;
  int64_t num_sections;
  int64_t section_bytes[DiskTier::kMaxSections];
  char note[160];
};
static_assert(sizeof(FileHeader) <= DiskTier::kHeaderBytes, "header must fit its page");

constexpr const char* kNote =
    "megatrain disk tier working area: not a checkpoint; valid only while its run is alive";

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string gib(int64_t bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.2f GiB", static_cast<double>(bytes) / (1024.0 * 1024.0 * 1024.0));
  return buf;
}

const char* errno_name(int e) {
  switch (e) {
    case ENOSPC: return "ENOSPC";
    case EDQUOT: return "EDQUOT";
    case EFBIG: return "EFBIG";
    case EIO: return "EIO";
    case EINVAL: return "EINVAL";
    case EACCES: return "EACCES";
    case EROFS: return "EROFS";
    case EBADF: return "EBADF";
    default: return "errno";
  }
}

std::string errno_text(int e) { return std::string(std::strerror(e)) + " (" + errno_name(e) + ")"; }

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedPage = std::unique_ptr<char, FreeDeleter>;

char* aligned_alloc_or_throw(int64_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, DiskTier::kAlignBytes, static_cast<size_t>(std::max<int64_t>(bytes, 1))) != 0) {
    throw std::bad_alloc();
  }
  return static_cast<char*>(p);
}

bool is_tier_file_name(const std::string& name) {
  const std::string prefix = DiskTier::kFilePrefix, suffix = DiskTier::kFileSuffix;
  return name.size() > prefix.size() + suffix.size() && name.compare(0, prefix.size(), prefix) == 0 &&
         name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Closes an fd unless released (constructor paths that throw).
struct FdGuard {
  int fd = -1;
  ~FdGuard() {
    if (fd >= 0) ::close(fd);
  }
  int release() {
    const int f = fd;
    fd = -1;
    return f;
  }
};

// Opens dir and takes its exclusive advisory lock, or throws naming the other user.
int lock_dir(const std::string& dir) {
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) {
    const int e = errno;
    throw DiskTierError("megatrain DiskTier: cannot open directory " + dir + ": " + errno_text(e) +
                            ". Pass an offload_dir this process can read and write.",
                        e);
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    ::close(fd);
    throw DiskTierError("megatrain DiskTier: " + dir +
                            " is in use by another disk tier (this or another process holds its "
                            "lock); give each run its own offload_dir.",
                        e);
  }
  return fd;
}

}  // namespace

std::vector<UnitLayout> state_layouts(const host_store::StoreLayout& layout, bool with_grad_accum,
                                      const std::vector<int64_t>& units) {
  std::vector<int64_t> pick = units;
  if (pick.empty()) {
    for (size_t u = 0; u < layout.unit_state_numel.size(); ++u) pick.push_back(static_cast<int64_t>(u));
  }
  std::vector<UnitLayout> out;
  for (int64_t u : pick) {
    if (u < 0 || u >= static_cast<int64_t>(layout.unit_state_numel.size())) {
      throw std::out_of_range("state_layouts: unit " + std::to_string(u) + " out of range [0, " +
                              std::to_string(layout.unit_state_numel.size()) + ")");
    }
    const int64_t bytes = layout.unit_state_numel[u] * 4;
    UnitLayout l;
    l.section_bytes.assign(with_grad_accum ? 4 : 3, bytes);
    out.push_back(std::move(l));
  }
  return out;
}

int64_t DiskTier::file_bytes(const UnitLayout& unit) {
  int64_t total = kHeaderBytes;
  for (int64_t b : unit.section_bytes) total += round_up(b, kAlignBytes);
  return total;
}

int64_t DiskTier::bytes_required(const std::vector<UnitLayout>& units) {
  int64_t total = 0;
  for (const UnitLayout& u : units) total += file_bytes(u);
  return total;
}

int64_t DiskTier::pool_bytes(const std::vector<UnitLayout>& units, int64_t num_buffers) {
  int64_t largest = 0;
  for (const UnitLayout& u : units) largest = std::max(largest, file_bytes(u));
  return largest * num_buffers;
}

int64_t DiskTier::free_bytes(const std::string& dir) {
  std::filesystem::path p = dir.empty() ? std::filesystem::path(".") : std::filesystem::path(dir);
  p = std::filesystem::absolute(p);
  struct stat st;
  while (::stat(p.c_str(), &st) != 0 && p.has_parent_path() && p != p.parent_path()) p = p.parent_path();
  struct statvfs vfs;
  if (::statvfs(p.c_str(), &vfs) != 0) {
    const int e = errno;
    throw DiskTierError("megatrain DiskTier: statvfs(" + p.string() + ") failed: " + errno_text(e), e);
  }
  return static_cast<int64_t>(vfs.f_bavail) * static_cast<int64_t>(vfs.f_frsize);
}

DiskTier::DiskTier(std::string dir, std::vector<UnitLayout> units, DiskTierOptions options)
    : dir_(std::move(dir)), units_(std::move(units)), options_(std::move(options)) {
  // Checks, in the documented order; nothing is created before all of them have passed.
  validate_options();
  validate_layout();
  const bool dir_exists = directory_exists();
  FdGuard dir_lock;
  StaleFiles stale;
  if (dir_exists) {
    dir_lock.fd = lock_dir(dir_);
    stale = find_stale_files();
  }
  check_free_space(stale.bytes);
  check_pool_memory();

  // Creation. From here on a failure removes what was made.
  if (!dir_exists) {
    create_directory();
    dir_lock.fd = lock_dir(dir_);
  }
  dir_fd_ = dir_lock.release();
  for (const std::string& path : stale.paths) {
    if (::unlink(path.c_str()) == 0) ++stale_removed_;
  }
  std::random_device rd;
  for (auto& w : run_id_) w = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  state_.resize(units_.size());
  try {
    allocate_buffers();
    create_unit_files();
  } catch (...) {
    remove_files();
    throw;
  }
  for (int64_t t = 0; t < options_.io_threads; ++t) threads_.emplace_back([this] { io_loop(); });
}

void DiskTier::validate_options() {
  if (dir_.empty()) throw std::invalid_argument("DiskTier: dir must be a directory path, got an empty string");
  if (options_.num_buffers < 1) {
    throw std::invalid_argument("DiskTier: num_buffers must be >= 1, got " + std::to_string(options_.num_buffers));
  }
  if (options_.io_threads < 1 || options_.io_threads > 256) {
    throw std::invalid_argument("DiskTier: io_threads must be in 1..256, got " + std::to_string(options_.io_threads));
  }
  if (options_.chunk_bytes < 1) {
    throw std::invalid_argument("DiskTier: chunk_bytes must be >= 1, got " + std::to_string(options_.chunk_bytes));
  }
  options_.chunk_bytes = round_up(options_.chunk_bytes, kAlignBytes);
}

void DiskTier::validate_layout() {
  constexpr int64_t kMaxSectionBytes = int64_t{1} << 50;
  section_offset_.resize(units_.size());
  for (size_t u = 0; u < units_.size(); ++u) {
    const auto& secs = units_[u].section_bytes;
    if (static_cast<int64_t>(secs.size()) > kMaxSections) {
      throw std::invalid_argument("DiskTier: unit " + std::to_string(u) + " has " + std::to_string(secs.size()) +
                                  " sections, at most " + std::to_string(kMaxSections) + " are supported");
    }
    int64_t off = 0;
    for (int64_t b : secs) {
      if (b < 0 || b > kMaxSectionBytes) {
        throw std::invalid_argument("DiskTier: unit " + std::to_string(u) + " has a section of " +
                                    std::to_string(b) + " bytes; sizes must be in 0..2^50");
      }
      section_offset_[u].push_back(off);
      off += round_up(b, kAlignBytes);
    }
    buffer_bytes_ = std::max(buffer_bytes_, file_bytes(units_[u]));
  }
  if (units_.empty()) buffer_bytes_ = kHeaderBytes;
  if (buffer_bytes_ > std::numeric_limits<int64_t>::max() / options_.num_buffers) {
    throw std::invalid_argument("DiskTier: num_buffers * unit bytes overflows int64");
  }
}

bool DiskTier::directory_exists() const {
  std::error_code ec;
  const bool exists = std::filesystem::exists(dir_, ec);
  if (exists && !std::filesystem::is_directory(dir_, ec)) {
    throw std::invalid_argument("DiskTier: " + dir_ + " exists and is not a directory; pass a directory path");
  }
  return exists;
}

DiskTier::StaleFiles DiskTier::find_stale_files() const {
  StaleFiles stale;
  std::error_code ec;
  for (const auto& ent : std::filesystem::directory_iterator(dir_, ec)) {
    const std::string name = ent.path().filename().string();
    if (!is_tier_file_name(name)) continue;
    FileHeader h{};
    bool ours = false;
    const int fd = ::open(ent.path().c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
      ours = ::pread(fd, &h, sizeof(h), 0) == static_cast<ssize_t>(sizeof(h)) &&
             std::memcmp(h.magic, kMagic, sizeof(kMagic)) == 0;
      struct stat st;
      if (ours && ::fstat(fd, &st) == 0) stale.bytes += static_cast<int64_t>(st.st_blocks) * 512;
      ::close(fd);
    }
    if (!ours) {
      throw DiskTierError("megatrain DiskTier: " + ent.path().string() +
                              " has a disk-tier file name but is not a disk-tier file; it was left "
                              "alone. Move it or choose another offload_dir.",
                          0);
    }
    stale.paths.push_back(ent.path().string());
  }
  std::sort(stale.paths.begin(), stale.paths.end());
  if (!stale.paths.empty() && options_.stale == StalePolicy::kRefuse) {
    throw DiskTierError("megatrain DiskTier: " + dir_ + " holds " + std::to_string(stale.paths.size()) +
                            " disk-tier files of an earlier run (" + stale.paths.front() +
                            ", ...); they are a dead run's working area, not state. Remove them, "
                            "or open the tier with stale files removed.",
                        0);
  }
  return stale;
}

void DiskTier::check_free_space(int64_t stale_bytes) const {
  // The stale files count as free: they are removed before anything is written.
  const int64_t needed = bytes_required(units_);
  const int64_t free_now = free_bytes(dir_);
  if (needed > free_now + stale_bytes) {
    std::ostringstream os;
    os << "megatrain DiskTier: the files under " << dir_ << " need " << needed << " bytes (" << gib(needed)
       << ") but the filesystem has only " << free_now + stale_bytes << " bytes ("
       << gib(free_now + stale_bytes)
       << ") free. Free space there, point offload_dir at a larger disk, or keep more layers "
          "in host memory. Nothing was written.";
    throw DiskSpaceError(os.str(), needed, free_now + stale_bytes);
  }
}

void DiskTier::check_pool_memory() const {
  const int64_t pool = buffer_bytes_ * options_.num_buffers;
  host_store::check_host_budget(pool, /*will_pin=*/false, options_.memory_limit_bytes, "DiskTier buffer pool");
}

void DiskTier::create_directory() {
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    throw DiskTierError("megatrain DiskTier: cannot create directory " + dir_ + ": " + ec.message(), ec.value());
  }
  created_dir_ = true;
}

void DiskTier::allocate_buffers() {
  buffers_.reserve(options_.num_buffers);
  for (int64_t b = 0; b < options_.num_buffers; ++b) {
    buffers_.push_back(aligned_alloc_or_throw(buffer_bytes_));
    buffer_owner_.push_back(-1);
  }
}

void DiskTier::create_unit_files() {
  AlignedPage page(aligned_alloc_or_throw(kHeaderBytes));
  direct_io_ = options_.direct_io;
  if (!options_.direct_io) direct_io_note_ = "O_DIRECT not requested (direct_io=false)";
  for (size_t u = 0; u < units_.size(); ++u) {
    const std::string path = unit_path(static_cast<int64_t>(u));
    state_[u].fd = open_unit_file(path);
    if (options_.preallocate) preallocate_unit_file(static_cast<int64_t>(u), path);
    write_unit_header(static_cast<int64_t>(u), page.get(), path);
  }
}

int DiskTier::open_unit_file(const std::string& path) {
  const int base_flags = O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC;
  int fd = ::open(path.c_str(), base_flags | (direct_io_ ? O_DIRECT : 0), 0600);
  if (fd < 0 && direct_io_ && errno == EINVAL) {
    direct_io_ = false;
    direct_io_note_ = "the filesystem of " + dir_ + " refuses O_DIRECT (open: EINVAL); buffered I/O "
                      "through the page cache is used, so bandwidth numbers include the cache";
    fd = ::open(path.c_str(), base_flags, 0600);
  }
  if (fd < 0) {
    const int e = errno;
    throw DiskTierError("megatrain DiskTier: cannot create " + path + ": " + errno_text(e) +
                            ". Check that offload_dir is writable and has space.",
                        e);
  }
  return fd;
}

void DiskTier::preallocate_unit_file(int64_t u, const std::string& path) {
  const int fd = state_[u].fd;
  const int64_t fbytes = file_bytes(units_[u]);
  int rc = ::fallocate(fd, 0, 0, fbytes);
  if (rc != 0 && (errno == EOPNOTSUPP || errno == ENOSYS)) rc = ::ftruncate(fd, fbytes);
  if (rc != 0) {
    const int e = errno;
    throw DiskTierError("megatrain DiskTier: cannot allocate " + std::to_string(fbytes) + " bytes for " + path +
                            ": " + errno_text(e) + ". Free space under " + dir_ +
                            " or point offload_dir at a larger disk.",
                        e);
  }
}

void DiskTier::write_unit_header(int64_t u, char* page, const std::string& path) {
  const int fd = state_[u].fd;
  write_header(page, u);
  ssize_t w = ::pwrite(fd, page, kHeaderBytes, 0);
  if (w < 0 && errno == EINVAL && direct_io_) {
    // Some filesystems accept O_DIRECT at open and refuse it at the first transfer.
    direct_io_ = false;
    direct_io_note_ = "the filesystem of " + dir_ + " refuses O_DIRECT writes (EINVAL); buffered I/O "
                      "through the page cache is used, so bandwidth numbers include the cache";
    for (int64_t v = 0; v <= u; ++v) {
      const int fl = ::fcntl(state_[v].fd, F_GETFL);
      ::fcntl(state_[v].fd, F_SETFL, fl & ~O_DIRECT);
    }
    w = ::pwrite(fd, page, kHeaderBytes, 0);
  }
  if (w != kHeaderBytes) {
    const int e = w < 0 ? errno : ENOSPC;
    throw DiskTierError("megatrain DiskTier: cannot write the header of " + path + ": " + errno_text(e) +
                            ". Free space under " + dir_ + " or point offload_dir at a larger disk.",
                        e);
  }
}

DiskTier::~DiskTier() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  job_cv_.notify_all();
  state_cv_.notify_all();
  for (auto& t : threads_) t.join();
  remove_files();
}

void DiskTier::remove_files() noexcept {
  for (size_t u = 0; u < state_.size(); ++u) {
    if (state_[u].fd >= 0) {
      ::close(state_[u].fd);
      state_[u].fd = -1;
      ::unlink(unit_path(static_cast<int64_t>(u)).c_str());
    }
  }
  for (char* b : buffers_) std::free(b);
  buffers_.clear();
  if (dir_fd_ >= 0) {
    ::close(dir_fd_);
    dir_fd_ = -1;
  }
  if (created_dir_) {
    ::rmdir(dir_.c_str());  // only when empty
    created_dir_ = false;
  }
}

std::string DiskTier::unit_path(int64_t u) const {
  char name[64];
  std::snprintf(name, sizeof(name), "%s%06lld%s", kFilePrefix, static_cast<long long>(u), kFileSuffix);
  return dir_ + "/" + name;
}

const UnitLayout& DiskTier::layout(int64_t u) const {
  check_unit(u);
  return units_[u];
}

void DiskTier::write_header(char* page, int64_t u) const {
  std::memset(page, 0, kHeaderBytes);
  FileHeader h{};
  std::memcpy(h.magic, kMagic, sizeof(kMagic));
  h.version = kVersion;
  h.header_bytes = kHeaderBytes;
  h.run_id[0] = run_id_[0];
  h.run_id[1] = run_id_[1];
  h.unit = u;
  h.num_units = num_units();
  h.file_bytes = file_bytes(units_[u]);
  h.num_sections = static_cast<int64_t>(units_[u].section_bytes.size());
  for (int64_t s = 0; s < h.num_sections; ++s) h.section_bytes[s] = units_[u].section_bytes[s];
  std::snprintf(h.note, sizeof(h.note), "%s", kNote);
  std::memcpy(page, &h, sizeof(h));
}

void DiskTier::check_unit(int64_t u) const {
  if (u < 0 || u >= num_units()) {
    throw std::out_of_range("DiskTier: unit " + std::to_string(u) + " out of range [0, " +
                            std::to_string(num_units()) + ")");
  }
}

void DiskTier::check_failed_locked() const {
  if (failure_) std::rethrow_exception(failure_);
}

void DiskTier::fail_locked(std::exception_ptr error) {
  if (!failure_) failure_ = std::move(error);
  state_cv_.notify_all();
}

std::string DiskTier::io_error(IoOp op, int64_t u, int64_t offset, int64_t bytes, int err,
                               const std::string& detail) const {
  std::ostringstream os;
  os << "megatrain DiskTier: " << (op == IoOp::kRead ? "read" : "write") << " of " << unit_path(u) << " (unit "
     << u << ", " << bytes << " bytes at offset " << offset << ") failed: ";
  if (!detail.empty()) {
    os << detail;
  } else {
    os << errno_text(err);
  }
  os << ". ";
  switch (err) {
    case ENOSPC:
    case EDQUOT:
      os << "The disk is full: free space under " << dir_ << " or point offload_dir at a larger disk.";
      break;
    case EFBIG:
      os << "The file-size limit (ulimit -f, RLIMIT_FSIZE) is below the tier's file size: raise it.";
      break;
    case EIO:
      os << "The device reported an I/O error: check the disk (dmesg) or use another offload_dir.";
      break;
    default:
      break;
  }
  os << " The disk tier is unusable now; restart from the last checkpoint.";
  return os.str();
}

int64_t DiskTier::take_buffer_locked(bool for_prefetch) {
  for (int64_t b = 0; b < options_.num_buffers; ++b) {
    if (buffer_owner_[b] < 0) return b;
  }
  int64_t victim = -1;
  for (int64_t b = 0; b < options_.num_buffers; ++b) {
    const Unit& s = state_[buffer_owner_[b]];
    if (s.state != State::kCached || s.acquire_waiting || (for_prefetch && s.prefetch_wanted)) continue;
    if (victim < 0) {
      victim = b;
      continue;
    }
    const Unit& v = state_[buffer_owner_[victim]];
    if (std::make_pair(s.prefetch_wanted, s.last_use) < std::make_pair(v.prefetch_wanted, v.last_use)) victim = b;
  }
  if (victim < 0) return -1;
  Unit& evicted = state_[buffer_owner_[victim]];
  evicted.state = State::kOnDisk;
  evicted.buffer = -1;
  evicted.prefetch_wanted = false;
  buffer_owner_[victim] = -1;
  return victim;
}

void DiskTier::start_io_locked(int64_t u, IoOp op) {
  Unit& s = state_[u];
  const int64_t total = file_bytes(units_[u]);
  int64_t n = 0;
  for (int64_t off = 0; off < total; off += options_.chunk_bytes, ++n) {
    Job j{op, u, off, std::min(options_.chunk_bytes, total - off)};
    (op == IoOp::kRead ? read_jobs_ : write_jobs_).push_back(j);
  }
  s.pending_chunks = n;
  s.io_start = now_seconds();
  s.state = op == IoOp::kRead ? State::kReading : State::kWriting;
  job_cv_.notify_all();
}

void DiskTier::serve_prefetches_locked() {
  while (!prefetch_queue_.empty() && buffer_waiters_ == 0 && !failure_) {
    const int64_t u = prefetch_queue_.front();
    Unit& s = state_[u];
    if (s.state != State::kOnDisk || !s.prefetch_wanted) {
      prefetch_queue_.pop_front();
      continue;
    }
    const int64_t b = take_buffer_locked(/*for_prefetch=*/true);
    if (b < 0) return;
    prefetch_queue_.pop_front();
    buffer_owner_[b] = u;
    s.buffer = b;
    start_io_locked(u, IoOp::kRead);
  }
}

void DiskTier::prefetch(int64_t u) {
  std::lock_guard<std::mutex> lk(mu_);
  check_failed_locked();
  check_unit(u);
  Unit& s = state_[u];
  if (s.state == State::kCached || s.state == State::kReading || s.state == State::kWriting) {
    // In RAM already (or on its way there): nothing to read, but the caller wants it, so no other
    // prefetch may take its buffer before it is acquired. Without this, a read-ahead of the unit
    // after it (prefetch(u); prefetch(v) with u cached) could evict u to read v; u's acquire then
    // read it again, evicting v (wanted, but an acquire may take it), and v was read twice.
    s.prefetch_wanted = true;
    return;
  }
  if (s.state != State::kOnDisk || s.prefetch_wanted) return;
  s.prefetch_wanted = true;
  prefetch_queue_.push_back(u);
  serve_prefetches_locked();
}

std::vector<void*> DiskTier::acquire(int64_t u) {
  std::unique_lock<std::mutex> lk(mu_);
  check_failed_locked();
  check_unit(u);
  Unit& s = state_[u];
  if (s.state == State::kAcquired) {
    throw std::logic_error("DiskTier: unit " + std::to_string(u) +
                           " is acquired already; release it before acquiring it again");
  }
  const double t0 = now_seconds();
  bool zero_fill = false;
  s.acquire_waiting = true;
  struct Clear {  // a failure thrown from the wait (the lock is held then) clears it too
    bool* flag;
    ~Clear() {
      if (flag != nullptr) *flag = false;
    }
  } clear{&s.acquire_waiting};
  for (;;) {
    check_failed_locked();
    if (s.state == State::kCached) {
      ++stats_.cache_hits;
      break;
    }
    if (s.state == State::kEmpty || s.state == State::kOnDisk) {
      if (acquired_count_ >= options_.num_buffers) {
        throw std::logic_error("DiskTier: all " + std::to_string(options_.num_buffers) +
                               " buffers are acquired; release a unit before acquiring unit " +
                               std::to_string(u) + " (or create the tier with more num_buffers)");
      }
      const int64_t b = take_buffer_locked(/*for_prefetch=*/false);
      if (b >= 0) {
        buffer_owner_[b] = u;
        s.buffer = b;
        if (s.state == State::kEmpty) {
          zero_fill = true;
          ++stats_.zero_fills;
          break;
        }
        s.prefetch_wanted = false;
        start_io_locked(u, IoOp::kRead);
        continue;
      }
      ++buffer_waiters_;
      state_cv_.wait(lk);
      --buffer_waiters_;
      continue;
    }
    state_cv_.wait(lk);  // kReading or kWriting
  }
  s.state = State::kAcquired;
  s.prefetch_wanted = false;
  s.acquire_waiting = false;
  clear.flag = nullptr;  // cleared here, under the lock
  ++acquired_count_;
  stats_.acquire_wait_seconds += now_seconds() - t0;
  char* buf = buffers_[s.buffer];
  lk.unlock();
  // The unit is ours now: no other thread touches its buffer.
  if (zero_fill) {
    write_header(buf, u);
    std::memset(buf + kHeaderBytes, 0, static_cast<size_t>(file_bytes(units_[u]) - kHeaderBytes));
  }
  std::vector<void*> out;
  out.reserve(section_offset_[u].size());
  for (int64_t off : section_offset_[u]) out.push_back(buf + kHeaderBytes + off);
  return out;
}

void DiskTier::release(int64_t u, bool dirty) {
  std::lock_guard<std::mutex> lk(mu_);
  check_unit(u);
  Unit& s = state_[u];
  if (s.state != State::kAcquired) {
    throw std::logic_error("DiskTier: release of unit " + std::to_string(u) + " that is not acquired");
  }
  --acquired_count_;
  s.last_use = ++clock_;
  check_failed_locked();
  if (dirty) {
    s.synced = false;
    start_io_locked(u, IoOp::kWrite);
  } else if (s.on_disk) {
    s.state = State::kCached;
  } else {
    s.state = State::kEmpty;  // never written, not changed: still all zeros
    buffer_owner_[s.buffer] = -1;
    s.buffer = -1;
  }
  serve_prefetches_locked();
  state_cv_.notify_all();
}

void DiskTier::flush() {
  const double t0 = now_seconds();
  std::vector<int64_t> to_sync;
  {
    std::unique_lock<std::mutex> lk(mu_);
    state_cv_.wait(lk, [&] {
      if (failure_) return true;
      for (const Unit& s : state_) {
        if (s.state == State::kWriting) return false;
      }
      return true;
    });
    check_failed_locked();
    for (size_t u = 0; u < state_.size(); ++u) {
      if (!state_[u].synced) to_sync.push_back(static_cast<int64_t>(u));
    }
  }
  for (int64_t u : to_sync) {
    if (::fdatasync(state_[u].fd) != 0) {
      const int e = errno;
      std::lock_guard<std::mutex> lk(mu_);
      fail_locked(std::make_exception_ptr(DiskTierError(io_error(IoOp::kWrite, u, 0, 0, e, "fdatasync: " + errno_text(e)), e)));
      check_failed_locked();
    }
  }
  std::lock_guard<std::mutex> lk(mu_);
  for (int64_t u : to_sync) {
    if (state_[u].state != State::kWriting) state_[u].synced = true;
  }
  stats_.flush_seconds += now_seconds() - t0;
}

void DiskTier::check() const {
  std::lock_guard<std::mutex> lk(mu_);
  check_failed_locked();
}

void DiskTier::drop_cached() {
  std::unique_lock<std::mutex> lk(mu_);
  state_cv_.wait(lk, [&] {
    if (failure_) return true;
    for (const Unit& s : state_) {
      if (s.state == State::kReading || s.state == State::kWriting) return false;
    }
    return true;
  });
  check_failed_locked();
  for (Unit& s : state_) {
    if (s.state != State::kCached) continue;
    buffer_owner_[s.buffer] = -1;
    s.buffer = -1;
    s.state = State::kOnDisk;
    s.prefetch_wanted = false;
  }
  prefetch_queue_.clear();
}

void DiskTier::io_loop() {
  for (;;) {
    Job job;
    int fd;
    char* base;
    bool skip;
    {
      std::unique_lock<std::mutex> lk(mu_);
      job_cv_.wait(lk, [&] { return stop_ || !read_jobs_.empty() || !write_jobs_.empty(); });
      if (stop_) return;  // queued I/O is dropped: the files are removed next
      auto& q = read_jobs_.empty() ? write_jobs_ : read_jobs_;
      job = q.front();
      q.pop_front();
      ++jobs_running_;
      const Unit& s = state_[job.unit];
      fd = s.fd;
      base = buffers_[s.buffer];
      skip = static_cast<bool>(failure_);
    }
    std::exception_ptr error;
    if (!skip) {
      int err = 0;
      int64_t done = 0;
      if (options_.fault_hook) err = options_.fault_hook(job.op, job.unit, job.offset, job.bytes);
      while (err == 0 && done < job.bytes) {
        char* p = base + job.offset + done;
        const size_t n = static_cast<size_t>(job.bytes - done);
        const off_t off = static_cast<off_t>(job.offset + done);
        const ssize_t r = job.op == IoOp::kRead ? ::pread(fd, p, n, off) : ::pwrite(fd, p, n, off);
        if (r < 0) {
          if (errno == EINTR) continue;
          err = errno;
          break;
        }
        if (r == 0) break;
        done += r;
      }
      if (err != 0) {
        error = std::make_exception_ptr(DiskTierError(io_error(job.op, job.unit, job.offset + done,
                                                               job.bytes - done, err, ""), err));
      } else if (done < job.bytes) {
        const std::string detail =
            job.op == IoOp::kRead
                ? "short read (" + std::to_string(done) + " of " + std::to_string(job.bytes) +
                      " bytes): the file is shorter than this run wrote it (truncated or replaced by "
                      "another process)"
                : "short write (" + std::to_string(done) + " of " + std::to_string(job.bytes) +
                      " bytes): the disk is likely full";
        const int e = job.op == IoOp::kRead ? 0 : ENOSPC;
        error = std::make_exception_ptr(DiskTierError(io_error(job.op, job.unit, job.offset + done,
                                                               job.bytes - done, e, detail), e));
      }
    }
    finish_job(job, error);
  }
}

void DiskTier::finish_job(const Job& job, std::exception_ptr error) {
  std::lock_guard<std::mutex> lk(mu_);
  --jobs_running_;
  Unit& s = state_[job.unit];
  if (error) fail_locked(error);
  if (!failure_) {
    if (job.op == IoOp::kRead) {
      stats_.bytes_read += job.bytes;
    } else {
      stats_.bytes_written += job.bytes;
    }
  }
  if (--s.pending_chunks > 0) return;
  if (failure_) {
    state_cv_.notify_all();
    return;
  }
  const double dt = now_seconds() - s.io_start;
  if (job.op == IoOp::kRead) {
    FileHeader h;
    std::memcpy(&h, buffers_[s.buffer], sizeof(h));
    if (std::memcmp(h.magic, kMagic, sizeof(kMagic)) != 0 || h.version != kVersion ||
        h.run_id[0] != run_id_[0] || h.run_id[1] != run_id_[1] || h.unit != job.unit ||
        h.file_bytes != file_bytes(units_[job.unit])) {
      fail_locked(std::make_exception_ptr(DiskTierError(
          io_error(IoOp::kRead, job.unit, 0, kHeaderBytes, 0,
                   "the header is not this run's header of this unit (the file was overwritten by "
                   "another process)"),
          0)));
      return;
    }
    ++stats_.unit_reads;
    stats_.read_seconds += dt;
  } else {
    s.on_disk = true;
    ++stats_.unit_writes;
    stats_.write_seconds += dt;
  }
  s.state = State::kCached;
  s.last_use = ++clock_;
  serve_prefetches_locked();
  state_cv_.notify_all();
}

DiskTierStats DiskTier::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  return stats_;
}

std::string DiskTier::unit_state(int64_t u) const {
  std::lock_guard<std::mutex> lk(mu_);
  check_unit(u);
  switch (state_[u].state) {
    case State::kEmpty: return "empty";
    case State::kOnDisk: return "on_disk";
    case State::kReading: return "reading";
    case State::kCached: return "cached";
    case State::kAcquired: return "acquired";
    case State::kWriting: return "writing";
  }
  return "unknown";
}

}  // namespace disk_tier
}  // namespace megatrain
