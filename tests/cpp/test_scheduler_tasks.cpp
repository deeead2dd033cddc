// The worker's kernel tasks against the kernels called directly: the same bits, and the ledger
// transitions they record.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <memory>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include "temp_dir.h"
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

// AdamW hyperparameters of the update tests (a weight decay and a clip scale, as in training).
ca::AdamHyper test_hyper(int64_t step) {
  return ca::AdamHyper{1e-3, 0.9, 0.95, 1e-6, 0.1, step, 0.5f};  // lr, betas, eps, weight_decay, step, grad_scale
}

// The fused AdamW's arguments over fp32 state vectors, a gradient and a bf16 compute copy.
ca::AdamArgs adam_args(std::vector<float>& master, std::vector<float>& m, std::vector<float>& v, const void* grad,
                       ca::GradDtype grad_dtype, std::vector<uint16_t>& compute) {
  ca::AdamArgs a;
  a.master = master.data();
  a.exp_avg = m.data();
  a.exp_avg_sq = v.data();
  a.grad = grad;
  a.grad_dtype = grad_dtype;
  a.compute_out = compute.data();
  a.out_dtype = ca::OutDtype::kBFloat16;
  return a;
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
  const ca::AdamHyper h = test_hyper(3);
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
  t.items.push_back({0, adam_args(master, m, v, compute.data(), ca::GradDtype::kBFloat16, compute), ca::AdamHyper{}, 64});
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

namespace {

// A disk tier of one unit with master / exp_avg / exp_avg_sq of `n` floats (and a second tier
// with the accumulator), under a fresh directory removed afterwards.
struct TierFixture {
  megatrain_test::TempDir tmp{"megatrain_tasks"};
  std::filesystem::path dir = tmp.path;
  std::shared_ptr<megatrain::disk_tier::DiskTier> state, accum;
  explicit TierFixture(int64_t n, std::function<int(megatrain::disk_tier::IoOp, int64_t, int64_t, int64_t)> fault = {}) {
    const int64_t bytes = n * static_cast<int64_t>(sizeof(float));
    megatrain::disk_tier::DiskTierOptions o;
    o.io_threads = 2;
    o.chunk_bytes = 64 << 10;  // several chunks per unit
    o.fault_hook = std::move(fault);
    state = std::make_shared<megatrain::disk_tier::DiskTier>((dir / "state").string(),
                                                             std::vector<megatrain::disk_tier::UnitLayout>{
                                                                 {{bytes, bytes, bytes}}},
                                                             o);
    accum = std::make_shared<megatrain::disk_tier::DiskTier>((dir / "accum").string(),
                                                             std::vector<megatrain::disk_tier::UnitLayout>{{{bytes}}}, o);
  }
  ~TierFixture() {  // the tiers go before their directory
    state.reset();
    accum.reset();
  }
  sch::TierState tier() const { return sch::TierState{state, 0, accum, 0}; }
  // Copies `values` (one vector per section) into unit 0 of `t` and writes it to the file.
  static void put(megatrain::disk_tier::DiskTier& t, const std::vector<std::vector<float>>& values) {
    auto p = t.acquire(0);
    for (size_t s = 0; s < values.size(); ++s) std::memcpy(p[s], values[s].data(), values[s].size() * sizeof(float));
    t.release(0, true);
    t.flush();
    t.drop_cached();  // the task must read the file
  }
  static std::vector<std::vector<float>> get(megatrain::disk_tier::DiskTier& t, int64_t n) {
    t.flush();
    t.drop_cached();
    auto p = t.acquire(0);
    std::vector<std::vector<float>> out;
    for (void* s : p) {
      const float* f = static_cast<const float*>(s);
      out.emplace_back(f, f + n);
    }
    t.release(0, false);
    return out;
  }
};

}  // namespace

TEST(SchedulerTasks, AdamOnTheDiskTierGivesTheBitsOfTheHostStorePath) {
  // Two entries at element offsets 0 and kOff of the unit's fp32 sections; the second one's
  // gradient is the accumulator on disk, the first one's a direct bf16 gradient.
  constexpr int64_t kE = ca::kChunkNumel + 33, kOff = 64 * ((kE + 63) / 64), kTotal = kOff + kE;
  const auto master0 = randn(kTotal, 11), m0 = randn(kTotal, 12, 0.01f), v0 = randn(kTotal, 13, 0.01f);
  std::vector<float> v0abs(v0);
  for (float& x : v0abs) x = std::abs(x);
  const auto direct = to_bf16(randn(kE, 14, 0.1f));
  const auto accum0 = randn(kTotal, 15, 0.1f);
  const ca::AdamHyper h = test_hyper(4);  // the task's grad_scale (0.25) wins over the items'
  // The host path: raw pointers.
  std::vector<float> master(master0), m(m0), v(v0abs), acc(accum0);
  std::vector<uint16_t> out_host(kTotal, 0), out_tier(kTotal, 0);
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{2});
  for (int64_t i : {0, 1}) ledger->queue_update(0, i);
  sch::AdamTask host;
  ca::AdamArgs a0{master.data(), m.data(), v.data(), direct.data(), ca::GradDtype::kBFloat16, out_host.data(),
                  ca::OutDtype::kBFloat16};
  ca::AdamArgs a1{master.data() + kOff, m.data() + kOff, v.data() + kOff, acc.data() + kOff, ca::GradDtype::kFloat32,
                  out_host.data() + kOff, ca::OutDtype::kBFloat16};
  host.items = {{0, a0, h, kE}, {1, a1, h, kE}};
  host.grad_scale = 0.25f;
  host.ledger_entries = {0, 1};
  sch::adam_task(ledger, host, two_threads)();
  // The tier path: the same task by element offsets.
  TierFixture tf(kTotal);
  TierFixture::put(*tf.state, {master0, m0, v0abs});
  TierFixture::put(*tf.accum, {accum0});
  for (int64_t i : {0, 1}) ledger->queue_update(0, i);
  sch::AdamTask tier;
  sch::AdamItem t0{0, {}, h, kE};
  t0.args.grad = direct.data();
  t0.args.grad_dtype = ca::GradDtype::kBFloat16;
  t0.args.compute_out = out_tier.data();
  t0.args.out_dtype = ca::OutDtype::kBFloat16;
  t0.tier_offset = 0;
  sch::AdamItem t1{1, {}, h, kE};
  t1.args.compute_out = out_tier.data() + kOff;
  t1.args.out_dtype = ca::OutDtype::kBFloat16;
  t1.tier_offset = kOff;
  t1.grad_from_tier = true;
  tier.items = {t0, t1};
  tier.grad_scale = 0.25f;
  tier.ledger_entries = {0, 1};
  tier.tier = tf.tier();
  sch::adam_task(ledger, tier, two_threads)();
  EXPECT_EQ(tf.state->unit_state(0), "writing") << "released dirty: written behind";
  const auto got = TierFixture::get(*tf.state, kTotal);
  EXPECT_EQ(0, std::memcmp(got[0].data(), master.data(), sizeof(float) * kTotal));
  EXPECT_EQ(0, std::memcmp(got[1].data(), m.data(), sizeof(float) * kTotal));
  EXPECT_EQ(0, std::memcmp(got[2].data(), v.data(), sizeof(float) * kTotal));
  EXPECT_EQ(0, std::memcmp(out_tier.data(), out_host.data(), sizeof(uint16_t) * kTotal));
  EXPECT_NE(0, std::memcmp(got[0].data(), master0.data(), sizeof(float) * kTotal));
  EXPECT_EQ(tf.accum->unit_state(0), "cached") << "the accumulator is read, not written";
  EXPECT_EQ(ledger->get(0, 1).update, sch::UpdateState::kDone);
}

TEST(SchedulerTasks, AccumulateIntoTheDiskTierSumsLikeTheHostPathAndWritesBehind) {
  constexpr int64_t kE = 3000;
  const auto g1 = to_bf16(randn(kE, 21)), g2 = to_bf16(randn(kE, 22));
  std::vector<float> want(kE);
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  TierFixture tf(kE);
  double want_sq = 0, got_sq = 0;
  for (int pass = 0; pass < 2; ++pass) {
    const auto& g = pass == 0 ? g1 : g2;
    want_sq = ca::grad_accumulate_tensor(want.data(), g.data(), ca::GradDtype::kBFloat16, pass == 0, kE);
    sch::StagedGrad s;
    s.grad = g.data();
    s.numel = kE;
    s.overwrite = ledger->begin_d2h(0, 0, false);
    s.tier_offset = 0;
    auto outcome = std::make_shared<sch::GradOutcome>();
    sch::accumulate_task(ledger, 0, {}, {s}, outcome, {}, sch::TierState{nullptr, -1, tf.accum, 0})();
    got_sq = ledger->get(0, 0).grad_sq;
    EXPECT_TRUE(outcome->finite.load());
  }
  EXPECT_EQ(got_sq, want_sq);
  const auto got = TierFixture::get(*tf.accum, kE);
  EXPECT_EQ(0, std::memcmp(got[0].data(), want.data(), sizeof(float) * kE));
}

TEST(SchedulerTasks, ASkippedUpdateOnTheDiskTierRestoresFromTheMastersOnDiskAndWritesNothing) {
  constexpr int64_t kE = 500;
  const auto master0 = randn(kE, 31);
  std::vector<uint16_t> compute(kE, 0x1234);  // a direct gradient sits there
  TierFixture tf(kE);
  TierFixture::put(*tf.state, {master0, std::vector<float>(kE, 0.0f), std::vector<float>(kE, 0.0f)});
  const auto writes0 = tf.state->stats().unit_writes;
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  ledger->queue_update(0, 0);
  auto bad = std::make_shared<sch::GradOutcome>();
  bad->finite = false;
  sch::AdamTask t;
  sch::AdamItem it{0, {}, ca::AdamHyper{}, kE};
  it.args.grad = compute.data();
  it.args.grad_dtype = ca::GradDtype::kBFloat16;
  it.args.compute_out = compute.data();
  it.args.out_dtype = ca::OutDtype::kBFloat16;
  it.tier_offset = 0;
  t.items = {it};
  t.ledger_entries = {0};
  t.finite_from = bad;
  sch::WeightsBack back{nullptr, compute.data(), ca::OutDtype::kBFloat16, kE};
  back.tier_offset = 0;
  t.restore_on_skip = {back};
  t.outcome = std::make_shared<sch::UpdateOutcome>();
  t.tier = sch::TierState{tf.state, 0, nullptr, -1};
  sch::adam_task(ledger, t)();
  EXPECT_TRUE(t.outcome->skipped.load());
  EXPECT_EQ(compute, to_bf16(master0));
  EXPECT_EQ(tf.state->unit_state(0), "cached") << "released clean";
  EXPECT_EQ(tf.state->stats().unit_writes, writes0);
}

TEST(SchedulerTasks, AnIoErrorOfTheTierFailsTheTaskWithTheTiersMessage) {
  constexpr int64_t kE = 256;
  std::atomic<bool> broken{false};
  TierFixture tf(kE, [&](megatrain::disk_tier::IoOp op, int64_t, int64_t, int64_t) {
    return broken.load() && op == megatrain::disk_tier::IoOp::kRead ? EIO : 0;
  });
  TierFixture::put(*tf.state, {randn(kE, 41), randn(kE, 42), randn(kE, 43)});
  broken = true;
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  std::vector<uint16_t> compute(kE, 0);
  sch::AdamTask t;
  sch::WeightsBack back{nullptr, compute.data(), ca::OutDtype::kBFloat16, kE};
  back.tier_offset = 0;
  t.restore = {back};
  t.tier = sch::TierState{tf.state, 0, nullptr, -1};
  try {
    sch::adam_task(ledger, t)();
    FAIL() << "expected DiskTierError";
  } catch (const megatrain::disk_tier::DiskTierError& e) {
    EXPECT_EQ(e.errno_value(), EIO);
    EXPECT_NE(std::string(e.what()).find("restart from the last checkpoint"), std::string::npos) << e.what();
  }
  EXPECT_EQ(compute, std::vector<uint16_t>(kE, 0)) << "nothing written from a failed read";
  EXPECT_THROW(sch::weights_back_task({back}), std::invalid_argument);
}

TEST(SchedulerTasks, OutcomesRecordWhenTheTasksRanOnTheSteadyClock) {
  // The gradient task, then the update gated on it, on the worker thread: each outcome's started_s /
  // finished_s is -1 before it ran, then the task's span on steady_now()'s clock, in order.
  std::vector<float> accum(kN), master = randn(kN, 7), m(kN, 0.0f), v(kN, 0.0f);
  std::vector<uint16_t> compute(kN);
  const auto grad = to_bf16(randn(kN, 8, 0.1f));
  auto ledger = std::make_shared<sch::Ledger>(std::vector<int64_t>{1});
  sch::StagedGrad s;
  s.accum = accum.data();
  s.grad = grad.data();
  s.numel = kN;
  s.overwrite = ledger->begin_d2h(0, 0, false);
  auto g = std::make_shared<sch::GradOutcome>();
  auto u = std::make_shared<sch::UpdateOutcome>();
  EXPECT_EQ(g->started_s.load(), -1.0);
  EXPECT_EQ(g->finished_s.load(), -1.0);
  EXPECT_EQ(u->started_s.load(), -1.0);
  EXPECT_EQ(u->finished_s.load(), -1.0);

  sch::AdamTask at;
  at.items.push_back({0, adam_args(master, m, v, accum.data(), ca::GradDtype::kFloat32, compute), test_hyper(1), kN});
  at.ledger_entries = {0};
  at.outcome = u;

  const double before = sch::steady_now();
  sch::Worker w;
  sch::Task gt;
  gt.run = sch::accumulate_task(ledger, 0, {}, {s}, g);
  sch::TaskRef gh = w.submit(std::move(gt));
  ledger->queue_update(0, 0);
  sch::Task ut;
  ut.klass = sch::TaskClass::kUpdate;
  ut.gate = sch::after_task(gh);
  ut.run = sch::adam_task(ledger, at);
  w.submit(std::move(ut));
  w.drain();
  const double after = sch::steady_now();

  EXPECT_TRUE(g->ran.load());
  EXPECT_TRUE(u->ran.load());
  EXPECT_LE(before, g->started_s.load());
  EXPECT_LE(g->started_s.load(), g->finished_s.load());
  EXPECT_LE(g->finished_s.load(), u->started_s.load());  // gated on the gradient task
  EXPECT_LE(u->started_s.load(), u->finished_s.load());
  EXPECT_LE(u->finished_s.load(), after);
  // seconds is the same span (the same two clock reads)
  EXPECT_NEAR(g->seconds.load(), g->finished_s.load() - g->started_s.load(), 1e-6);
  EXPECT_NEAR(u->seconds.load(), u->finished_s.load() - u->started_s.load(), 1e-6);
  EXPECT_GT(u->seconds.load(), 0.0);
}
