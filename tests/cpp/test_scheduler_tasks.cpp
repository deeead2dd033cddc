// The worker's kernel tasks against the kernels called directly: the same bits, and the ledger
// transitions they record.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "megatrain/common/cpu_features.h"
#include "megatrain/cpu_adam/adam_driver.h"
#include "megatrain/cpu_adam/kernels/adam_scalar_inl.h"
#include "megatrain/scheduler/tasks.h"
#include "megatrain/scheduler/worker.h"

namespace ca = megatrain::cpu_adam;
namespace sch = megatrain::scheduler;

namespace {

// Larger than two chunks, with a remainder after the vector width.
constexpr int64_t kN = 2 * ca::kChunkNumel + 17;

std::vector<float> randn(int64_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = ca::detail::float_to_bf16_rne(v[i]);
  return out;
}

// Splits the chunks over two threads, as at::parallel_for may.
void two_threads(int64_t chunks, const std::function<void(int64_t, int64_t)>& body) {
  const int64_t mid = chunks / 2;
  std::thread t([&] { body(0, mid); });
  body(mid, chunks);
  t.join();
}

}  // namespace

TEST(SchedulerTasks, AccumulateMatchesTheKernelAndRecordsTheNorm) {
  const auto g1 = to_bf16(randn(kN, 1));
  const auto g2 = to_bf16(randn(kN, 2));
  std::vector<float> want(kN), got(kN);
  const double sq1 = ca::grad_accumulate_range(want.data(), g1.data(), ca::GradDtype::kBFloat16, true, 0, kN,
                                               megatrain::common::CpuIsa::kScalar);
  (void)sq1;
  double want_sq = 0.0;  // the drivers' chunked order
  for (int64_t c = 0; c * ca::kChunkNumel < kN; ++c) {
    want_sq += ca::grad_accumulate_range(want.data(), g2.data(), ca::GradDtype::kBFloat16, false, c * ca::kChunkNumel,
                                         std::min(kN, (c + 1) * ca::kChunkNumel), megatrain::common::active_isa());
  }
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  sch::Worker w;
  for (int pass = 0; pass < 2; ++pass) {
    sch::StagedGrad s;
    s.entry = 0;
    s.accum = got.data();
    s.grad = pass == 0 ? g1.data() : g2.data();
    s.numel = kN;
    s.overwrite = ledger->begin_d2h(0, 0, false);
    EXPECT_EQ(s.overwrite, pass == 0);
    auto outcome = std::make_shared<sch::GradOutcome>();
    sch::Task t;
    t.run = sch::accumulate_task(ledger, 0, {}, {s}, outcome, two_threads);
    w.submit(std::move(t));
    w.drain();
    EXPECT_TRUE(outcome->ran.load());
    EXPECT_TRUE(outcome->finite.load());
  }
  EXPECT_EQ(0, std::memcmp(want.data(), got.data(), sizeof(float) * kN));
  const sch::EntryState st = ledger->get(0, 0);
  EXPECT_EQ(st.place, sch::GradPlace::kAccumulated);
  EXPECT_EQ(st.grad_sq, want_sq);  // bit-identical: same chunks, same order of the partial sums
  EXPECT_EQ(st.micro_batches, 2);
}

TEST(SchedulerTasks, AccumulateLandsDirectGradientsWithTheSquaredDeviceNorm) {
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{2});
  ledger->begin_d2h(0, 0, true);
  ledger->begin_d2h(0, 1, true);
  const double norms[2] = {3.0, std::numeric_limits<double>::infinity()};
  auto outcome = std::make_shared<sch::GradOutcome>();
  sch::accumulate_task(ledger, 0, {{0, &norms[0]}, {1, &norms[1]}}, {}, outcome)();
  EXPECT_EQ(ledger->get(0, 0).place, sch::GradPlace::kDirect);
  EXPECT_EQ(ledger->get(0, 0).grad_sq, 9.0);
  EXPECT_FALSE(ledger->get(0, 1).finite);
  EXPECT_FALSE(outcome->finite.load());
}

TEST(SchedulerTasks, AdamMatchesTheOpAndWritesTheComputeCopy) {
  const auto master0 = randn(kN, 3);
  const auto grad = to_bf16(randn(kN, 4, 0.1f));
  ca::AdamHyper h;
  h.lr = 1e-3;
  h.beta1 = 0.9;
  h.beta2 = 0.95;
  h.eps = 1e-6;
  h.weight_decay = 0.1;
  h.step = 3;
  h.grad_scale = 0.5f;
  struct S {
    std::vector<float> master, m, v;
    std::vector<uint16_t> out;
  };
  auto make = [&] { return S{master0, std::vector<float>(kN, 0.01f), std::vector<float>(kN, 0.02f), std::vector<uint16_t>(kN)}; };
  S want = make(), got = make();
  auto args = [&](S& s) {
    ca::AdamArgs a;
    a.master = s.master.data();
    a.exp_avg = s.m.data();
    a.exp_avg_sq = s.v.data();
    a.grad = grad.data();
    a.grad_dtype = ca::GradDtype::kBFloat16;
    a.compute_out = s.out.data();
    a.out_dtype = ca::OutDtype::kBFloat16;
    return a;
  };
  ca::adamw_tensor(args(want), h, kN);  // what the adamw_step_ op runs
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  ledger->queue_update(0, 0);
  sch::AdamTask t;
  t.unit = 0;
  ca::AdamHyper h1 = h;
  h1.grad_scale = 1.0f;  // the task's grad_scale wins
  t.items.push_back({0, args(got), h1, kN});
  t.grad_scale = 0.5f;
  t.ledger_entries = {0};
  sch::adam_task(ledger, t, two_threads)();
  EXPECT_EQ(0, std::memcmp(want.master.data(), got.master.data(), sizeof(float) * kN));
  EXPECT_EQ(0, std::memcmp(want.m.data(), got.m.data(), sizeof(float) * kN));
  EXPECT_EQ(0, std::memcmp(want.v.data(), got.v.data(), sizeof(float) * kN));
  EXPECT_EQ(0, std::memcmp(want.out.data(), got.out.data(), sizeof(uint16_t) * kN));
  EXPECT_NE(0, std::memcmp(master0.data(), got.master.data(), sizeof(float) * kN));
  EXPECT_EQ(ledger->get(0, 0).update, sch::UpdateState::kDone);
}

TEST(SchedulerTasks, NonFiniteGradientSkipsTheUpdateAndRestoresTheWeights) {
  std::vector<float> master = randn(64, 5), m(64, 0.0f), v(64, 0.0f);
  std::vector<uint16_t> compute(64, 0x1234);  // a gradient sits there (direct D2H)
  const std::vector<float> master0 = master;
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  ledger->queue_update(0, 0);
  auto outcome = std::make_shared<sch::GradOutcome>();
  outcome->finite = false;
  sch::AdamTask t;
  ca::AdamArgs a;
  a.master = master.data();
  a.exp_avg = m.data();
  a.exp_avg_sq = v.data();
  a.grad = compute.data();
  a.grad_dtype = ca::GradDtype::kBFloat16;
  a.compute_out = compute.data();
  a.out_dtype = ca::OutDtype::kBFloat16;
  t.items.push_back({0, a, ca::AdamHyper{}, 64});
  t.ledger_entries = {0};
  t.finite_from = outcome;
  t.restore_on_skip = {{master.data(), compute.data(), ca::OutDtype::kBFloat16, 64}};
  t.outcome = std::make_shared<sch::UpdateOutcome>();
  sch::adam_task(ledger, t)();
  EXPECT_TRUE(t.outcome->skipped.load());
  EXPECT_EQ(master, master0);
  EXPECT_EQ(compute, to_bf16(master0));
  EXPECT_EQ(ledger->get(0, 0).update, sch::UpdateState::kDone);
}

TEST(SchedulerTasks, WeightsBackRoundsLikeTensorCopy) {
  std::vector<float> master = {1.0f, -2.5f, 3.14159265f, std::nanf(""), 1.00390625f, 1.01171875f};
  std::vector<uint16_t> bf(master.size(), 0);
  std::vector<float> f32(master.size(), 0.0f);
  sch::weights_back_task({{master.data(), bf.data(), ca::OutDtype::kBFloat16, 6},
                          {master.data(), f32.data(), ca::OutDtype::kFloat32, 6}})();
  EXPECT_EQ(bf[0], 0x3F80);
  EXPECT_EQ(bf[1], 0xC020);
  EXPECT_EQ(bf[2], 0x4049);   // 3.14159 -> 0x40490FDB rounds down
  EXPECT_EQ(bf[3], 0x7FC0);   // NaN
  EXPECT_EQ(bf[4], 0x3F80);   // a tie (0x3F808000): rounds to even
  EXPECT_EQ(bf[5], 0x3F82);   // a tie (0x3F818000): rounds to even, upwards
  EXPECT_EQ(0, std::memcmp(master.data(), f32.data(), sizeof(float) * 6));
}

TEST(SchedulerTasks, MoveToAccumulatorSumsTheDirectGradientAndRestoresTheWeights) {
  std::vector<float> master = randn(100, 6);
  const auto g = randn(100, 7);
  std::vector<uint16_t> compute = to_bf16(g);  // the direct gradient
  std::vector<float> accum(100, 123.0f);
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  ledger->begin_d2h(0, 0, true);
  ledger->landed_direct(0, 0, 0.0, false);
  sch::StagedGrad s;
  s.accum = accum.data();
  s.grad = compute.data();
  s.numel = 100;
  const auto gb = compute;
  sch::move_to_accumulator_task(ledger, 0, {s}, {{master.data(), compute.data(), ca::OutDtype::kBFloat16, 100}})();
  double sq = 0.0;
  for (int i = 0; i < 100; ++i) {
    const float want = ca::detail::bf16_to_float(gb[i]);
    EXPECT_EQ(accum[i], want);  // overwritten, not added to the 123s
    sq += static_cast<double>(want) * want;
  }
  EXPECT_EQ(compute, to_bf16(master));
  EXPECT_EQ(ledger->get(0, 0).place, sch::GradPlace::kAccumulated);
  EXPECT_NEAR(ledger->get(0, 0).grad_sq, sq, 1e-9 * sq);
  EXPECT_THROW(sch::move_to_accumulator_task(ledger, 0, {s}, {}), std::invalid_argument);
}
