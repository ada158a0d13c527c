// AgreeRankMask's stop flag (server/rank_mask.h; issue 17): a round whose
// flag is set gives up with kCancelled naming the round and the rank, before
// it waits on any store.

#include "server/rank_mask.h"

#include <atomic>
#include <memory>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

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

}  // namespace
}  // namespace moe_ep::server
