#include "server/call_gate.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "core/gloo_collective.h"
#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/worker_state.h"

// The call gate (server/call_gate.h): every rank learns which ranks are past
// their deadline or cancelled, all stop together, and the collective stays
// in step (issue 13 item 6).

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

std::vector<std::unique_ptr<core::GlooCollective>> FormGroup(int n) {
  auto store = std::make_shared<gloo::rendezvous::HashStore>();
  std::vector<std::unique_ptr<core::GlooCollective>> group(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      auto formed =
          core::GlooCollective::Create(store, "gate", r, n, "127.0.0.1", absl::Seconds(10));
      EXPECT_TRUE(formed.ok()) << formed.status();
      if (formed.ok()) group[r] = std::move(*formed);
    });
  }
  for (std::thread& t : threads) t.join();
  return group;
}

TEST(CallGate, OneRankGoesInTimeAndStopsPastItsDeadlineOrWhenCancelled) {
  auto group = FormGroup(1);
  ASSERT_NE(group[0], nullptr);
  core::GlooCollective& world = *group[0];
  EXPECT_TRUE(CallGate(world, CallBound{}, "Forward (layer 0): before dispatch", "hint").ok());
  EXPECT_TRUE(CallGate(world, CallBound{absl::Now() + absl::Hours(1), [] { return false; }},
                       "Forward (layer 0): before dispatch", "hint")
                  .ok());

  const absl::Status late = CallGate(world, CallBound{absl::Now() - absl::Seconds(1), nullptr},
                                     "Forward (layer 0): before dispatch", "send it again");
  EXPECT_EQ(late.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(late.message(),
            "Forward (layer 0): before dispatch: stopped on every rank: the call's deadline "
            "passed on rank(s) [0]; nothing was committed and the group stays usable: send it "
            "again");
  EXPECT_TRUE(IsAgreedStop(late));
  EXPECT_FALSE(IsGroupError(late));
  // A status rebuilt from code and message is a plain timeout again.
  EXPECT_FALSE(IsAgreedStop(absl::Status(late.code(), late.message())));
  EXPECT_TRUE(IsGroupError(absl::Status(late.code(), late.message())));

  const absl::Status cancelled =
      CallGate(world, CallBound{absl::InfiniteFuture(), [] { return true; }}, "X", "h");
  EXPECT_EQ(cancelled.code(), absl::StatusCode::kCancelled);
  EXPECT_THAT(std::string(cancelled.message()),
              HasSubstr("X: stopped on every rank: the client cancelled the call on rank(s) [0]"));
  EXPECT_TRUE(IsAgreedStop(cancelled));
  EXPECT_FALSE(IsGroupError(cancelled));
}

// Rank 0 is past its deadline, rank 1 cancelled, rank 2 in time but 300 ms
// late to the gate (while ranks 0 and 1 are already past their deadlines,
// so a wait bounded by the deadline would have broken the group): all three
// stop with the same message, and the group stays in step.
TEST(CallGate, ThreeRanksAllStopTogetherAndStayInStep) {
  auto group = FormGroup(3);
  for (const auto& g : group) ASSERT_NE(g, nullptr);
  const absl::Time past = absl::Now() - absl::Seconds(1);
  const CallBound calls[3] = {CallBound{past, nullptr},
                              CallBound{absl::InfiniteFuture(), [] { return true; }},
                              CallBound{absl::Now() + absl::Hours(1), [] { return false; }}};
  absl::Status got[3];
  std::vector<std::thread> threads;
  threads.reserve(3);
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      group[r]->SetCallDeadline(calls[r].deadline);
      if (r == 2) absl::SleepFor(absl::Milliseconds(300));
      got[r] = CallGate(*group[r], calls[r], "ForwardLayers: before layer 2 of 5", "hint");
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 3; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << got[r];
    EXPECT_EQ(got[r].message(),
              "ForwardLayers: before layer 2 of 5: stopped on every rank: the call's deadline "
              "passed on rank(s) [0]; the client cancelled the call on rank(s) [1]; nothing was "
              "committed and the group stays usable: hint");
    EXPECT_TRUE(IsAgreedStop(got[r]));
  }
  // In step: the next collective (with no deadline) works on every rank,
  // and a gate where every rank is in time lets all go on.
  threads.clear();
  for (int r = 0; r < 3; ++r) {
    threads.emplace_back([&, r] {
      group[r]->SetCallDeadline(absl::InfiniteFuture());
      EXPECT_TRUE(group[r]->Barrier().ok()) << "rank " << r;
      got[r] = CallGate(*group[r], CallBound{}, "Forward (layer 0): before dispatch", "hint");
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 3; ++r) EXPECT_TRUE(got[r].ok()) << "rank " << r << got[r];
}

// Expired() is the StopCheck heavy work polls (issue 13 item 6): false
// while in time; true once past the deadline (checked first) or cancelled;
// the first true answer is latched, so a cancel check that would answer
// false again (a flag reset; a clock read back) changes nothing.
TEST(CallBound, ExpiredLatchesTheFirstStop) {
  EXPECT_FALSE(CallBound{}.Expired());
  bool flag = false;
  int checks = 0;
  const CallBound call{absl::Now() + absl::Hours(1), [&] {
                         ++checks;
                         return flag;
                       }};
  EXPECT_FALSE(call.Expired());
  EXPECT_EQ(call.seen, CallBound::Stop::kNone);
  flag = true;
  EXPECT_TRUE(call.Expired());
  EXPECT_EQ(call.seen, CallBound::Stop::kCancelled);
  flag = false;
  EXPECT_TRUE(call.Expired());
  EXPECT_EQ(checks, 2) << "no check once latched";
  const CallBound late{absl::Now() - absl::Seconds(1), [] { return true; }};
  EXPECT_TRUE(late.Expired());
  EXPECT_EQ(late.seen, CallBound::Stop::kLate);
  // A fresh bound (what every call starts with) has nothing latched.
  EXPECT_EQ(CallBound{}.seen, CallBound::Stop::kNone);
}

// A client cancels its call itself when its deadline passes, and that
// cancel can arrive before the server's later copy of the deadline passes
// (seen under load: WorkerCallGate.BenchmarkStopLeavesTheGroupUsable named
// "the client cancelled" for a 752 ms deadline). A cancel within 250 ms of
// the deadline is the deadline; an earlier one is a cancel.
TEST(CallBound, ACancelJustBeforeTheDeadlineIsTheDeadline) {
  const CallBound near{absl::Now() + absl::Milliseconds(100), [] { return true; }};
  EXPECT_TRUE(near.Expired());
  EXPECT_EQ(near.seen, CallBound::Stop::kLate);
  const CallBound early{absl::Now() + absl::Seconds(30), [] { return true; }};
  EXPECT_TRUE(early.Expired());
  EXPECT_EQ(early.seen, CallBound::Stop::kCancelled);
  const CallBound endless{absl::InfiniteFuture(), [] { return true; }};
  EXPECT_TRUE(endless.Expired());
  EXPECT_EQ(endless.seen, CallBound::Stop::kCancelled);
}

// The borderline case: work on rank 0 stopped early (its Expired() fired),
// yet at the gate its own checks would now answer "go" (the cancel flag
// reads false again, as a clock read back would). The gate still votes the
// latched stop, so rank 0 is named and both ranks stop: a rank that skipped
// work never goes on with ranks that did it.
TEST(CallGate, ARankWhoseWorkStoppedEarlyIsInTheStopWhateverItsChecksSayNow) {
  auto group = FormGroup(2);
  for (const auto& g : group) ASSERT_NE(g, nullptr);
  std::atomic<bool> flag{true};
  const CallBound calls[2] = {CallBound{absl::InfiniteFuture(), [&] { return flag.load(); }},
                              CallBound{}};
  ASSERT_TRUE(calls[0].Expired());  // the work's poll
  flag = false;                     // its check would now say "go"
  absl::Status got[2];
  std::vector<std::thread> threads;
  threads.reserve(2);
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      got[r] = CallGate(*group[r], calls[r],
                        "Forward (layer 1): between expert compute and combine", "hint");
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kCancelled) << "rank " << r << got[r];
    EXPECT_EQ(got[r].message(),
              "Forward (layer 1): between expert compute and combine: stopped on every rank: the "
              "client cancelled the call on rank(s) [0]; nothing was committed and the group "
              "stays usable: hint");
    EXPECT_TRUE(IsAgreedStop(got[r]));
  }
  // A rank latched past its deadline votes late, as its clock says too.
  const CallBound late{absl::Now() - absl::Milliseconds(1), nullptr};
  ASSERT_TRUE(late.Expired());
  EXPECT_EQ(late.seen, CallBound::Stop::kLate);
  threads.clear();
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back(
        [&, r] { got[r] = CallGate(*group[r], r == 1 ? late : CallBound{}, "X", "h"); });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(got[r].code(), absl::StatusCode::kDeadlineExceeded) << "rank " << r << got[r];
    EXPECT_THAT(std::string(got[r].message()),
                HasSubstr("the call's deadline passed on rank(s) [1]"));
  }
}

TEST(BenchmarkGatePoint, NamesTheIterationAndTheTotal) {
  EXPECT_EQ(BenchmarkGatePoint(3, 7), "Benchmark: after 3 of 7 iterations (warmup included)");
}

}  // namespace
}  // namespace moe_ep::server
