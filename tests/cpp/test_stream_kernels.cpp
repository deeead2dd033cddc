// The STREAM-style bandwidth kernels (benchmarks only): every ISA variant, with and without
// streaming stores, computes what the scalar variant computes; bytes are counted as documented.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <stdexcept>
#include <vector>

#include "megatrain/bench/stream_kernels.h"
#include "megatrain/common/cpu_features.h"

namespace mb = megatrain::bench;
using megatrain::common::CpuIsa;

namespace {

struct Arrays {
  std::vector<float> a, b, c, p, m, v, g;
  std::vector<uint16_t> g16, out;
};

Arrays make(int64_t n) {
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  Arrays x;
  for (auto* vec : {&x.a, &x.b, &x.c, &x.p, &x.m, &x.v, &x.g}) {
    vec->resize(n);
    for (auto& e : *vec) e = d(rng);
  }
  x.g16.resize(n);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &x.g[i], 4);
    x.g16[i] = static_cast<uint16_t>(u >> 16);
  }
  x.out.assign(n, 0);
  return x;
}

mb::StreamArgs args(Arrays& x, mb::StreamKind k, bool g_bf16, bool nt, int64_t off) {
  mb::StreamArgs s;
  s.kind = k;
  s.a = x.a.data() + off;
  s.b = x.b.data() + off;
  s.c = x.c.data() + off;
  s.p = x.p.data() + off;
  s.m = x.m.data() + off;
  s.v = x.v.data() + off;
  s.g = g_bf16 ? static_cast<const void*>(x.g16.data() + off) : static_cast<const void*>(x.g.data() + off);
  s.g_bf16 = g_bf16;
  s.out = x.out.data() + off;
  s.nt = nt;
  return s;
}

bool same(const Arrays& x, const Arrays& y) {
  auto eq = [](const auto& u, const auto& w) {
    return u.size() == w.size() && std::memcmp(u.data(), w.data(), u.size() * sizeof(u[0])) == 0;
  };
  return eq(x.a, y.a) && eq(x.p, y.p) && eq(x.m, y.m) && eq(x.v, y.v) && eq(x.out, y.out);
}

}  // namespace

TEST(StreamKernels, EveryIsaWithAndWithoutStreamingStoresMatchesScalar) {
  const int64_t n = 3000 + 7;
  for (CpuIsa isa : {CpuIsa::kAvx2, CpuIsa::kAvx512}) {
    if (!megatrain::common::cpu_supports(isa)) continue;
    for (mb::StreamKind k : {mb::StreamKind::kCopy, mb::StreamKind::kTriad, mb::StreamKind::kAdam}) {
      for (bool g_bf16 : {false, true}) {
        for (bool nt : {false, true}) {
          for (int64_t off : {0, 3}) {
            Arrays ref = make(n), vec = make(n);
            mb::stream_range(args(ref, k, g_bf16, false, off), 5, n - off, CpuIsa::kScalar);
            mb::stream_range(args(vec, k, g_bf16, nt, off), 5, n - off, isa);
            EXPECT_TRUE(same(ref, vec)) << megatrain::common::isa_name(isa) << " kind "
                                        << static_cast<int>(k) << " bf16 " << g_bf16 << " nt "
                                        << nt << " off " << off;
          }
        }
      }
    }
  }
}

TEST(StreamKernels, BytesPerElementAndKindNames) {
  mb::StreamArgs s;
  s.kind = mb::parse_stream_kind("copy");
  EXPECT_EQ(mb::stream_bytes_per_element(s), 8);
  s.kind = mb::parse_stream_kind("triad");
  EXPECT_EQ(mb::stream_bytes_per_element(s), 12);
  s.kind = mb::parse_stream_kind("adam");
  uint16_t out = 0;
  s.out = &out;
  EXPECT_EQ(mb::stream_bytes_per_element(s), 30);  // the fused AdamW's count with fp32 grads
  s.g_bf16 = true;
  EXPECT_EQ(mb::stream_bytes_per_element(s), 28);
  s.out = nullptr;
  EXPECT_EQ(mb::stream_bytes_per_element(s), 26);
  EXPECT_THROW(mb::parse_stream_kind("scale"), std::invalid_argument);
}
