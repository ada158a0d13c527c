#include "core/placement_load.h"

#include <cmath>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(RankLoads, SplitsAnExpertEvenlyOverItsReplicas) {
  // Header example: expert 0 on both ranks.
  auto t = PlacementTable::FromSlotExperts(3, {{0, 1}, {0, 2}});
  ASSERT_TRUE(t.ok());
  const std::vector<double> tokens = {6, 2, 4};
  auto loads = RankLoads(*t, tokens);
  ASSERT_TRUE(loads.ok()) << loads.status();
  EXPECT_THAT(*loads, ElementsAre(5.0, 7.0));
  auto ratio = MaxOverMean(*loads);
  ASSERT_TRUE(ratio.ok());
  EXPECT_DOUBLE_EQ(*ratio, 7.0 / 6.0);
}

TEST(RankLoads, ContiguousSumsBlocks) {
  auto t = PlacementTable::Contiguous(10, 4);  // 3, 3, 2, 2 experts
  ASSERT_TRUE(t.ok());
  std::vector<double> tokens(10);
  for (int e = 0; e < 10; ++e) tokens[e] = e;
  auto loads = RankLoads(*t, tokens);
  ASSERT_TRUE(loads.ok());
  EXPECT_THAT(*loads, ElementsAre(0 + 1 + 2, 3 + 4 + 5, 6 + 7, 8 + 9));
}

TEST(RankLoads, RejectsBadCounts) {
  auto t = PlacementTable::Contiguous(4, 2);
  ASSERT_TRUE(t.ok());
  auto short_counts = RankLoads(*t, std::vector<double>{1, 2, 3});
  EXPECT_EQ(short_counts.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(short_counts.status().message(), HasSubstr("expected 4 entries"));
  auto negative = RankLoads(*t, std::vector<double>{1, -2, 3, 4});
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(negative.status().message(), HasSubstr("tokens_per_expert[1]"));
  auto nan = RankLoads(*t, std::vector<double>{1, 2, std::nan(""), 4});
  EXPECT_THAT(nan.status().message(), HasSubstr("tokens_per_expert[2]"));
}

TEST(MaxOverMean, RatioAndErrors) {
  auto r = MaxOverMean(std::vector<double>{3, 1});
  ASSERT_TRUE(r.ok());
  EXPECT_DOUBLE_EQ(*r, 1.5);
  auto one_hot = MaxOverMean(std::vector<double>{0, 8, 0, 0});
  ASSERT_TRUE(one_hot.ok());
  EXPECT_DOUBLE_EQ(*one_hot, 4.0);
  EXPECT_EQ(MaxOverMean(std::vector<double>{}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(MaxOverMean(std::vector<double>{0, 0}).status().message(),
              HasSubstr("all 2 ranks have load 0"));
  EXPECT_THAT(MaxOverMean(std::vector<double>{1, std::numeric_limits<double>::infinity()})
                  .status()
                  .message(),
              HasSubstr("loads[1]"));
}

}  // namespace
}  // namespace moe_ep::core
