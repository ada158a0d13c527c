// A rank mask round on a thread of its own (server/mask_round_task.h; DESIGN
// §15, issue 17): Wait hands over a finished round's agreement, Stop ends a
// round that waits for a peer at once instead of after its 30 s timeout, and
// a Leave while a worker's round runs returns promptly and leaves the worker
// usable (a new generation joins and configures its layers).

#include "server/mask_round_task.h"

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/in_process_worker.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;
using testing::InProcessWorker;
using testing::OnAllRanks;
using testing::OneLayerOverTwoRanks;

// Round `k` of generation 1 for rank 0 of two, on the workers' Rendezvous
// services; rank 0 hosts it.
MaskRound RoundOf(int k, const std::vector<std::string>& addresses, std::vector<bool> live_before) {
  MaskRound round;
  round.addresses = addresses;
  round.generation = 1;
  round.round = k;
  round.rank = 0;
  round.live_before = std::move(live_before);
  round.timeout = absl::Seconds(30);
  return round;
}

TEST(MaskRoundTask, WaitHandsOverTheAgreement) {
  InProcessWorker rank0;
  InProcessWorker rank1;
  MaskRoundTask task;
  EXPECT_FALSE(task.running());
  EXPECT_FALSE(task.Wait(absl::ZeroDuration()).has_value());
  // Rank 1 was masked before the round: rank 0 hosts it alone.
  task.Start(RoundOf(1, {rank0.address(), rank1.address()}, {true, false}));
  EXPECT_TRUE(task.running());
  std::optional<absl::StatusOr<MaskAgreement>> agreed = task.Wait(absl::Seconds(60));
  ASSERT_TRUE(agreed.has_value());
  ASSERT_TRUE(agreed->ok()) << agreed->status();
  EXPECT_THAT((*agreed)->live, ElementsAre(true, false));
  EXPECT_EQ((*agreed)->host, 0);
  ASSERT_NE((*agreed)->group, nullptr);
  EXPECT_EQ((*agreed)->group->size(), 1);
  EXPECT_FALSE(task.running());
}

TEST(MaskRoundTask, StopEndsARoundThatWaitsForAPeer) {
  InProcessWorker rank0;
  InProcessWorker rank1;  // answers probes but never enters the round
  MaskRoundTask task;
  task.Start(RoundOf(1, {rank0.address(), rank1.address()}, {true, true}));
  // The host waits up to the 30 s timeout for rank 1's alive key.
  EXPECT_FALSE(task.Wait(absl::Milliseconds(200)).has_value());
  EXPECT_TRUE(task.running());
  auto stopped = std::async(std::launch::async, [&] { task.Stop(); });
  ASSERT_EQ(stopped.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "Stop waited for the round's timeout";
  EXPECT_FALSE(task.running());
  // The task runs the next round afterwards (round 1's keys stay on the store).
  task.Start(RoundOf(2, {rank0.address(), rank1.address()}, {true, false}));
  std::optional<absl::StatusOr<MaskAgreement>> agreed = task.Wait(absl::Seconds(60));
  ASSERT_TRUE(agreed.has_value() && agreed->ok());
  EXPECT_THAT((*agreed)->live, ElementsAre(true, false));
}

// Rank 0 of two Gloo workers starts a round (rank 1 left the group, so
// rank 0's call finds it lost) that waits for rank 1, which answers probes
// but never enters the round; a Leave then tears the group down without
// waiting for the round, and both workers join a new generation and
// configure it. (A call that rank 1 simply never made, with rank 1 still a
// member, starts no round since issue 29: StrayCall in the integration
// tests.)
TEST(MaskRoundTask, LeaveDuringARoundReturnsAndTheWorkerRejoins) {
  InProcessWorker rank0;
  InProcessWorker rank1;
  InProcessWorker* workers[2] = {&rank0, &rank1};
  const std::vector<std::string> addresses = {rank0.address(), rank1.address()};
  const auto join = [&](int r, int64_t generation) {
    v1::JoinRequest request;
    request.set_world_size(2);
    request.set_rank(r);
    request.set_backend("gloo");
    request.set_rendezvous_address(addresses[0]);
    request.set_generation(generation);
    request.set_timeout_ms(30000);
    for (const std::string& a : addresses) request.add_rendezvous_addresses(a);
    v1::JoinResponse response;
    return workers[r]->Call(&v1::Worker::Stub::Join, request, &response);
  };
  grpc::Status status[2];
  OnAllRanks(2, [&](int r) { status[r] = join(r, 1); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();

  // Rank 1 leaves; rank 0's next call finds it alive but out of generation
  // 1 (a lost rank), and the round it starts then waits for rank 1 (up to
  // the 30 s timeout).
  ASSERT_TRUE(rank1.Leave(1).ok());
  v1::ConfigureLayersResponse configured;
  const grpc::Status alone =
      rank0.CallWithin(std::chrono::milliseconds(1500), &v1::Worker::Stub::ConfigureLayers,
                       OneLayerOverTwoRanks(4), &configured);
  // The caller's own deadline ends the call (or the worker's UNAVAILABLE
  // naming the lost rank comes first); the round it started runs on, and
  // the Leave must not await it.
  EXPECT_TRUE(alone.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED ||
              alone.error_code() == grpc::StatusCode::UNAVAILABLE)
      << alone.error_message();

  // The Leave waits for that call's slot, then for nothing else.
  auto left = std::async(std::launch::async, [&] { return rank0.Leave(1); });
  ASSERT_EQ(left.wait_for(std::chrono::seconds(20)), std::future_status::ready)
      << "Leave waited for the mask round's timeout";
  const grpc::Status leave = left.get();
  ASSERT_TRUE(leave.ok()) << leave.error_message();
  const v1::GetStatusResponse after = rank0.Status();
  EXPECT_EQ(after.state(), v1::WORKER_STATE_STARTED);
  EXPECT_EQ(after.mask_round(), 0);
  EXPECT_FALSE(after.group_broken());

  ASSERT_TRUE(rank1.Leave(1).ok());
  OnAllRanks(2, [&](int r) { status[r] = join(r, 2); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Configure(OneLayerOverTwoRanks(4)); });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(status[r].ok()) << "rank " << r << ": " << status[r].error_message();
    EXPECT_EQ(workers[r]->Status().state(), v1::WORKER_STATE_CONFIGURED) << "rank " << r;
  }
}

}  // namespace
}  // namespace moe_ep::server
