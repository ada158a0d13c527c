#include "core/engine_call_round.h"

#include <memory>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::HasSubstr;

// Three thread-ranks open rounds of a Gloo group: a dispatch that ranks 0
// and 2 refuse (INVALID_ARGUMENT, FAILED_PRECONDITION) gives each rank its
// own error and rank 1 ABORTED naming both refusers with their codes; every
// rank counted the call, so the next round (a sync with gathered values)
// pairs cleanly.
TEST(EngineCallRound, NamesEveryRefusingRankAndCountsTheCall) {
  constexpr int kRanks = 3;
  auto store = NewHashStore();
  absl::Status refused[kRanks];
  absl::Status synced[kRanks];
  std::vector<int64_t> values[kRanks];
  int64_t sequence[kRanks] = {};
  RunOnRanks(kRanks, [&](int r) {
    auto group = JoinLoopback(store, r, kRanks);
    ASSERT_TRUE(group.ok()) << group.status();
    EngineCallRound round;
    EngineCallTicket dispatch;
    dispatch.call = EngineCall::kDispatch;
    dispatch.epoch = 4;
    dispatch.runtime_max_tokens_per_rank = 8;
    const absl::Status local = r == 0   ? absl::InvalidArgumentError("bad ids")
                               : r == 2 ? absl::FailedPreconditionError("no dispatch")
                                        : absl::OkStatus();
    refused[r] = round.Open(**group, dispatch, local, nullptr);
    EngineCallTicket sync;
    sync.call = EngineCall::kSyncTokenCounts;
    sync.value = 10 + r;
    synced[r] = round.Open(**group, sync, absl::OkStatus(), &values[r]);
    sequence[r] = round.sequence();
  });
  EXPECT_EQ(refused[0].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused[2].code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(refused[1].code(), absl::StatusCode::kAborted) << refused[1];
  EXPECT_THAT(std::string(refused[1].message()),
              HasSubstr("rank 0 refused its moe_ep_dispatch (INVALID_ARGUMENT), rank 2 refused "
                        "its moe_ep_dispatch (FAILED_PRECONDITION); each one's own error names "
                        "why; nothing moved, the group is still usable (this rank is rank 1)"));
  for (int r = 0; r < kRanks; ++r) {
    EXPECT_TRUE(synced[r].ok()) << "rank " << r << ": " << synced[r];
    EXPECT_EQ(values[r], (std::vector<int64_t>{10, 11, 12})) << "rank " << r;
    EXPECT_EQ(sequence[r], 2) << "rank " << r;
  }
}

}  // namespace
}  // namespace moe_ep::core
