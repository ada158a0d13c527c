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

TEST(BenchmarkGatePoint, NamesTheIterationAndTheTotal) {
  EXPECT_EQ(BenchmarkGatePoint(3, 7), "Benchmark: after 3 of 7 iterations (warmup included)");
}

}  // namespace
}  // namespace moe_ep::server
