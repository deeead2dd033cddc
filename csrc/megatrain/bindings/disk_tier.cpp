// pybind11 class _C.DiskTier over megatrain::disk_tier::DiskTier, and its exceptions
// DiskTierError (an OSError) and DiskSpaceError (a DiskTierError with needed/free bytes).
#include <torch/extension.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "megatrain/disk_tier/disk_tier.h"

namespace py = pybind11;
namespace dtn = megatrain::disk_tier;

namespace {

std::vector<dtn::UnitLayout> to_layouts(const std::vector<std::vector<int64_t>>& units) {
  std::vector<dtn::UnitLayout> out;
  out.reserve(units.size());
  for (const auto& u : units) out.push_back(dtn::UnitLayout{u});
  return out;
}

// The tier plus the section pointers of the units acquired through Python; the tensors handed
// out keep this object (and so the tier and its buffers) alive.
class PyDiskTier : public std::enable_shared_from_this<PyDiskTier> {
 public:
  explicit PyDiskTier(std::unique_ptr<dtn::DiskTier> tier) : tier_(std::move(tier)) {}

  dtn::DiskTier& tier() { return *tier_; }

  std::vector<void*> acquire(int64_t u) {
    std::vector<void*> ptrs = tier_->acquire(u);
    std::lock_guard<std::mutex> lk(mu_);
    acquired_[u] = ptrs;
    return ptrs;
  }

  void release(int64_t u, bool dirty) {
    {
      std::lock_guard<std::mutex> lk(mu_);
      acquired_.erase(u);
    }
    tier_->release(u, dirty);
  }

  // Section s of an acquired unit: its pointer and declared bytes.
  std::pair<char*, int64_t> section(int64_t u, int64_t s) {
    const auto& layout = tier_->layout(u);
    std::lock_guard<std::mutex> lk(mu_);
    auto it = acquired_.find(u);
    if (it == acquired_.end()) {
      throw std::invalid_argument("DiskTier: unit " + std::to_string(u) +
                                  " is not acquired; call acquire(" + std::to_string(u) + ") first");
    }
    if (s < 0 || s >= static_cast<int64_t>(layout.section_bytes.size())) {
      throw std::out_of_range("DiskTier: unit " + std::to_string(u) + " has " +
                              std::to_string(layout.section_bytes.size()) + " sections, got section " +
                              std::to_string(s));
    }
    return {static_cast<char*>(it->second[s]), layout.section_bytes[s]};
  }

  at::Tensor section_tensor(int64_t u, int64_t s, at::ScalarType dtype) {
    auto [ptr, bytes] = section(u, s);
    const int64_t esize = static_cast<int64_t>(c10::elementSize(dtype));
    if (bytes % esize != 0) {
      throw std::invalid_argument("DiskTier: section " + std::to_string(s) + " of unit " + std::to_string(u) +
                                  " has " + std::to_string(bytes) + " bytes, not a multiple of " +
                                  std::to_string(esize) + " (the element size of " + c10::toString(dtype) + ")");
    }
    std::shared_ptr<PyDiskTier> keep = shared_from_this();
    return at::from_blob(
        ptr, {bytes / esize}, [keep](void*) mutable { keep.reset(); },
        at::TensorOptions().dtype(dtype).device(at::kCPU));
  }

 private:
  std::unique_ptr<dtn::DiskTier> tier_;
  std::mutex mu_;
  std::map<int64_t, std::vector<void*>> acquired_;
};

py::dict stats_dict(const dtn::DiskTierStats& s) {
  py::dict d;
  d["bytes_read"] = s.bytes_read;
  d["bytes_written"] = s.bytes_written;
  d["unit_reads"] = s.unit_reads;
  d["unit_writes"] = s.unit_writes;
  d["cache_hits"] = s.cache_hits;
  d["zero_fills"] = s.zero_fills;
  d["read_seconds"] = s.read_seconds;
  d["write_seconds"] = s.write_seconds;
  d["acquire_wait_seconds"] = s.acquire_wait_seconds;
  d["flush_seconds"] = s.flush_seconds;
  return d;
}

}  // namespace

namespace megatrain {
namespace bindings {

std::shared_ptr<dtn::DiskTier> disk_tier_of(const py::object& tier) {
  if (tier.is_none()) return nullptr;
  auto py_tier = tier.cast<std::shared_ptr<PyDiskTier>>();  // TypeError for anything else
  // Aliasing: the task holding it keeps the Python-side object (and its buffers) alive.
  return std::shared_ptr<dtn::DiskTier>(py_tier, &py_tier->tier());
}

void init_disk_tier(py::module_& m) {
  static PyObject* tier_error = PyErr_NewException("megatrain._C.DiskTierError", PyExc_OSError, nullptr);
  static PyObject* space_error = PyErr_NewException("megatrain._C.DiskSpaceError", tier_error, nullptr);
  if (tier_error == nullptr || space_error == nullptr) throw py::error_already_set();
  Py_INCREF(tier_error);
  Py_INCREF(space_error);
  m.attr("DiskTierError") = py::handle(tier_error);
  m.attr("DiskSpaceError") = py::handle(space_error);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const dtn::DiskSpaceError& e) {
      py::object inst = py::reinterpret_borrow<py::object>(space_error)(e.what());
      inst.attr("errno") = e.errno_value();
      inst.attr("needed_bytes") = e.needed_bytes();
      inst.attr("free_bytes") = e.free_bytes();
      PyErr_SetObject(space_error, inst.ptr());
    } catch (const dtn::DiskTierError& e) {
      py::object inst = py::reinterpret_borrow<py::object>(tier_error)(e.what());
      inst.attr("errno") = e.errno_value() != 0 ? py::object(py::int_(e.errno_value())) : py::none();
      PyErr_SetObject(tier_error, inst.ptr());
    }
  });

  py::class_<PyDiskTier, std::shared_ptr<PyDiskTier>>(
      m, "DiskTier",
      "fp32 state of units in one file per unit under a directory (O_DIRECT where the filesystem "
      "allows it), moved through a bounded pool of aligned RAM buffers by I/O threads. A working "
      "area, not a checkpoint: files are created fresh and removed when the tier is destroyed. See "
      "docs/disk_tier.md and csrc/megatrain/disk_tier/disk_tier.h.")
      .def(py::init([](const std::string& dir, const std::vector<std::vector<int64_t>>& units, int64_t num_buffers,
                       int64_t io_threads, int64_t chunk_bytes, bool direct_io, bool preallocate,
                       const std::string& stale, int64_t memory_limit_bytes, py::object fault) {
             dtn::DiskTierOptions o;
             o.num_buffers = num_buffers;
             o.io_threads = io_threads;
             o.chunk_bytes = chunk_bytes;
             o.direct_io = direct_io;
             o.preallocate = preallocate;
             o.memory_limit_bytes = memory_limit_bytes;
             if (stale == "remove") {
               o.stale = dtn::StalePolicy::kRemove;
             } else if (stale == "refuse") {
               o.stale = dtn::StalePolicy::kRefuse;
             } else {
               throw std::invalid_argument("DiskTier: stale must be 'remove' or 'refuse', got '" + stale + "'");
             }
             if (!fault.is_none()) {
               const auto spec = fault.cast<std::vector<py::object>>();
               if (spec.size() != 3 && spec.size() != 4) {
                 throw std::invalid_argument("DiskTier: _fault must be (op, unit, errno) or (op, unit, errno, after)");
               }
               const auto op_name = spec[0].cast<std::string>();
               const auto unit = spec[1].cast<int64_t>();
               const auto err = spec[2].cast<int>();
               const int64_t after = spec.size() == 4 ? spec[3].cast<int64_t>() : 0;
               if (op_name != "read" && op_name != "write") {
                 throw std::invalid_argument("DiskTier: _fault op must be 'read' or 'write', got '" + op_name + "'");
               }
               const dtn::IoOp op = op_name == "read" ? dtn::IoOp::kRead : dtn::IoOp::kWrite;
               auto seen = std::make_shared<std::atomic<int64_t>>(0);
               o.fault_hook = [op, unit, err, after, seen](dtn::IoOp o2, int64_t u, int64_t, int64_t) {
                 if (o2 != op || (unit >= 0 && u != unit)) return 0;
                 return seen->fetch_add(1) >= after ? err : 0;  // the first `after` such chunks succeed
               };
             }
             std::unique_ptr<dtn::DiskTier> tier;
             {
               py::gil_scoped_release nogil;
               tier = std::make_unique<dtn::DiskTier>(dir, to_layouts(units), std::move(o));
             }
             return std::make_shared<PyDiskTier>(std::move(tier));
           }),
           py::arg("dir"), py::arg("units"), py::arg("num_buffers") = 2, py::arg("io_threads") = 4,
           py::arg("chunk_bytes") = 8 << 20, py::arg("direct_io") = true, py::arg("preallocate") = true,
           py::arg("stale") = "remove", py::arg("memory_limit_bytes") = -1, py::arg("_fault") = py::none(),
           "Args: dir (str, created if missing), units (list of lists of section byte sizes, e.g. "
           "[[master, exp_avg, exp_avg_sq], ...]), num_buffers (RAM buffers, each of the largest "
           "unit's file bytes), io_threads, chunk_bytes (per pread/pwrite, rounded to 4 KiB), "
           "direct_io (try O_DIRECT), preallocate (fallocate at creation), stale ('remove' or "
           "'refuse' files of a dead run), memory_limit_bytes (host budget override for the pool), "
           "_fault (tests: (op 'read'|'write', unit or -1, errno[, after]) injected into every such chunk "
           "after the first `after` of them). "
           "Raises DiskSpaceError (needed vs free, nothing created), MemoryError (the pool), "
           "DiskTierError, ValueError.")
      .def("prefetch", [](PyDiskTier& t, int64_t u) { t.tier().prefetch(u); }, py::arg("unit"),
           py::call_guard<py::gil_scoped_release>(),
           "Start reading the unit into a buffer (non-blocking). A unit in RAM already (cached, being read "
           "or written) is not read and keeps its buffer until acquired; acquired or never-written: no-op.")
      .def("acquire", [](PyDiskTier& t, int64_t u) {
             std::vector<void*> ptrs;
             {
               py::gil_scoped_release nogil;
               ptrs = t.acquire(u);
             }
             std::vector<uintptr_t> out;
             for (void* p : ptrs) out.push_back(reinterpret_cast<uintptr_t>(p));
             return out;
           },
           py::arg("unit"),
           "Block until the unit's state is in a buffer owned by the caller; returns the section "
           "addresses (ints, 4 KiB aligned), valid until release(unit). A never-written unit is "
           "zeros. Raises RuntimeError when the unit is acquired already or every buffer is.")
      .def("release", [](PyDiskTier& t, int64_t u, bool dirty) {
             py::gil_scoped_release nogil;
             t.release(u, dirty);
           },
           py::arg("unit"), py::arg("dirty"),
           "Hand the unit's buffer back; dirty=True issues its write to the file (write-behind). "
           "Tensors from section_tensor(unit, ...) must not be used afterwards.")
      .def("flush", [](PyDiskTier& t) { t.tier().flush(); }, py::call_guard<py::gil_scoped_release>(),
           "Wait for every issued write, then fdatasync the files written since the last flush.")
      .def("check", [](PyDiskTier& t) { t.tier().check(); },
           "Raise the sticky DiskTierError if an I/O failed (a write behind included); never blocks.")
      .def("drop_cached", [](PyDiskTier& t) { t.tier().drop_cached(); }, py::call_guard<py::gil_scoped_release>(),
           "Detach every clean cached buffer: the next acquire of those units reads the file.")
      .def("section_tensor", &PyDiskTier::section_tensor, py::arg("unit"), py::arg("section"),
           py::arg("dtype") = at::kFloat,
           "Section of an acquired unit as a 1-D CPU tensor over the tier's buffer (no copy; "
           "float32 by default: bytes / 4 elements). Valid until release(unit).")
      .def("read_section", [](PyDiskTier& t, int64_t u, int64_t s) {
             auto [ptr, bytes] = t.section(u, s);
             return py::bytes(ptr, static_cast<size_t>(bytes));
           },
           py::arg("unit"), py::arg("section"), "A copy of a section of an acquired unit, as bytes.")
      .def("write_section", [](PyDiskTier& t, int64_t u, int64_t s, py::bytes data) {
             auto [ptr, bytes] = t.section(u, s);
             const std::string buf = data;
             if (static_cast<int64_t>(buf.size()) != bytes) {
               throw std::invalid_argument("DiskTier.write_section: section " + std::to_string(s) + " of unit " +
                                           std::to_string(u) + " has " + std::to_string(bytes) + " bytes, got " +
                                           std::to_string(buf.size()));
             }
             std::memcpy(ptr, buf.data(), buf.size());
           },
           py::arg("unit"), py::arg("section"), py::arg("data"),
           "Copy bytes (exactly the section's size) into a section of an acquired unit.")
      .def("unit_path", [](PyDiskTier& t, int64_t u) {
             t.tier().layout(u);  // range check
             return t.tier().unit_path(u);
           },
           py::arg("unit"))
      .def("unit_state", [](PyDiskTier& t, int64_t u) { return t.tier().unit_state(u); }, py::arg("unit"),
           "empty | on_disk | reading | cached | acquired | writing")
      .def("layout", [](PyDiskTier& t, int64_t u) { return t.tier().layout(u).section_bytes; }, py::arg("unit"))
      .def("stats", [](PyDiskTier& t) { return stats_dict(t.tier().stats()); },
           "bytes_read, bytes_written, unit_reads, unit_writes, cache_hits, zero_fills, read_seconds, "
           "write_seconds, acquire_wait_seconds, flush_seconds.")
      .def_property_readonly("num_units", [](PyDiskTier& t) { return t.tier().num_units(); })
      .def_property_readonly("num_buffers", [](PyDiskTier& t) { return t.tier().num_buffers(); })
      .def_property_readonly("buffer_bytes", [](PyDiskTier& t) { return t.tier().buffer_bytes(); })
      .def_property_readonly("dir", [](PyDiskTier& t) { return t.tier().dir(); })
      .def_property_readonly("direct_io", [](PyDiskTier& t) { return t.tier().direct_io(); },
                             "Whether the files use O_DIRECT (False: buffered, see direct_io_note).")
      .def_property_readonly("direct_io_note", [](PyDiskTier& t) { return t.tier().direct_io_note(); })
      .def_property_readonly("stale_files_removed", [](PyDiskTier& t) { return t.tier().stale_files_removed(); })
      .def_property_readonly("run_id", [](PyDiskTier& t) {
        const auto id = t.tier().run_id();
        char buf[40];
        std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(id[0]),
                      static_cast<unsigned long long>(id[1]));
        return std::string(buf);
      })
      .def_static("bytes_required",
                  [](const std::vector<std::vector<int64_t>>& units) {
                    return dtn::DiskTier::bytes_required(to_layouts(units));
                  },
                  py::arg("units"), "Disk bytes a tier of these units needs (headers, 4 KiB-rounded sections).")
      .def_static("pool_bytes",
                  [](const std::vector<std::vector<int64_t>>& units, int64_t num_buffers) {
                    return dtn::DiskTier::pool_bytes(to_layouts(units), num_buffers);
                  },
                  py::arg("units"), py::arg("num_buffers"), "RAM bytes of the buffer pool.")
      .def_static("free_bytes", &dtn::DiskTier::free_bytes, py::arg("dir"),
                  "Bytes an unprivileged process may still write on dir's filesystem (statvfs; a "
                  "missing dir is its nearest existing ancestor).");
}

}  // namespace bindings
}  // namespace megatrain
