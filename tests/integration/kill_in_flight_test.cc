// A call in flight when a worker is killed (issue 12 item 6): 4 real Gloo
// workers on loopback run a long Benchmark (a dispatch and a combine per
// iteration, every rank exchanging with every other); rank 0 (which hosts
// the Rendezvous store) or rank 2 is killed with SIGKILL while it runs. The
// call must fail on every survivor within 1 s of the kill (the group timeout
// is 5 s, the call's deadline 60 s), and GetStatus then shows the group
// broken. The figures are printed (bench/results/coordinator/README.md).

#include <chrono>
#include <csignal>
#include <iostream>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "client/grpc_status.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {
namespace {

constexpr int kKillWorld = 4;

class KillInFlight : public ::testing::TestWithParam<int> {};

TEST_P(KillInFlight, TheCallFailsOnEverySurvivorWithinOneSecond) {
  const int victim = GetParam();
  auto fake = FakeCoordinator::Start(kKillWorld);
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;
  ASSERT_TRUE((*fake)->SetUp(model, 256, v1::EXPERT_KIND_IDENTITY).ok());

  v1::BenchmarkRequest request;
  request.set_tokens_per_rank(256);
  request.set_hidden_size(model.hidden);
  request.set_num_experts(model.num_experts);
  request.set_top_k(model.top_k);
  request.set_iterations(10000);  // the --max-iterations default: seconds, in flight at the kill
  std::vector<absl::Status> status(kKillWorld);
  std::vector<absl::Time> ended(kKillWorld);
  absl::Mutex mu;
  int started = 0;
  std::vector<std::thread> calls;
  calls.reserve(kKillWorld);
  for (int r = 0; r < kKillWorld; ++r) {
    calls.emplace_back([&, r] {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      v1::BenchmarkResponse response;
      {
        absl::MutexLock lock(&mu);
        ++started;
      }
      status[r] = client::ToAbslStatus((*fake)->stub(r).Benchmark(&context, request, &response));
      ended[r] = absl::Now();
    });
  }
  // Every call sent, then give them time to be inside the benchmark loop.
  {
    absl::MutexLock lock(&mu);
    mu.Await(absl::Condition(
        +[](int* n) { return *n == kKillWorld; }, &started));
  }
  absl::SleepFor(absl::Milliseconds(800));
  const absl::Time killed = absl::Now();
  ASSERT_TRUE((*fake)->cluster().Kill(victim, SIGKILL).ok());
  for (auto& t : calls) t.join();

  double worst_ms = 0;
  for (int r = 0; r < kKillWorld; ++r) {
    if (r == victim) continue;
    const double ms = absl::ToDoubleMilliseconds(ended[r] - killed);
    worst_ms = std::max(worst_ms, ms);
    std::cout << "kill -9 rank " << victim << ": rank " << r << " failed after " << ms
              << " ms: " << status[r] << "\n";
    EXPECT_FALSE(status[r].ok()) << "rank " << r << " finished the benchmark: not in flight";
    EXPECT_LT(ended[r] - killed, absl::Seconds(1)) << "rank " << r << ": " << status[r];
    const v1::GetStatusResponse s = (*fake)->StatusOf(r);
    EXPECT_TRUE(s.group_broken()) << "rank " << r;
    EXPECT_THAT(s.broken_reason(), ::testing::HasSubstr("Benchmark: "));
  }
  std::cout << "kill -9 rank " << victim << " of " << kKillWorld
            << " during Benchmark: slowest survivor failed " << worst_ms << " ms after the kill\n";
}

INSTANTIATE_TEST_SUITE_P(RankZeroAndRankTwo, KillInFlight, ::testing::Values(0, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return absl::StrCat("Rank", info.param);
                         });

}  // namespace
}  // namespace moe_ep::testing
