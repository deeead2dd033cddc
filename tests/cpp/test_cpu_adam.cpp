// Every AdamW / grad-accumulate ISA variant the CPU supports against the scalar reference.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include "megatrain/common/cpu_features.h"
#include "megatrain/cpu_adam/adam_kernels.h"
#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"

namespace ca = megatrain::cpu_adam;
using megatrain::common::CpuIsa;

// Readable parameter values in gtest output.
namespace megatrain {
namespace common {
void PrintTo(CpuIsa isa, std::ostream* os) { *os << isa_name(isa); }
}  // namespace common
namespace cpu_adam {
void PrintTo(GradDtype d, std::ostream* os) { *os << (d == GradDtype::kFloat32 ? "fp32" : "bf16"); }
void PrintTo(OutDtype d, std::ostream* os) {
  *os << (d == OutDtype::kFloat32 ? "fp32" : d == OutDtype::kBFloat16 ? "bf16" : "none");
}
}  // namespace cpu_adam
}  // namespace megatrain

namespace {

int64_t ulp_distance(float a, float b) {
  if (std::isnan(a) && std::isnan(b)) return 0;
  if (std::isnan(a) || std::isnan(b)) return std::numeric_limits<int64_t>::max();
  int32_t ia, ib;
  std::memcpy(&ia, &a, 4);
  std::memcpy(&ib, &b, 4);
  // Map sign-magnitude to a monotonic integer line.
  const int64_t la = ia < 0 ? int64_t{INT32_MIN} - ia : ia;
  const int64_t lb = ib < 0 ? int64_t{INT32_MIN} - ib : ib;
  return la > lb ? la - lb : lb - la;
}

uint16_t to_bf16_bits(float f) { return ca::detail::float_to_bf16_rne(f); }

struct State {
  std::vector<float> master, exp_avg, exp_avg_sq, grad_f32, out_f32;
  std::vector<uint16_t> grad_bf16, out_bf16;
};

State make_state(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  State s;
  s.master.resize(n);
  s.exp_avg.resize(n);
  s.exp_avg_sq.resize(n);
  s.grad_f32.resize(n);
  s.grad_bf16.resize(n);
  s.out_f32.assign(n, -1.0f);
  s.out_bf16.assign(n, 0xFFFF);
  for (int64_t i = 0; i < n; ++i) {
    s.master[i] = normal(rng);
    s.exp_avg[i] = 0.1f * normal(rng);
    s.exp_avg_sq[i] = 0.01f * std::abs(normal(rng));
    s.grad_f32[i] = normal(rng) * (i % 7 == 0 ? 1e-3f : 1.0f);
    s.grad_bf16[i] = to_bf16_bits(s.grad_f32[i]);
  }
  return s;
}

ca::AdamArgs args_of(State& s, ca::GradDtype gdt, ca::OutDtype odt) {
  ca::AdamArgs a;
  a.master = s.master.data();
  a.exp_avg = s.exp_avg.data();
  a.exp_avg_sq = s.exp_avg_sq.data();
  a.grad = gdt == ca::GradDtype::kFloat32 ? static_cast<const void*>(s.grad_f32.data())
                                          : static_cast<const void*>(s.grad_bf16.data());
  a.grad_dtype = gdt;
  a.out_dtype = odt;
  a.compute_out = odt == ca::OutDtype::kBFloat16 ? static_cast<void*>(s.out_bf16.data())
                  : odt == ca::OutDtype::kFloat32 ? static_cast<void*>(s.out_f32.data())
                                                  : nullptr;
  return a;
}

ca::AdamHyper default_hyper(int64_t step) {
  ca::AdamHyper h;
  h.lr = 1e-3;
  h.beta1 = 0.9;
  h.beta2 = 0.999;
  h.eps = 1e-8;
  h.weight_decay = 0.1;
  h.step = step;
  h.grad_scale = 0.5f;
  return h;
}

void expect_within_ulp(const std::vector<float>& a, const std::vector<float>& b, int64_t max_ulp,
                       const char* what) {
  ASSERT_EQ(a.size(), b.size());
  int64_t worst = 0;
  size_t worst_i = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const int64_t d = ulp_distance(a[i], b[i]);
    if (d > worst) {
      worst = d;
      worst_i = i;
    }
  }
  EXPECT_LE(worst, max_ulp) << what << ": element " << worst_i << " differs: " << a[worst_i]
                            << " vs " << b[worst_i];
}

std::string isa_label(CpuIsa isa) {
  std::string n = megatrain::common::isa_name(isa);
  n[0] = static_cast<char>(std::toupper(n[0]));
  return n;
}

using Case = std::tuple<CpuIsa, int64_t, ca::GradDtype>;

class AdamVariantMatchesScalar : public ::testing::TestWithParam<Case> {};

TEST_P(AdamVariantMatchesScalar, ThreeStepsWithinTwoUlpAndBf16CopyExact) {
  const auto [isa, n, gdt] = GetParam();
  if (!megatrain::common::cpu_supports(isa)) {
    GTEST_SKIP() << "this CPU does not support " << megatrain::common::isa_name(isa);
  }
  State ref = make_state(n, 1234u + static_cast<uint32_t>(n));
  State vec = ref;
  for (int64_t step = 1; step <= 3; ++step) {
    const ca::AdamConstants c = ca::make_adam_constants(default_hyper(step));
    ca::adamw_range(args_of(ref, gdt, ca::OutDtype::kBFloat16), c, 0, n, CpuIsa::kScalar);
    ca::adamw_range(args_of(vec, gdt, ca::OutDtype::kBFloat16), c, 0, n, isa);
  }
  expect_within_ulp(ref.master, vec.master, 2, "master");
  expect_within_ulp(ref.exp_avg, vec.exp_avg, 2, "exp_avg");
  expect_within_ulp(ref.exp_avg_sq, vec.exp_avg_sq, 2, "exp_avg_sq");
  for (int64_t i = 0; i < n; ++i) {
    ASSERT_EQ(vec.out_bf16[i], to_bf16_bits(vec.master[i])) << "bf16 compute copy at " << i;
  }
  // Same rounding everywhere: the variants are in fact bit-identical.
  EXPECT_EQ(0, std::memcmp(ref.master.data(), vec.master.data(), n * sizeof(float)));
  // The fp32 compute copy is an exact copy.
  const ca::AdamConstants c4 = ca::make_adam_constants(default_hyper(4));
  ca::adamw_range(args_of(vec, gdt, ca::OutDtype::kFloat32), c4, 0, n, isa);
  EXPECT_EQ(0, std::memcmp(vec.out_f32.data(), vec.master.data(), n * sizeof(float)));
}

TEST_P(AdamVariantMatchesScalar, OffsetRangeUpdatesOnlyThatRange) {
  const auto [isa, n, gdt] = GetParam();
  if (!megatrain::common::cpu_supports(isa)) {
    GTEST_SKIP() << "this CPU does not support " << megatrain::common::isa_name(isa);
  }
  if (n < 3) GTEST_SKIP() << "needs at least 3 elements";
  State s = make_state(n, 99u);
  const State before = s;
  const int64_t begin = 1, end = n - 1;  // unaligned start, remainder at the end
  ca::adamw_range(args_of(s, gdt, ca::OutDtype::kNone), ca::make_adam_constants(default_hyper(1)),
                  begin, end, isa);
  EXPECT_EQ(s.master[0], before.master[0]);
  EXPECT_EQ(s.master[n - 1], before.master[n - 1]);
  EXPECT_NE(s.master[begin], before.master[begin]);
  EXPECT_NE(s.master[end - 1], before.master[end - 1]);
}

class GradAccumulateVariantMatchesScalar : public ::testing::TestWithParam<Case> {};

TEST_P(GradAccumulateVariantMatchesScalar, OverwriteThenAddExactAndSumOfSquaresClose) {
  const auto [isa, n, gdt] = GetParam();
  if (!megatrain::common::cpu_supports(isa)) {
    GTEST_SKIP() << "this CPU does not support " << megatrain::common::isa_name(isa);
  }
  State s = make_state(n, 7u);
  const void* g = gdt == ca::GradDtype::kFloat32 ? static_cast<const void*>(s.grad_f32.data())
                                                 : static_cast<const void*>(s.grad_bf16.data());
  std::vector<float> ref(n, 123.0f), vec(n, -5.0f);
  for (bool overwrite : {true, false, false}) {
    const double sr = ca::grad_accumulate_range(ref.data(), g, gdt, overwrite, 0, n, CpuIsa::kScalar);
    const double sv = ca::grad_accumulate_range(vec.data(), g, gdt, overwrite, 0, n, isa);
    ASSERT_EQ(0, std::memcmp(ref.data(), vec.data(), n * sizeof(float)));
    double exact = 0.0;
    for (float x : ref) exact += static_cast<double>(x) * x;
    EXPECT_NEAR(sv, exact, 1e-12 * exact);
    EXPECT_NEAR(sr, exact, 1e-12 * exact);
  }
  // After overwrite + 2 adds the accumulator holds 3 * g (exactly representable here? compare
  // against float arithmetic done the same way).
  for (int64_t i = 0; i < n; ++i) {
    const float gi = gdt == ca::GradDtype::kFloat32 ? s.grad_f32[i] : ca::detail::bf16_to_float(s.grad_bf16[i]);
    ASSERT_EQ(vec[i], (gi + gi) + gi) << "element " << i;
  }
}

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const auto [isa, n, gdt] = info.param;
  return isa_label(isa) + "_Size" + std::to_string(n) +
         (gdt == ca::GradDtype::kFloat32 ? "_GradFp32" : "_GradBf16");
}

const auto kIsas = ::testing::Values(CpuIsa::kAvx2, CpuIsa::kAvx512);
const auto kSizes = ::testing::Values<int64_t>(1, 15, 17, 22, 4099, (int64_t{1} << 20) + 3);
const auto kGradDtypes = ::testing::Values(ca::GradDtype::kFloat32, ca::GradDtype::kBFloat16);

INSTANTIATE_TEST_SUITE_P(SizesWithRemainders, AdamVariantMatchesScalar,
                         ::testing::Combine(kIsas, kSizes, kGradDtypes), case_name);
INSTANTIATE_TEST_SUITE_P(SizesWithRemainders, GradAccumulateVariantMatchesScalar,
                         ::testing::Combine(kIsas, kSizes, kGradDtypes), case_name);

TEST(AdamScalar, OneStepMatchesDoublePrecisionFormula) {
  const int64_t n = 1000;
  State s = make_state(n, 5u);
  const State before = s;
  ca::AdamHyper h = default_hyper(3);
  ca::adamw_range(args_of(s, ca::GradDtype::kFloat32, ca::OutDtype::kNone),
                  ca::make_adam_constants(h), 0, n, CpuIsa::kScalar);
  const double bc1 = 1.0 - std::pow(h.beta1, 3), bc2 = 1.0 - std::pow(h.beta2, 3);
  for (int64_t i = 0; i < n; ++i) {
    const double g = static_cast<double>(before.grad_f32[i]) * h.grad_scale;
    const double m = before.exp_avg[i] + (1 - h.beta1) * (g - before.exp_avg[i]);
    const double v = before.exp_avg_sq[i] * h.beta2 + (1 - h.beta2) * g * g;
    double p = before.master[i] * (1 - h.lr * h.weight_decay);
    p -= h.lr / bc1 * m / (std::sqrt(v) / std::sqrt(bc2) + h.eps);
    ASSERT_NEAR(s.master[i], p, 1e-6 * std::abs(p) + 1e-9) << "master " << i;
    ASSERT_NEAR(s.exp_avg_sq[i], v, 1e-6 * v + 1e-12) << "exp_avg_sq " << i;
    ASSERT_NEAR(s.exp_avg[i], m, 1e-6 * (std::abs(g) + std::abs(before.exp_avg[i]))) << "exp_avg " << i;
  }
}

TEST(AdamScalar, LargeBeta1UsesTorchLerpHighWeightFormula) {
  // torch.lerp switches formula at weight 0.5; beta1 = 0.3 gives weight 0.7. ATen's vectorized
  // lerp computes the high-weight form as one fma: fma(w - 1, end - start, end).
  State s = make_state(64, 3u);
  const State before = s;
  ca::AdamHyper h = default_hyper(1);
  h.beta1 = 0.3;
  const ca::AdamConstants c = ca::make_adam_constants(h);
  EXPECT_FALSE(c.lerp_low);
  ca::adamw_range(args_of(s, ca::GradDtype::kFloat32, ca::OutDtype::kNone), c, 0, 64, CpuIsa::kScalar);
  for (int i = 0; i < 64; ++i) {
    const float g = before.grad_f32[i] * h.grad_scale;
    EXPECT_EQ(s.exp_avg[i], std::fma(c.lerp_weight - 1.0f, g - before.exp_avg[i], g));
  }
}

TEST(AdamKernels, Bf16RoundingIsNearestEvenAndKeepsNaN) {
  EXPECT_EQ(to_bf16_bits(1.0f), 0x3F80);
  // 1 + 2^-8 is exactly halfway between bf16 1.0 and 1.0078125: ties to even -> 1.0.
  EXPECT_EQ(to_bf16_bits(1.0f + 1.0f / 256.0f), 0x3F80);
  // 1 + 3 * 2^-8 is halfway between 1.0078125 (odd) and 1.015625 (even): rounds up.
  EXPECT_EQ(to_bf16_bits(1.0f + 3.0f / 256.0f), 0x3F82);
  EXPECT_EQ(to_bf16_bits(std::numeric_limits<float>::quiet_NaN()), 0x7FC0);
  EXPECT_EQ(to_bf16_bits(-std::numeric_limits<float>::infinity()), 0xFF80);
}

TEST(AdamKernels, NaNGradientGivesNaNMasterAndNaNBf16InEveryIsa) {
  for (CpuIsa isa : megatrain::common::supported_isas()) {
    State s = make_state(37, 11u);
    s.grad_f32[20] = std::numeric_limits<float>::quiet_NaN();
    ca::adamw_range(args_of(s, ca::GradDtype::kFloat32, ca::OutDtype::kBFloat16),
                    ca::make_adam_constants(default_hyper(1)), 0, 37, isa);
    EXPECT_TRUE(std::isnan(s.master[20])) << megatrain::common::isa_name(isa);
    EXPECT_EQ(s.out_bf16[20], 0x7FC0) << megatrain::common::isa_name(isa);
    EXPECT_FALSE(std::isnan(s.master[19]));
  }
}

TEST(AdamKernels, StepBelowOneIsRejected) {
  EXPECT_THROW(ca::make_adam_constants(default_hyper(0)), std::invalid_argument);
}

}  // namespace

// --- non-temporal compute-copy stores and software prefetch ---------------------------------

// (isa, output offset in elements from a 64-byte boundary, out dtype)
using NtCase = std::tuple<CpuIsa, int64_t, ca::OutDtype>;

class AdamStreamingStores : public ::testing::TestWithParam<NtCase> {};

TEST_P(AdamStreamingStores, BitIdenticalToOrdinaryStoresAndToScalar) {
  const auto [isa, offset, odt] = GetParam();
  if (!megatrain::common::cpu_supports(isa)) {
    GTEST_SKIP() << "this CPU does not support " << megatrain::common::isa_name(isa);
  }
  const int64_t n = 5000 + 13;  // many whole lines plus a ragged tail
  for (ca::GradDtype gdt : {ca::GradDtype::kFloat32, ca::GradDtype::kBFloat16}) {
    State ref = make_state(n, 4242u);
    State plain = ref, nt = ref;
    // Output buffers at a chosen distance (elements) from a 64-byte boundary.
    std::vector<uint16_t> out_plain(n + 64), out_nt(n + 64, 0xABCD);
    std::vector<float> f_plain(n + 64), f_nt(n + 64, -7.0f);
    auto place = [&](ca::AdamArgs& a, std::vector<uint16_t>& b16, std::vector<float>& b32) {
      if (odt == ca::OutDtype::kBFloat16) {
        uintptr_t p = reinterpret_cast<uintptr_t>(b16.data());
        p = (p + 63) / 64 * 64 + static_cast<uintptr_t>(offset) * 2;
        a.compute_out = reinterpret_cast<void*>(p);
      } else {
        uintptr_t p = reinterpret_cast<uintptr_t>(b32.data());
        p = (p + 63) / 64 * 64 + static_cast<uintptr_t>(offset) * 4;
        a.compute_out = reinterpret_cast<void*>(p);
      }
    };
    for (int64_t step = 1; step <= 2; ++step) {
      const ca::AdamConstants c = ca::make_adam_constants(default_hyper(step));
      ca::adamw_range(args_of(ref, gdt, odt), c, 0, n, CpuIsa::kScalar);
      ca::AdamArgs ap = args_of(plain, gdt, odt);
      place(ap, out_plain, f_plain);
      ca::adamw_range(ap, c, 3, n, isa);  // an unaligned range start too
      ca::adamw_range(ap, c, 0, 3, isa);
      ca::AdamArgs an = args_of(nt, gdt, odt);
      place(an, out_nt, f_nt);
      an.nt_out = true;
      an.prefetch_bytes = step == 1 ? 1024 : 0;
      ca::adamw_range(an, c, 3, n, isa);
      ca::adamw_range(an, c, 0, 3, isa);
      ASSERT_EQ(0, std::memcmp(plain.master.data(), nt.master.data(), n * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(plain.exp_avg.data(), nt.exp_avg.data(), n * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(plain.exp_avg_sq.data(), nt.exp_avg_sq.data(), n * sizeof(float)));
      ASSERT_EQ(0, std::memcmp(ref.master.data(), nt.master.data(), n * sizeof(float)));
      const size_t out_bytes = static_cast<size_t>(n) * (odt == ca::OutDtype::kBFloat16 ? 2 : 4);
      ASSERT_EQ(0, std::memcmp(ap.compute_out, an.compute_out, out_bytes)) << "step " << step;
      if (odt == ca::OutDtype::kBFloat16) {
        ASSERT_EQ(0, std::memcmp(ref.out_bf16.data(), an.compute_out, out_bytes));
      } else {
        ASSERT_EQ(0, std::memcmp(ref.out_f32.data(), an.compute_out, out_bytes));
      }
    }
  }
}

std::string nt_case_name(const ::testing::TestParamInfo<NtCase>& info) {
  const auto [isa, offset, odt] = info.param;
  return isa_label(isa) + "_Offset" + std::to_string(offset) +
         (odt == ca::OutDtype::kBFloat16 ? "_OutBf16" : "_OutFp32");
}

INSTANTIATE_TEST_SUITE_P(Alignments, AdamStreamingStores,
                         ::testing::Combine(kIsas, ::testing::Values<int64_t>(0, 1, 5, 31),
                                            ::testing::Values(ca::OutDtype::kBFloat16,
                                                              ca::OutDtype::kFloat32)),
                         nt_case_name);

// --- every ISA variant against every other and the scalar reference, bit for bit ------------

namespace {

// (grad dtype, compute-copy dtype)
using DtypeCase = std::tuple<ca::GradDtype, ca::OutDtype>;

// Odd lengths: every split into 64-byte-line, vector and scalar-tail parts of both widths.
const int64_t kOddSizes[] = {1, 3, 7, 9, 15, 17, 31, 33, 47, 63, 65, 97, 4099};

bool cpu_has_avx2_and_avx512() {
  return megatrain::common::cpu_supports(CpuIsa::kAvx2) && megatrain::common::cpu_supports(CpuIsa::kAvx512);
}

void expect_same_bytes(const void* a, const void* b, size_t bytes, const char* what, CpuIsa isa) {
  EXPECT_EQ(0, std::memcmp(a, b, bytes)) << what << " of " << megatrain::common::isa_name(isa)
                                         << " differs from the scalar reference";
}

class AdamIsasBitIdentical : public ::testing::TestWithParam<DtypeCase> {};

TEST_P(AdamIsasBitIdentical, Avx2Avx512AndScalarAgreeOnOddLengthsWithAndWithoutStreamingStores) {
  const auto [gdt, odt] = GetParam();
  if (!cpu_has_avx2_and_avx512()) GTEST_SKIP() << "this CPU lacks AVX2 or AVX-512";
  for (int64_t n : kOddSizes) {
    for (bool nt : {false, true}) {
      SCOPED_TRACE("n=" + std::to_string(n) + (nt ? " streaming stores" : " ordinary stores"));
      State ref = make_state(n, 777u + static_cast<uint32_t>(n));
      State avx2 = ref, avx512 = ref;
      for (int64_t step = 1; step <= 3; ++step) {
        ca::AdamHyper h = default_hyper(step);
        if (step == 3) h.beta1 = 0.3;  // torch.lerp's high-weight formula too
        const ca::AdamConstants c = ca::make_adam_constants(h);
        ca::adamw_range(args_of(ref, gdt, odt), c, 0, n, CpuIsa::kScalar);
        for (auto [isa, s] : {std::pair<CpuIsa, State*>{CpuIsa::kAvx2, &avx2}, {CpuIsa::kAvx512, &avx512}}) {
          ca::AdamArgs a = args_of(*s, gdt, odt);
          a.nt_out = nt;
          a.prefetch_bytes = nt ? 256 : 0;
          ca::adamw_range(a, c, 0, n, isa);
        }
      }
      const size_t f32_bytes = static_cast<size_t>(n) * sizeof(float);
      for (auto [isa, s] : {std::pair<CpuIsa, State*>{CpuIsa::kAvx2, &avx2}, {CpuIsa::kAvx512, &avx512}}) {
        expect_same_bytes(ref.master.data(), s->master.data(), f32_bytes, "master", isa);
        expect_same_bytes(ref.exp_avg.data(), s->exp_avg.data(), f32_bytes, "exp_avg", isa);
        expect_same_bytes(ref.exp_avg_sq.data(), s->exp_avg_sq.data(), f32_bytes, "exp_avg_sq", isa);
        expect_same_bytes(ref.out_f32.data(), s->out_f32.data(), f32_bytes, "fp32 compute copy", isa);
        expect_same_bytes(ref.out_bf16.data(), s->out_bf16.data(), static_cast<size_t>(n) * 2,
                          "bf16 compute copy", isa);
      }
    }
  }
}

std::string dtype_case_name(const ::testing::TestParamInfo<DtypeCase>& info) {
  const auto [gdt, odt] = info.param;
  return std::string(gdt == ca::GradDtype::kFloat32 ? "GradFp32" : "GradBf16") +
         (odt == ca::OutDtype::kFloat32 ? "_OutFp32" : odt == ca::OutDtype::kBFloat16 ? "_OutBf16" : "_OutNone");
}

INSTANTIATE_TEST_SUITE_P(EveryDtype, AdamIsasBitIdentical,
                         ::testing::Combine(kGradDtypes, ::testing::Values(ca::OutDtype::kNone, ca::OutDtype::kFloat32,
                                                                           ca::OutDtype::kBFloat16)),
                         dtype_case_name);

class GradAccumulateIsasBitIdentical : public ::testing::TestWithParam<ca::GradDtype> {};

TEST_P(GradAccumulateIsasBitIdentical, Avx2Avx512AndScalarAgreeOnOddLengths) {
  const ca::GradDtype gdt = GetParam();
  if (!cpu_has_avx2_and_avx512()) GTEST_SKIP() << "this CPU lacks AVX2 or AVX-512";
  for (int64_t n : kOddSizes) {
    SCOPED_TRACE("n=" + std::to_string(n));
    State s = make_state(n, 31u + static_cast<uint32_t>(n));
    const void* g = gdt == ca::GradDtype::kFloat32 ? static_cast<const void*>(s.grad_f32.data())
                                                   : static_cast<const void*>(s.grad_bf16.data());
    std::vector<float> ref(n, 0.25f), avx2(n, 0.25f), avx512(n, 0.25f);
    for (bool overwrite : {false, true, false}) {
      const double sr = ca::grad_accumulate_range(ref.data(), g, gdt, overwrite, 0, n, CpuIsa::kScalar);
      const double s2 = ca::grad_accumulate_range(avx2.data(), g, gdt, overwrite, 0, n, CpuIsa::kAvx2);
      const double s5 = ca::grad_accumulate_range(avx512.data(), g, gdt, overwrite, 0, n, CpuIsa::kAvx512);
      expect_same_bytes(ref.data(), avx2.data(), static_cast<size_t>(n) * sizeof(float), "accum", CpuIsa::kAvx2);
      expect_same_bytes(ref.data(), avx512.data(), static_cast<size_t>(n) * sizeof(float), "accum", CpuIsa::kAvx512);
      // The sums of squares are added in another order per width: equal up to double rounding.
      EXPECT_NEAR(s2, sr, 1e-13 * sr);
      EXPECT_NEAR(s5, sr, 1e-13 * sr);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(EveryDtype, GradAccumulateIsasBitIdentical, kGradDtypes,
                         [](const ::testing::TestParamInfo<ca::GradDtype>& info) {
                           return std::string(info.param == ca::GradDtype::kFloat32 ? "GradFp32" : "GradBf16");
                         });

}  // namespace
