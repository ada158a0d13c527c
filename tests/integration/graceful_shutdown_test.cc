// Integration tests of the worker's graceful shutdown (issue 5, "Graceful
// shutdown"): SIGTERM -> NOT_SERVING -> in-flight calls finish or are
// cancelled -> the communicator is dropped -> exit 0 within the drain timeout,
// and the peers report the lost rank instead of hanging. Real moe-ep-worker
// processes on loopback, driven by the fake coordinator.

#include <sys/wait.h>

#include <csignal>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/grpc_status.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {
namespace {

// Polls (10 ms) until worker `index` has exited or `limit` passes; returns
// how long that took (>= limit when it still runs).
absl::Duration WaitForExit(FakeCoordinator& fake, int index, absl::Duration limit) {
  const absl::Time start = absl::Now();
  while (fake.cluster().IsRunning(index) && absl::Now() - start < limit) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  return absl::Now() - start;
}

void ExpectExitedZero(FakeCoordinator& fake, int index) {
  absl::StatusOr<int> status = fake.cluster().WaitStatus(index);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_TRUE(WIFEXITED(*status)) << "worker " << index << " wait status " << *status;
  EXPECT_EQ(WEXITSTATUS(*status), 0) << "worker " << index;
}

absl::Status SyncOn(FakeCoordinator& fake, int rank, int64_t epoch, int64_t tokens) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  v1::SyncTokenCountsRequest request;
  request.set_epoch(epoch);
  request.set_local_tokens(tokens);
  v1::SyncTokenCountsResponse response;
  return client::ToAbslStatus(fake.stub(rank).SyncTokenCounts(&context, request, &response));
}

// A worker that has formed a group, allocated and loaded experts, but runs no
// call, exits at once: nothing waits for the drain timeout (5 s here).
TEST(GracefulShutdown, IdleJoinedWorkerExitsPromptlyWithStatusZero) {
  auto fake = FakeCoordinator::Start(2, {"--drain-timeout-ms=5000"});
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->SetUp(SmallModel(), 16, v1::EXPERT_KIND_IDENTITY).ok());
  ASSERT_TRUE((*fake)->cluster().Kill(1, SIGTERM).ok());
  const absl::Duration took = WaitForExit(**fake, 1, absl::Seconds(10));
  EXPECT_LT(took, absl::Seconds(1)) << "idle worker took " << took << " to exit";
  ExpectExitedZero(**fake, 1);
  // Rank 0 (rank 0 serves the group's rendezvous) stops as promptly.
  ASSERT_TRUE((*fake)->cluster().Kill(0, SIGTERM).ok());
  EXPECT_LT(WaitForExit(**fake, 0, absl::Seconds(10)), absl::Seconds(1));
  ExpectExitedZero(**fake, 0);
}

// A worker whose health is watched (a coordinator keeps a Watch open on every
// worker) but that runs no call exits as promptly: the open Watch does not
// hold the drain (5 s here); it reads NOT_SERVING and then ends (issue 31
// item 3).
TEST(GracefulShutdown, IdleWorkerWithAnOpenHealthWatchExitsWithinOneSecond) {
  auto fake = FakeCoordinator::Start(2, {"--drain-timeout-ms=5000"});
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->SetUp(SmallModel(), 16, v1::EXPERT_KIND_IDENTITY).ok());
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      ConnectedChannel((*fake)->cluster().targets()[1]);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto health = grpc::health::v1::Health::NewStub(*channel);
  grpc::ClientContext context;
  grpc::health::v1::HealthCheckRequest request;
  request.set_service("moe_ep.v1.Worker");
  auto reader = health->Watch(&context, request);
  grpc::health::v1::HealthCheckResponse response;
  ASSERT_TRUE(reader->Read(&response));
  EXPECT_EQ(response.status(), grpc::health::v1::HealthCheckResponse::SERVING);

  ASSERT_TRUE((*fake)->cluster().Kill(1, SIGTERM).ok());
  const absl::Time start = absl::Now();
  std::vector<grpc::health::v1::HealthCheckResponse::ServingStatus> seen;
  while (reader->Read(&response)) seen.push_back(response.status());
  const grpc::Status ended = reader->Finish();
  const absl::Duration stream_took = absl::Now() - start;
  const absl::Duration took = WaitForExit(**fake, 1, absl::Seconds(10));
  EXPECT_LT(stream_took, absl::Seconds(1)) << "the Watch stayed open " << stream_took;
  EXPECT_LT(took, absl::Seconds(1)) << "watched idle worker took " << took << " to exit";
  ASSERT_FALSE(seen.empty());
  EXPECT_EQ(seen.back(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  EXPECT_FALSE(ended.ok());  // ended by the server's shutdown, not by the client
  ExpectExitedZero(**fake, 1);
}

// Ranks 0 and 1 enter a SyncTokenCounts that rank 2 never joins; rank 2 gets
// SIGTERM. It exits 0 within its drain timeout; its peers fail well before
// the 30 s call deadline with UNAVAILABLE or DEADLINE_EXCEEDED (a group
// error), and re-form a group of two without it.
TEST(GracefulShutdown, SigtermDuringPeersCollectiveFailsThemAndTheyRegroup) {
  auto fake = FakeCoordinator::Start(3, {"--drain-timeout-ms=3000"});
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;
  ASSERT_TRUE((*fake)->SetUp(model, 64, v1::EXPERT_KIND_IDENTITY).ok());

  absl::Duration victim_exit;
  const absl::Time start = absl::Now();
  std::vector<absl::Status> results = (*fake)->OnEachRank([&](int rank) -> absl::Status {
    if (rank != 2) return SyncOn(**fake, rank, 1, 3);
    // Whether the peers are already waiting in the collective or not, the
    // outcome is the same: they cannot complete it without rank 2.
    absl::SleepFor(absl::Milliseconds(300));
    RETURN_IF_ERROR((*fake)->cluster().Kill(2, SIGTERM));
    victim_exit = WaitForExit(**fake, 2, absl::Seconds(10));
    return absl::OkStatus();
  });
  const absl::Duration peers_done = absl::Now() - start;
  EXPECT_TRUE(results[2].ok()) << results[2];
  EXPECT_LT(victim_exit, absl::Seconds(3)) << "victim took " << victim_exit;
  ExpectExitedZero(**fake, 2);
  // Bounded by the group timeout (5 s) plus slack, never the call's 30 s.
  EXPECT_LT(peers_done, absl::Seconds(8));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[r].code() == absl::StatusCode::kUnavailable ||
                results[r].code() == absl::StatusCode::kDeadlineExceeded)
        << "rank " << r << ": " << results[r];
    EXPECT_FALSE(results[r].message().empty());
  }
  // The peers' group is broken: health NOT_SERVING, later collectives say so.
  absl::Status again = SyncOn(**fake, 0, 2, 1);
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition) << again;
  EXPECT_THAT(std::string(again.message()), ::testing::HasSubstr("re-join"));

  // The survivors form a new group of 2 and run a step.
  client::CoordinatorOptions options;
  options.group_timeout = absl::Seconds(5);
  options.rpc_timeout = absl::Seconds(30);
  auto coordinator = client::Coordinator::Connect(
      {(*fake)->cluster().targets()[0], (*fake)->cluster().targets()[1]}, options);
  ASSERT_TRUE(coordinator.ok()) << coordinator.status();
  ASSERT_TRUE((*coordinator)->FormGroup().ok());
  ASSERT_TRUE((*coordinator)->ConfigureLayers(MakeConfigureRequest(2, model)).ok());
  ASSERT_TRUE((*coordinator)->AllocateWorkspace(MakeAllocateRequest(model, 64)).ok());
  auto sync = (*coordinator)->SyncTokenCounts(1, {2, 5});
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_EQ(sync->runtime_max_tokens_per_rank, 5);
  EXPECT_EQ((*fake)->StatusOf(0).world_size(), 2);
}

// A worker stuck in a collective its peers never join (they are idle) is
// cancelled at its drain deadline and still exits 0 in time, rather than
// waiting for the group timeout (20 s here).
TEST(GracefulShutdown, WorkerInAStuckCollectiveExitsAtItsDrainDeadline) {
  auto fake = FakeCoordinator::Start(2, {"--drain-timeout-ms=1000"});
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->coordinator().FormGroup().ok());
  // Re-join with a long group timeout so that only the drain deadline can end
  // the stuck call.
  std::vector<absl::Status> joined = (*fake)->OnEachRank([&](int rank) -> absl::Status {
    grpc::ClientContext context;
    v1::JoinRequest request;
    request.set_world_size(2);
    request.set_rank(rank);
    request.set_generation(100);
    request.set_timeout_ms(20000);
    request.set_backend("gloo");
    request.set_rendezvous_address((*fake)->cluster().targets()[0]);
    v1::JoinResponse response;
    return client::ToAbslStatus((*fake)->stub(rank).Join(&context, request, &response));
  });
  ASSERT_TRUE(joined[0].ok() && joined[1].ok()) << joined[0] << " / " << joined[1];
  ASSERT_TRUE((*fake)->coordinator().ConfigureLayers(MakeConfigureRequest(2, SmallModel())).ok());
  ASSERT_TRUE((*fake)->coordinator().AllocateWorkspace(MakeAllocateRequest(SmallModel(), 8)).ok());

  absl::Status stuck;
  std::thread caller([&] { stuck = SyncOn(**fake, 0, 1, 3); });
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE((*fake)->cluster().Kill(0, SIGTERM).ok());
  const absl::Duration took = WaitForExit(**fake, 0, absl::Seconds(15));
  caller.join();
  EXPECT_LT(took, absl::Seconds(3)) << "drain 1 s, took " << took;
  ExpectExitedZero(**fake, 0);
  EXPECT_FALSE(stuck.ok());
}

}  // namespace
}  // namespace moe_ep::testing
