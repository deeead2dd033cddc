// Disk tier: the fp32 training state (master, exp_avg, exp_avg_sq[, grad_accum]) of a set of
// units kept in one file per unit under a directory on local disk, moved through a bounded pool
// of aligned RAM buffers by a pool of I/O threads (pread / pwrite in large aligned chunks,
// O_DIRECT where the filesystem allows it). Torch-free.
//
// Use by an update task:  prefetch(u) early (read-ahead), acquire(u) before the unit's AdamW
// (RAM pointers to its sections), release(u, dirty) after it (write-behind when dirty),
// flush() before anything that needs the disk copies complete.
//
// Where each unit's state is valid (the invariants):
//   kEmpty    never written in this run: the state is all zeros; no buffer, nothing read from
//             disk (acquire hands out a zero-filled buffer without I/O).
//   kOnDisk   the file holds the state; no buffer.
//   kReading  a buffer is being filled from the file (prefetch or acquire); the file is valid.
//   kCached   a buffer and the file hold the same state (after a read, a clean release or a
//             finished write); the buffer may be taken for another unit at any time.
//   kAcquired the caller owns the buffer; the buffer is the only valid copy when the caller
//             writes into it. At most one acquire per unit at a time (a second one throws).
//   kWriting  the buffer holds the state, the file is being rewritten from it; acquire waits
//             for the write to finish (so a later acquire always sees the last released data,
//             from RAM or, once the buffer was reused, from the file).
// Pointers returned by acquire() are valid until the matching release().
//
// Files. The tier is a working area, not a checkpoint. Every file starts with a 4 KiB header
// (magic, format version, unit index, section layout, and a random 128-bit run id drawn when the
// tier is created); every read checks the header against this run, so a file of another run is
// never taken for state. Files are created fresh (preallocated) by the constructor and removed by
// the destructor. Files of a run that died (recognised by their magic) are removed by the next
// tier opened on the same directory (StalePolicy::kRemove, the default) or make it refuse
// (kRefuse); a file with a tier file's name but without the magic is never touched: the
// constructor refuses. While a tier is open its directory holds an advisory lock (flock), so a
// second tier on the same directory, in this or another process, refuses instead of deleting
// live files.
//
// Failures. Free space (statvfs) and the RAM pool (host budget) are checked before any file is
// created. An I/O error (ENOSPC, EIO, EFBIG, a short read or write, a header of another run) is
// captured and the tier fails for good: every later call throws DiskTierError with the first
// error's one-line message (the state of the units being written may be partial; the last
// checkpoint is what to resume from).
#pragma once

#include <array>
#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "megatrain/host_store/host_store.h"

namespace megatrain {
namespace disk_tier {

/// \brief An I/O or configuration failure of the tier. errno_value() is the errno behind it
/// (0: not a system error, e.g. a short read or a foreign header).
class DiskTierError : public std::runtime_error {
 public:
  DiskTierError(const std::string& message, int errno_value)
      : std::runtime_error(message), errno_value_(errno_value) {}
  int errno_value() const { return errno_value_; }

 private:
  int errno_value_;
};

/// \brief The directory's filesystem has less free space than the tier needs (nothing created).
class DiskSpaceError : public DiskTierError {
 public:
  DiskSpaceError(const std::string& message, int64_t needed_bytes, int64_t free_bytes)
      : DiskTierError(message, ENOSPC), needed_bytes_(needed_bytes), free_bytes_(free_bytes) {}
  int64_t needed_bytes() const { return needed_bytes_; }
  int64_t free_bytes() const { return free_bytes_; }

 private:
  int64_t needed_bytes_;
  int64_t free_bytes_;
};

/// \brief Byte sizes of one unit's sections, in file / buffer order (e.g. master, exp_avg,
/// exp_avg_sq[, grad_accum]); each is stored rounded up to 4 KiB.
struct UnitLayout {
  std::vector<int64_t> section_bytes;
};

/// \brief The fp32 sections of each unit of a host-store layout, in store order: master,
/// exp_avg, exp_avg_sq (and grad_accum when with_grad_accum), each unit_state_numel * 4 bytes.
/// What the integration hands the tier for the units it moves to disk (units: indices into
/// layout.unit_state_numel; empty: all).
/// \throws std::out_of_range for an index outside the layout.
std::vector<UnitLayout> state_layouts(const host_store::StoreLayout& layout, bool with_grad_accum,
                                      const std::vector<int64_t>& units = {});

enum class StalePolicy { kRemove, kRefuse };

/// \brief Which I/O a fault hook sees.
enum class IoOp { kRead, kWrite };

struct DiskTierOptions {
  int64_t num_buffers = 2;            ///< RAM buffers in the pool, each of max_file_bytes()
  int64_t io_threads = 4;             ///< threads doing pread / pwrite
  int64_t chunk_bytes = 8 << 20;      ///< bytes per pread / pwrite (rounded up to 4 KiB)
  bool direct_io = true;              ///< try O_DIRECT (falls back to buffered I/O, see direct_io())
  bool preallocate = true;            ///< fallocate each file at creation (ENOSPC then, not later)
  StalePolicy stale = StalePolicy::kRemove;
  int64_t memory_limit_bytes = -1;    ///< host budget override for the pool (check_host_budget)
  /// Tests only (empty in production: one branch per chunk). Called by an I/O thread before each
  /// chunk; a non-zero return is taken as that errno from the system call; it may also sleep.
  std::function<int(IoOp op, int64_t unit, int64_t offset, int64_t bytes)> fault_hook;
};

/// \brief Counters since construction (bytes and seconds of the I/O threads; waits of callers).
struct DiskTierStats {
  int64_t bytes_read = 0;
  int64_t bytes_written = 0;
  int64_t unit_reads = 0;          ///< units read from disk
  int64_t unit_writes = 0;         ///< units written to disk
  int64_t cache_hits = 0;          ///< acquires served from a buffer without a read
  int64_t zero_fills = 0;          ///< acquires of never-written units
  double read_seconds = 0;         ///< wall time from a unit's first read chunk issued to the last done
  double write_seconds = 0;
  double acquire_wait_seconds = 0; ///< time callers spent blocked in acquire
  double flush_seconds = 0;
};

class DiskTier {
 public:
  static constexpr int64_t kAlignBytes = 4096;
  static constexpr int64_t kHeaderBytes = 4096;
  static constexpr int64_t kMaxSections = 16;

  /// \brief Checks, in this order, and creates nothing before all have passed: the arguments,
  /// the directory lock, stale files, free space (needed vs statvfs free), the host budget of the
  /// buffer pool; then creates the directory (if missing) and one preallocated file per unit.
  /// \param[in] dir directory of the files (created if missing; other files in it are left alone).
  /// \param[in] units per unit, the byte sizes of its sections (at most kMaxSections, >= 0).
  /// \throws std::invalid_argument for bad arguments; DiskSpaceError when free space is short;
  ///         host_store::HostMemoryError when the pool does not fit in RAM; DiskTierError for a
  ///         directory in use, stale files under kRefuse, a foreign file, or a failed creation
  ///         (the files created so far are removed).
  DiskTier(std::string dir, std::vector<UnitLayout> units, DiskTierOptions options = {});
  /// Stops the I/O threads (queued writes are dropped: the tier is a working area), closes and
  /// removes the files. Never throws.
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  /// \brief Bytes of unit u's file: the header plus its sections, each rounded up to 4 KiB.
  static int64_t file_bytes(const UnitLayout& unit);
  /// \brief Disk bytes a tier of these units needs (sum of file_bytes): what the constructor's
  /// free-space check compares against free_bytes().
  static int64_t bytes_required(const std::vector<UnitLayout>& units);
  /// \brief Bytes an unprivileged process may still write on the filesystem holding dir (or its
  /// nearest existing ancestor): statvfs f_bavail * f_frsize. \throws DiskTierError if none can be read.
  static int64_t free_bytes(const std::string& dir);
  /// \brief RAM the buffer pool takes: num_buffers * the largest file_bytes.
  static int64_t pool_bytes(const std::vector<UnitLayout>& units, int64_t num_buffers);

  /// \brief Starts reading unit u into a buffer, without blocking. Reads nothing when u is already
  /// in RAM (cached, being read or being written: then its buffer is kept for it, no other
  /// prefetch takes it until u is acquired), acquired, or was never written. When no buffer is
  /// free the read is issued as soon as one is (acquires first).
  /// \throws DiskTierError (sticky failure); std::out_of_range for a bad unit.
  void prefetch(int64_t u);
  /// \brief Blocks until unit u's state is in a buffer the caller owns; returns one pointer per
  /// section (4 KiB aligned, each of the layout's section bytes, padding up to 4 KiB writable).
  /// \pre u is not acquired already; fewer than num_buffers units are acquired.
  /// \throws std::logic_error when u is acquired already or every buffer is acquired (it would
  ///         never return); DiskTierError on an I/O failure (sticky).
  std::vector<void*> acquire(int64_t u);
  /// \brief Hands unit u's buffer back. dirty: the caller wrote into it; its write to the file is
  /// issued now (write-behind); clean: the buffer stays cached, evictable without I/O.
  /// \throws std::logic_error when u is not acquired; DiskTierError (sticky failure).
  void release(int64_t u, bool dirty);
  /// \brief Blocks until every issued write is done, then fdatasync()s the files written since
  /// the last flush. \throws DiskTierError (sticky failure).
  void flush();
  /// \brief Throws the sticky DiskTierError if an I/O of the tier failed (a write behind included);
  /// does not block.
  void check() const;
  /// \brief Detaches every cached (clean, not acquired) buffer, so the next acquire of those
  /// units reads the file (benchmarks; tests of the read path). Waits for in-flight I/O first.
  void drop_cached();

  int64_t num_units() const { return static_cast<int64_t>(units_.size()); }
  const UnitLayout& layout(int64_t u) const;
  int64_t num_buffers() const { return options_.num_buffers; }
  int64_t buffer_bytes() const { return buffer_bytes_; }
  const std::string& dir() const { return dir_; }
  std::string unit_path(int64_t u) const;
  /// \brief Whether the files are open with O_DIRECT (false: buffered I/O; see direct_io_note()).
  bool direct_io() const { return direct_io_; }
  /// \brief Why O_DIRECT is not used ("" when it is).
  const std::string& direct_io_note() const { return direct_io_note_; }
  /// \brief Stale tier files of a previous run removed by the constructor.
  int64_t stale_files_removed() const { return stale_removed_; }
  /// \brief The random run id written into every header (two 64-bit words).
  std::array<uint64_t, 2> run_id() const { return run_id_; }
  DiskTierStats stats() const;
  /// \brief "empty" | "on_disk" | "reading" | "cached" | "acquired" | "writing" (tests, debugging).
  std::string unit_state(int64_t u) const;

  /// \brief File-name prefix and suffix of tier files: <dir>/megatrain_unit_<u, 6 digits>.tier.
  static constexpr const char* kFilePrefix = "megatrain_unit_";
  static constexpr const char* kFileSuffix = ".tier";

 private:
  enum class State { kEmpty, kOnDisk, kReading, kCached, kAcquired, kWriting };
  struct Unit {
    State state = State::kEmpty;
    int64_t buffer = -1;         ///< pool index while in RAM
    int64_t pending_chunks = 0;  ///< chunks of the current read / write not done yet
    bool prefetch_wanted = false;
    /// An acquire waits for this unit (for its read, its write, or a buffer): its buffer is never
    /// taken for another unit meanwhile (without this, a prefetch served the moment the acquire's
    /// own read completed could evict the unit before the acquirer woke up, and it would be read again).
    bool acquire_waiting = false;
    bool synced = true;          ///< no write since the last fdatasync
    bool on_disk = false;        ///< the file holds the unit's state (a write finished)
    uint64_t last_use = 0;       ///< LRU clock of the last release / read
    double io_start = 0;
    int fd = -1;
  };
  struct Job {
    IoOp op;
    int64_t unit;
    int64_t offset;
    int64_t bytes;
  };

  // Constructor steps, in the order it runs them (checks first; each throws as documented there).
  struct StaleFiles {
    std::vector<std::string> paths;  ///< tier files of a dead run, sorted
    int64_t bytes = 0;               ///< their disk blocks
  };
  void validate_options();  ///< also rounds chunk_bytes up to kAlignBytes
  void validate_layout();   ///< fills section_offset_ and buffer_bytes_
  bool directory_exists() const;  ///< throws if dir_ exists but is not a directory
  StaleFiles find_stale_files() const;  ///< dir_ exists and is locked; throws under kRefuse
  void check_free_space(int64_t stale_bytes) const;
  void check_pool_memory() const;
  void create_directory();  ///< dir_ and its missing parents; sets created_dir_
  void allocate_buffers();
  void create_unit_files();  ///< open, preallocate and write the header of each unit's file
  int open_unit_file(const std::string& path);  ///< falls back to buffered I/O on EINVAL
  void preallocate_unit_file(int64_t u, const std::string& path);
  void write_unit_header(int64_t u, char* page, const std::string& path);  ///< ditto on EINVAL

  void check_failed_locked() const;
  void check_unit(int64_t u) const;
  /// A buffer for a new read / zero fill: a free one, else the least recently used cached one
  /// (prefetched-but-unused ones last; never one an acquire waits for); -1 when none (all
  /// acquired, reading or writing).
  int64_t take_buffer_locked(bool for_prefetch);
  void start_io_locked(int64_t u, IoOp op);
  void serve_prefetches_locked();
  void io_loop();
  void finish_job(const Job& job, std::exception_ptr error);
  void fail_locked(std::exception_ptr error);
  std::string io_error(IoOp op, int64_t u, int64_t offset, int64_t bytes, int err,
                       const std::string& detail) const;
  void write_header(char* page, int64_t u) const;
  void remove_files() noexcept;

  std::string dir_;
  std::vector<UnitLayout> units_;
  std::vector<std::vector<int64_t>> section_offset_;  ///< per unit, byte offsets after the header
  DiskTierOptions options_;
  int64_t buffer_bytes_ = 0;
  std::array<uint64_t, 2> run_id_{};
  bool direct_io_ = false;
  std::string direct_io_note_;
  int64_t stale_removed_ = 0;
  int dir_fd_ = -1;  ///< holds the directory's flock
  bool created_dir_ = false;  ///< the constructor made dir (removed again when empty)

  std::vector<char*> buffers_;
  std::vector<int64_t> buffer_owner_;  ///< unit using each buffer, -1: free
  std::vector<Unit> state_;
  std::deque<int64_t> prefetch_queue_;

  mutable std::mutex mu_;
  std::condition_variable state_cv_;  ///< unit state changes, buffers freed, failure
  std::condition_variable job_cv_;
  std::deque<Job> read_jobs_, write_jobs_;  ///< reads are served first
  int64_t jobs_running_ = 0;
  bool stop_ = false;
  std::exception_ptr failure_;
  uint64_t clock_ = 0;
  int64_t acquired_count_ = 0;
  int64_t buffer_waiters_ = 0;  ///< acquires blocked for a buffer (prefetches yield to them)
  DiskTierStats stats_;
  std::vector<std::thread> threads_;
};

}  // namespace disk_tier
}  // namespace megatrain
