#include <gtest/gtest.h>

#include <stdexcept>

#include "megatrain/common/cpu_features.h"

namespace mc = megatrain::common;

TEST(CpuFeatures, ScalarIsAlwaysCompiledAndSupported) {
  EXPECT_TRUE(mc::cpu_supports(mc::CpuIsa::kScalar));
  ASSERT_FALSE(mc::supported_isas().empty());
  EXPECT_EQ(mc::supported_isas().front(), mc::CpuIsa::kScalar);
  EXPECT_EQ(mc::best_supported_isa(), mc::supported_isas().back());
}

TEST(CpuFeatures, NamesRoundTripAndUnknownNameIsRejected) {
  for (mc::CpuIsa isa : {mc::CpuIsa::kScalar, mc::CpuIsa::kAvx2, mc::CpuIsa::kAvx512}) {
    EXPECT_EQ(mc::parse_isa(mc::isa_name(isa)), isa);
  }
  EXPECT_THROW(mc::parse_isa("sse9"), std::invalid_argument);
}

TEST(CpuFeatures, SetActiveIsaSelectsSupportedAndRejectsUnsupported) {
  const mc::CpuIsa original = mc::active_isa();
  for (mc::CpuIsa isa : mc::supported_isas()) {
    mc::set_active_isa(isa);
    EXPECT_EQ(mc::active_isa(), isa);
  }
  for (mc::CpuIsa isa : {mc::CpuIsa::kAvx2, mc::CpuIsa::kAvx512}) {
    if (!mc::cpu_supports(isa)) {
      EXPECT_THROW(mc::set_active_isa(isa), std::runtime_error);
    }
  }
  mc::set_active_isa(original);
}

TEST(CpuFeatures, Avx512ImpliesAvx2) {
  if (mc::cpu_supports(mc::CpuIsa::kAvx512)) {
    EXPECT_TRUE(mc::cpu_supports(mc::CpuIsa::kAvx2));
  }
}
