#include "core/routing.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

ExpertPlacement Placement(int num_experts, int ep_size) {
  auto p = ExpertPlacement::Contiguous(num_experts, ep_size);
  EXPECT_TRUE(p.ok()) << p.status();
  return *p;
}

TEST(ComputeDispatchRoute, DesignWorkedCase) {
  // DESIGN §7: E=4, 32 experts (8 per rank), ids [3, 9, 5, 30] -> ranks {0,1,3}.
  const std::vector<int32_t> ids = {3, 9, 5, 30};
  auto route = ComputeDispatchRoute(ids, 1, 4, Placement(32, 4));
  ASSERT_TRUE(route.ok()) << route.status();
  EXPECT_THAT(route->send_counts, ElementsAre(1, 1, 0, 1));
  EXPECT_THAT(route->token_offsets, ElementsAre(0, 3));
  EXPECT_THAT(route->dest_rank, ElementsAre(0, 1, 3));
  EXPECT_THAT(route->dest_slot, ElementsAre(0, 0, 0));
  EXPECT_THAT(route->tokens_for_rank[0], ElementsAre(0));
  EXPECT_TRUE(route->tokens_for_rank[2].empty());
}

TEST(ComputeDispatchRoute, InvalidIdsSelectNoRank) {
  // -1, num_experts and a large id must never be routed (never to rank 0).
  const std::vector<int32_t> ids = {-1, 32, 1 << 30, 17,   // token 0 -> rank 2 only
                                    -1, -1, 32,      32};  // token 1 -> nowhere
  auto route = ComputeDispatchRoute(ids, 2, 4, Placement(32, 4));
  ASSERT_TRUE(route.ok());
  EXPECT_THAT(route->send_counts, ElementsAre(0, 0, 1, 0));
  EXPECT_THAT(route->token_offsets, ElementsAre(0, 1, 1));
  EXPECT_THAT(route->dest_rank, ElementsAre(2));
  EXPECT_TRUE(route->tokens_for_rank[0].empty());
}

TEST(ComputeDispatchRoute, DuplicateRankGivesOneSend) {
  // Experts 0, 1, 7 all live on rank 0 of 4 (8 per rank): one send.
  const std::vector<int32_t> ids = {0, 7, 1, 7};
  auto route = ComputeDispatchRoute(ids, 1, 4, Placement(32, 4));
  ASSERT_TRUE(route.ok());
  EXPECT_THAT(route->send_counts, ElementsAre(1, 0, 0, 0));
  EXPECT_THAT(route->dest_rank, ElementsAre(0));
}

TEST(ComputeDispatchRoute, SlotsFillInSourceTokenOrder) {
  // 10 experts on 4 ranks: [0,3) r0, [3,6) r1, [6,8) r2, [8,10) r3. K=2.
  const std::vector<int32_t> ids = {
      9,  0,  // t0 -> r0 slot0, r3 slot0
      4,  5,  // t1 -> r1 slot0
      -1, 3,  // t2 -> r1 slot1
      2,  8,  // t3 -> r0 slot1, r3 slot1
      6,  7,  // t4 -> r2 slot0
  };
  auto route = ComputeDispatchRoute(ids, 5, 2, Placement(10, 4));
  ASSERT_TRUE(route.ok());
  EXPECT_THAT(route->send_counts, ElementsAre(2, 2, 1, 2));
  EXPECT_THAT(route->token_offsets, ElementsAre(0, 2, 3, 4, 6, 7));
  EXPECT_THAT(route->dest_rank, ElementsAre(0, 3, 1, 1, 0, 3, 2));
  EXPECT_THAT(route->dest_slot, ElementsAre(0, 0, 0, 1, 1, 1, 0));
  EXPECT_THAT(route->tokens_for_rank[0], ElementsAre(0, 3));
  EXPECT_THAT(route->tokens_for_rank[1], ElementsAre(1, 2));
  EXPECT_THAT(route->tokens_for_rank[2], ElementsAre(4));
  EXPECT_THAT(route->tokens_for_rank[3], ElementsAre(0, 3));
}

TEST(ComputeDispatchRoute, ZeroTokens) {
  auto route = ComputeDispatchRoute({}, 0, 8, Placement(256, 8));
  ASSERT_TRUE(route.ok());
  EXPECT_EQ(route->num_tokens, 0);
  EXPECT_THAT(route->token_offsets, ElementsAre(0));
  EXPECT_EQ(route->send_counts, std::vector<int64_t>(8, 0));
  EXPECT_EQ(route->tokens_for_rank.size(), 8u);
}

TEST(ComputeDispatchRoute, RejectsBadShapes) {
  const std::vector<int32_t> ids = {1, 2, 3};
  auto a = ComputeDispatchRoute(ids, 2, 2, Placement(8, 2));
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("topk_ids"));
  auto b = ComputeDispatchRoute(ids, 3, 0, Placement(8, 2));
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("top_k"));
  auto c = ComputeDispatchRoute(ids, -1, 3, Placement(8, 2));
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("num_tokens"));
}

// DESIGN §7: only the configured invalid id is padding.
TEST(ValidateExpertIds, OnlyTheConfiguredInvalidIdMasks) {
  // 32 experts, K = 2; under the -1 convention -1 is padding, 32 is not.
  EXPECT_TRUE(ValidateExpertIds({0, 31, -1, -1, 5, 17}, 2, 32, -1).ok());
  EXPECT_TRUE(ValidateExpertIds({}, 2, 32, -1).ok());
  absl::Status num = ValidateExpertIds({0, 31, 4, 32}, 2, 32, -1);
  EXPECT_EQ(num.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(num.message(),
              HasSubstr("topk_ids[row 1, choice 1] = 32: outside [0, 32) and not the invalid "
                        "expert id -1 (1 id out of range in 2 rows"));
  // Under the num_experts convention 32 is padding and -1 is a routing bug.
  EXPECT_TRUE(ValidateExpertIds({0, 32, 32, 32}, 2, 32, 32).ok());
  absl::Status minus = ValidateExpertIds({32, 3, 7, -1, -1, 40}, 2, 32, 32);
  EXPECT_EQ(minus.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(minus.message(), HasSubstr("topk_ids[row 1, choice 1] = -1"));
  EXPECT_THAT(minus.message(), HasSubstr("(3 ids out of range in 3 rows"));
  // Ids below -1 and far above the range, the first one named.
  absl::Status far = ValidateExpertIds({1 << 30, -7}, 1, 8, -1);
  EXPECT_THAT(far.message(), HasSubstr("topk_ids[row 0, choice 0] = 1073741824"));
  EXPECT_EQ(ValidateExpertIds({0}, 0, 8, -1).code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::core
