// The gradient ledger: every legal transition and its effect, and every illegal one refused
// without changing the entry.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <vector>

#include "megatrain/scheduler/ledger.h"

namespace sch = megatrain::scheduler;
using sch::GradPlace;
using sch::UpdateState;

namespace {

// Drives entry (0, 0) of a fresh ledger into `place`.
std::unique_ptr<sch::Ledger> ledger_in(GradPlace place) {
  auto owned = std::make_unique<sch::Ledger>(std::vector<int64_t>{1});
  sch::Ledger& l = *owned;
  switch (place) {
    case GradPlace::kNone: break;
    case GradPlace::kOnDevice: l.on_device(0, 0); break;
    case GradPlace::kInFlightStaging: l.begin_d2h(0, 0, false); break;
    case GradPlace::kInFlightDirect: l.begin_d2h(0, 0, true); break;
    case GradPlace::kDirect:
      l.begin_d2h(0, 0, true);
      l.landed_direct(0, 0, 4.0, true);
      break;
    case GradPlace::kAccumulated:
      l.begin_d2h(0, 0, false);
      l.accumulated(0, 0, 9.0);
      break;
  }
  EXPECT_EQ(l.get(0, 0).place, place);
  return owned;
}

const GradPlace kAllPlaces[] = {GradPlace::kNone, GradPlace::kOnDevice, GradPlace::kInFlightStaging,
                                GradPlace::kInFlightDirect, GradPlace::kDirect, GradPlace::kAccumulated};

struct Transition {
  const char* name;
  std::function<void(sch::Ledger&)> apply;
  std::vector<GradPlace> legal_from;
};

std::vector<Transition> place_transitions() {
  return {
      {"begin_d2h(direct)", [](sch::Ledger& l) { l.begin_d2h(0, 0, true); }, {GradPlace::kNone}},
      {"begin_d2h(staged)", [](sch::Ledger& l) { l.begin_d2h(0, 0, false); },
       {GradPlace::kNone, GradPlace::kInFlightStaging, GradPlace::kAccumulated}},
      {"on_device", [](sch::Ledger& l) { l.on_device(0, 0); }, {GradPlace::kNone, GradPlace::kOnDevice}},
      {"landed_direct", [](sch::Ledger& l) { l.landed_direct(0, 0, 1.0, true); }, {GradPlace::kInFlightDirect}},
      {"accumulated", [](sch::Ledger& l) { l.accumulated(0, 0, 1.0); }, {GradPlace::kInFlightStaging}},
      {"moved_to_accumulator", [](sch::Ledger& l) { l.moved_to_accumulator(0, 0, 1.0); }, {GradPlace::kDirect}},
      {"record_norm", [](sch::Ledger& l) { l.record_norm(0, 0, 1.0); }, {GradPlace::kOnDevice, GradPlace::kDirect}},
      {"reset", [](sch::Ledger& l) { l.reset(0, 0); },
       {GradPlace::kNone, GradPlace::kOnDevice, GradPlace::kDirect, GradPlace::kAccumulated}},
  };
}

bool same(const sch::EntryState& a, const sch::EntryState& b) {
  return a.place == b.place && a.micro_batches == b.micro_batches && a.in_flight == b.in_flight &&
         a.grad_sq == b.grad_sq && a.norm_known == b.norm_known && a.finite == b.finite &&
         a.eager == b.eager && a.update == b.update;
}

}  // namespace

TEST(Ledger, EveryPlaceTransitionIsLegalExactlyFromItsSourceStates) {
  for (const Transition& t : place_transitions()) {
    for (GradPlace from : kAllPlaces) {
      std::unique_ptr<sch::Ledger> owned = ledger_in(from);
      sch::Ledger& l = *owned;
      const sch::EntryState before = l.get(0, 0);
      const bool legal = std::find(t.legal_from.begin(), t.legal_from.end(), from) != t.legal_from.end();
      if (legal) {
        EXPECT_NO_THROW(t.apply(l)) << t.name << " from " << sch::grad_place_name(from);
      } else {
        try {
          t.apply(l);
          ADD_FAILURE() << t.name << " from " << sch::grad_place_name(from) << " was accepted";
        } catch (const sch::LedgerError& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find(sch::grad_place_name(from)), std::string::npos) << msg;
          EXPECT_NE(msg.find("unit 0 entry 0"), std::string::npos) << msg;
        }
        EXPECT_TRUE(same(l.get(0, 0), before)) << t.name << " changed the entry before refusing";
      }
    }
  }
}

TEST(Ledger, DirectGradientLandsThenMovesToTheAccumulator) {
  sch::Ledger l({2});
  EXPECT_TRUE(l.begin_d2h(0, 1, true));  // nothing of this window yet: an overwrite
  EXPECT_TRUE(l.any_in_compute(0));
  sch::EntryState s = l.get(0, 1);
  EXPECT_EQ(s.place, GradPlace::kInFlightDirect);
  EXPECT_EQ(s.micro_batches, 1);
  EXPECT_EQ(s.in_flight, 1);
  l.landed_direct(0, 1, 0.0, false);  // no norm needed
  s = l.get(0, 1);
  EXPECT_EQ(s.place, GradPlace::kDirect);
  EXPECT_FALSE(s.norm_known);
  EXPECT_EQ(s.in_flight, 0);
  l.record_norm(0, 1, 2.5);
  EXPECT_EQ(l.get(0, 1).grad_sq, 2.5);
  l.moved_to_accumulator(0, 1, 3.5);
  s = l.get(0, 1);
  EXPECT_EQ(s.place, GradPlace::kAccumulated);
  EXPECT_EQ(s.grad_sq, 3.5);
  EXPECT_FALSE(l.any_in_compute(0));
  EXPECT_FALSE(l.begin_d2h(0, 1, false));  // the accumulator holds the first: add to it
  EXPECT_EQ(l.get(0, 1).micro_batches, 2);
  EXPECT_EQ(l.get(0, 0).place, GradPlace::kNone);  // the other entry is untouched
}

TEST(Ledger, StagedGradientsInFlightTogetherLandInOrder) {
  sch::Ledger l({1});
  EXPECT_TRUE(l.begin_d2h(0, 0, false));
  EXPECT_FALSE(l.begin_d2h(0, 0, false));  // the first in flight overwrites; this one adds
  EXPECT_EQ(l.get(0, 0).in_flight, 2);
  l.accumulated(0, 0, 1.0);
  EXPECT_EQ(l.get(0, 0).place, GradPlace::kInFlightStaging);
  EXPECT_THROW(l.reset(0, 0), sch::LedgerError);  // one still in flight
  l.accumulated(0, 0, 4.0);
  const sch::EntryState s = l.get(0, 0);
  EXPECT_EQ(s.place, GradPlace::kAccumulated);
  EXPECT_EQ(s.grad_sq, 4.0);
  EXPECT_EQ(s.micro_batches, 2);
  EXPECT_THROW(l.accumulated(0, 0, 1.0), sch::LedgerError);
}

TEST(Ledger, NonFiniteNormIsRecordedPerEntry) {
  sch::Ledger l({3});
  l.begin_d2h(0, 0, false);
  l.accumulated(0, 0, 1.0);
  l.begin_d2h(0, 1, false);
  l.accumulated(0, 1, std::numeric_limits<double>::infinity());
  l.begin_d2h(0, 2, true);
  l.landed_direct(0, 2, std::nan(""), true);
  EXPECT_TRUE(l.finite(0, {0}));
  EXPECT_FALSE(l.finite(0, {0, 1}));
  EXPECT_FALSE(l.finite(0, {2}));
  EXPECT_FALSE(l.get(0, 2).finite);
  const std::vector<double> sq = l.grad_sq(0);
  EXPECT_EQ(sq[0], 1.0);
  EXPECT_TRUE(std::isinf(sq[1]));
  l.reset(0, 1);
  EXPECT_TRUE(l.finite(0, {0, 1}));
  EXPECT_EQ(l.grad_sq(0)[1], 0.0);
}

TEST(Ledger, DeviceStateGradientsStayOnDeviceAcrossMicroBatches) {
  sch::Ledger l({1});
  l.on_device(0, 0);
  l.on_device(0, 0);
  l.record_norm(0, 0, 8.0);
  sch::EntryState s = l.get(0, 0);
  EXPECT_EQ(s.place, GradPlace::kOnDevice);
  EXPECT_EQ(s.micro_batches, 2);
  EXPECT_EQ(s.grad_sq, 8.0);
  l.reset(0, 0);
  s = l.get(0, 0);
  EXPECT_EQ(s.place, GradPlace::kNone);
  EXPECT_EQ(s.micro_batches, 0);
  EXPECT_FALSE(s.norm_known);
}

TEST(Ledger, EagerNeedsAGradientAndResetClearsIt) {
  sch::Ledger l({1});
  EXPECT_THROW(l.mark_eager(0, 0), sch::LedgerError);
  l.begin_d2h(0, 0, true);
  l.mark_eager(0, 0);
  EXPECT_TRUE(l.get(0, 0).eager);
  l.landed_direct(0, 0, 1.0, true);
  l.reset(0, 0);
  EXPECT_FALSE(l.get(0, 0).eager);
}

TEST(Ledger, UpdateStateMachine) {
  sch::Ledger l({1});
  EXPECT_FALSE(l.update_pending(0));
  EXPECT_THROW(l.start_update(0, 0), sch::LedgerError);
  EXPECT_THROW(l.finish_update(0, 0), sch::LedgerError);
  EXPECT_THROW(l.cancel_update(0, 0), sch::LedgerError);
  l.queue_update(0, 0);
  EXPECT_TRUE(l.update_pending(0));
  EXPECT_THROW(l.queue_update(0, 0), sch::LedgerError);  // already queued
  EXPECT_THROW(l.finish_update(0, 0), sch::LedgerError);
  l.cancel_update(0, 0);
  EXPECT_EQ(l.get(0, 0).update, UpdateState::kNone);
  EXPECT_FALSE(l.update_pending(0));
  l.queue_update(0, 0);
  l.start_update(0, 0);
  EXPECT_EQ(l.get(0, 0).update, UpdateState::kRunning);
  EXPECT_TRUE(l.update_pending(0));
  EXPECT_THROW(l.queue_update(0, 0), sch::LedgerError);
  EXPECT_THROW(l.start_update(0, 0), sch::LedgerError);
  EXPECT_THROW(l.cancel_update(0, 0), sch::LedgerError);
  l.finish_update(0, 0);
  EXPECT_EQ(l.get(0, 0).update, UpdateState::kDone);
  EXPECT_FALSE(l.update_pending(0));
  EXPECT_THROW(l.finish_update(0, 0), sch::LedgerError);
  l.queue_update(0, 0);  // the next step's update
  EXPECT_EQ(l.get(0, 0).update, UpdateState::kQueued);
}

TEST(Ledger, ResetOfTheWindowKeepsAQueuedUpdate) {
  // step() queues the updates, then zero_grad() opens the next window before they ran.
  sch::Ledger l({1});
  l.begin_d2h(0, 0, false);
  l.accumulated(0, 0, 2.0);
  l.queue_update(0, 0);
  l.reset(0, 0);
  const sch::EntryState s = l.get(0, 0);
  EXPECT_EQ(s.place, GradPlace::kNone);
  EXPECT_EQ(s.update, UpdateState::kQueued);
  EXPECT_TRUE(l.update_pending(0));
}

TEST(Ledger, AQueuedUpdateTakesOverADirectGradientAndItsWindowEndsAtTheNextGradient) {
  sch::Ledger l({2});
  l.begin_d2h(0, 0, true);
  l.landed_direct(0, 0, 1.0, true);
  EXPECT_TRUE(l.any_in_compute(0));  // untaken: a load rebuilds the weights from the masters
  l.queue_update(0, 0);
  EXPECT_FALSE(l.any_in_compute(0));  // the update rewrites the compute copy
  l.start_update(0, 0);
  l.finish_update(0, 0);
  EXPECT_FALSE(l.any_in_compute(0));
  EXPECT_EQ(l.get(0, 0).place, GradPlace::kDirect);
  l.begin_d2h(0, 1, false);  // another entry's gradient leaves entry 0's update done
  EXPECT_EQ(l.get(0, 0).update, UpdateState::kDone);
  l.accumulated(0, 1, 1.0);
  l.reset(0, 0);  // the window is over: done is forgotten
  EXPECT_EQ(l.get(0, 0).update, UpdateState::kNone);
  l.queue_update(0, 1);
  l.start_update(0, 1);
  l.finish_update(0, 1);
  l.begin_d2h(0, 1, false);  // the next window's gradient: done is forgotten
  EXPECT_EQ(l.get(0, 1).update, UpdateState::kNone);
  l.queue_update(0, 0);
  l.start_update(0, 0);
  l.finish_update(0, 0);
  l.on_device(0, 0);
  EXPECT_EQ(l.get(0, 0).update, UpdateState::kNone);
}

TEST(Ledger, StatesReturnsEveryEntryOfAUnitInOrder) {
  sch::Ledger l({3, 1});
  l.begin_d2h(0, 2, true);
  l.begin_d2h(0, 0, false);
  l.accumulated(0, 0, 4.0);
  const std::vector<sch::EntryState> s = l.states(0);
  ASSERT_EQ(s.size(), 3u);
  EXPECT_EQ(s[0].place, GradPlace::kAccumulated);
  EXPECT_EQ(s[0].grad_sq, 4.0);
  EXPECT_EQ(s[1].place, GradPlace::kNone);
  EXPECT_EQ(s[2].place, GradPlace::kInFlightDirect);
  EXPECT_EQ(l.states(1).size(), 1u);
  EXPECT_THROW(l.states(2), std::out_of_range);
}

TEST(Ledger, OutOfRangeEntriesAreRefused) {
  sch::Ledger l({2, 0});
  EXPECT_EQ(l.num_units(), 2);
  EXPECT_EQ(l.num_entries(0), 2);
  EXPECT_EQ(l.num_entries(1), 0);
  EXPECT_THROW(l.get(0, 2), std::out_of_range);
  EXPECT_THROW(l.begin_d2h(1, 0, true), std::out_of_range);
  EXPECT_THROW(l.get(2, 0), std::out_of_range);
  EXPECT_THROW(l.num_entries(-1), std::out_of_range);
  EXPECT_THROW(sch::Ledger({-1}), std::invalid_argument);
}
