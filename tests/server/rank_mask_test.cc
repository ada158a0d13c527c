// AgreeRankMask (server/rank_mask.h; issue 17): a round whose stop flag is
// set gives up with kCancelled naming the round and the rank, before it
// waits on any store; a round of survivors whose vote counts differ (they
// saw the loss one call apart) agrees on the largest count.

#include "server/rank_mask.h"

#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/rendezvous_server.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

TEST(AgreeRankMask, AStoppedRoundIsCancelled) {
  MaskRound round;
  // Nobody listens on these: a round that ran would wait for them.
  round.addresses = {"127.0.0.1:1", "127.0.0.1:2"};
  round.generation = 3;
  round.round = 2;
  round.rank = 1;
  round.live_before = {true, true};
  auto stop = std::make_shared<std::atomic<bool>>(true);
  round.stop = stop;
  const absl::StatusOr<MaskAgreement> agreed = AgreeRankMask(round);
  EXPECT_EQ(agreed.status().code(), absl::StatusCode::kCancelled) << agreed.status();
  EXPECT_THAT(std::string(agreed.status().message()),
              HasSubstr("rank mask round 2: stopped on rank 1"));
}

// Ranks 0, 1 and 3 of 4 survive (rank 2's store is gone); rank 1 saw the
// loss one call after the others (6 votes, theirs 5): every member gets the
// members, host rank 0 and the vote count 6, on a 3-member context.
TEST(AgreeRankMask, SurvivorsAgreeOnTheLargestVoteCount) {
  testing::RendezvousServer stores[4];  // each rank's store
  std::vector<std::string> addresses;
  for (const testing::RendezvousServer& s : stores) addresses.push_back(s.address());
  stores[2].server->Shutdown();
  const int64_t votes[4] = {5, 6, 0, 5};
  const int survivors[3] = {0, 1, 3};
  std::vector<absl::StatusOr<MaskAgreement>> agreed;
  agreed.reserve(4);
  for (int r = 0; r < 4; ++r) agreed.emplace_back(absl::UnknownError("not run"));
  std::vector<std::thread> threads;
  threads.reserve(3);
  for (int r : survivors) {
    threads.emplace_back([&, r] {
      MaskRound round;
      round.addresses = addresses;
      round.generation = 1;
      round.round = 1;
      round.rank = r;
      round.live_before = {true, true, true, true};
      round.timeout = absl::Seconds(10);
      round.votes = votes[r];
      agreed[r] = AgreeRankMask(round);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r : survivors) {
    ASSERT_TRUE(agreed[r].ok()) << "rank " << r << ": " << agreed[r].status();
    EXPECT_EQ(agreed[r]->votes, 6) << "rank " << r;
    EXPECT_EQ(agreed[r]->host, 0) << "rank " << r;
    EXPECT_EQ(agreed[r]->live, (std::vector<bool>{true, true, false, true})) << "rank " << r;
    ASSERT_NE(agreed[r]->group, nullptr) << "rank " << r;
    EXPECT_EQ(agreed[r]->group->size(), 3) << "rank " << r;
  }
}

}  // namespace
}  // namespace moe_ep::server
