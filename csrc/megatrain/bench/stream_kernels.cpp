// Dispatcher and portable scalar variant of the STREAM-style bandwidth kernels.
#include "megatrain/bench/stream_kernels.h"

#include <cstring>
#include <stdexcept>
#include <string>

namespace megatrain {
namespace bench {

StreamKind parse_stream_kind(const char* name) {
  const std::string n(name);
  if (n == "copy") return StreamKind::kCopy;
  if (n == "triad") return StreamKind::kTriad;
  if (n == "adam") return StreamKind::kAdam;
  throw std::invalid_argument("unknown stream kernel '" + n + "', expected copy, triad or adam");
}

int64_t stream_bytes_per_element(const StreamArgs& s) {
  switch (s.kind) {
    case StreamKind::kCopy:
      return 8;
    case StreamKind::kTriad:
      return 12;
    case StreamKind::kAdam:
      return 12 + (s.g_bf16 ? 2 : 4) + 12 + (s.out != nullptr ? 2 : 0);
  }
  return 0;
}

void stream_range(const StreamArgs& s, int64_t begin, int64_t end, common::CpuIsa isa) {
  switch (isa) {
#if defined(__x86_64__)
    case common::CpuIsa::kAvx512:
      kernels::stream_avx512(s, begin, end);
      return;
    case common::CpuIsa::kAvx2:
      kernels::stream_avx2(s, begin, end);
      return;
#endif
    default:
      kernels::stream_scalar(s, begin, end);
      return;
  }
}

namespace kernels {

void stream_scalar(const StreamArgs& s, int64_t begin, int64_t end) {
  switch (s.kind) {
    case StreamKind::kCopy:
      for (int64_t i = begin; i < end; ++i) s.a[i] = s.b[i];
      return;
    case StreamKind::kTriad:
      for (int64_t i = begin; i < end; ++i) s.a[i] = s.b[i] + 3.0f * s.c[i];
      return;
    case StreamKind::kAdam:
      for (int64_t i = begin; i < end; ++i) {
        float g;
        if (s.g_bf16) {
          const uint32_t u = static_cast<uint32_t>(static_cast<const uint16_t*>(s.g)[i]) << 16;
          std::memcpy(&g, &u, 4);
        } else {
          g = static_cast<const float*>(s.g)[i];
        }
        const float p = s.p[i] * 0.5f + g;
        s.p[i] = p;
        s.m[i] = s.m[i] * 0.5f + g;
        s.v[i] = s.v[i] * 0.5f + g * g;
        if (s.out != nullptr) {
          uint32_t u;
          std::memcpy(&u, &p, 4);
          s.out[i] = static_cast<uint16_t>(u >> 16);  // truncation: the traffic is what counts
        }
      }
      return;
  }
}

}  // namespace kernels
}  // namespace bench
}  // namespace megatrain
