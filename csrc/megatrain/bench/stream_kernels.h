// STREAM-style host memory bandwidth kernels (torch-free), for benchmarks only: the roofline the
// fused AdamW is measured against, with the same threads, chunking and array sizes as the real op.
//
// Bytes are counted the STREAM way: every array element explicitly read plus every element
// written (a write-allocate read-for-ownership is not counted; it is what non-temporal stores
// save).
//   copy   a[i] = b[i]                                                   8 B/elem
//   triad  a[i] = b[i] + s * c[i]                                        12 B/elem
//   adam   p = p*k + g; m = m*k + g; v = v*k + g*g; out = bf16(p)        "AdamW-shaped": reads
//          p, m, v (fp32) and g (fp32 or bf16), writes p, m, v and the optional bf16 out:
//          30 B/elem (fp32 g, out) / 28 B/elem (bf16 g, out), the fused AdamW's own traffic.
#pragma once

#include <cstdint>

#include "megatrain/common/cpu_features.h"

namespace megatrain {
namespace bench {

enum class StreamKind { kCopy, kTriad, kAdam };

struct StreamArgs {
  StreamKind kind = StreamKind::kCopy;
  // copy / triad
  float* a = nullptr;
  const float* b = nullptr;
  const float* c = nullptr;
  // adam
  float* p = nullptr;
  float* m = nullptr;
  float* v = nullptr;
  const void* g = nullptr;
  bool g_bf16 = false;
  uint16_t* out = nullptr;  ///< bf16 output, or nullptr for none
  /// Non-temporal stores for the write-only array (copy / triad: a; adam: out), from its first
  /// 64-byte boundary on. Ignored by the scalar variant.
  bool nt = false;
};

/// \brief Parses "copy" | "triad" | "adam". \throws std::invalid_argument otherwise.
StreamKind parse_stream_kind(const char* name);

/// \brief Bytes counted per element (explicit reads + writes, see above).
int64_t stream_bytes_per_element(const StreamArgs& s);

/// \brief Runs kernel `s.kind` over elements [begin, end), single threaded, with `isa`.
void stream_range(const StreamArgs& s, int64_t begin, int64_t end, common::CpuIsa isa);

namespace kernels {
void stream_scalar(const StreamArgs& s, int64_t begin, int64_t end);
#if defined(__x86_64__)
void stream_avx2(const StreamArgs& s, int64_t begin, int64_t end);
void stream_avx512(const StreamArgs& s, int64_t begin, int64_t end);
#endif
}  // namespace kernels

}  // namespace bench
}  // namespace megatrain
