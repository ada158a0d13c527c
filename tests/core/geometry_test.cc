#include "core/geometry.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

using V = std::vector<int64_t>;

TEST(ChooseRuntimeMaxTokens, MaxWithoutBuckets) {
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{3, 7, 0, 5}, V{}, 4096), 7);
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{4096}, V{}, 4096), 4096);  // R == N is allowed
}

TEST(ChooseRuntimeMaxTokens, AllRanksEmptyGivesZero) {
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{0, 0, 0}, V{}, 16), 0);
}

TEST(ChooseRuntimeMaxTokens, RoundsUpToSmallestBucket) {
  const V buckets = {1, 2, 4, 8, 16};
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{3, 7, 0, 5}, buckets, 4096), 8);
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{8, 1}, buckets, 4096), 8);  // exact bucket
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{9}, buckets, 4096), 16);
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{0, 0}, buckets, 4096), 1);  // smallest bucket >= 0
  EXPECT_EQ(*ChooseRuntimeMaxTokens(V{0}, V{24, 48}, 4096), 24);
}

TEST(ChooseRuntimeMaxTokens, NoBucketLargeEnoughIsResourceExhausted) {
  absl::StatusOr<int64_t> r = ChooseRuntimeMaxTokens(V{3, 17}, V{4, 8, 16}, 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("17"));
  EXPECT_THAT(r.status().message(), HasSubstr("16"));
}

TEST(ChooseRuntimeMaxTokens, AboveCapacityIsResourceExhausted) {
  absl::StatusOr<int64_t> r = ChooseRuntimeMaxTokens(V{100, 4097}, V{}, 4096);
  EXPECT_EQ(r.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(r.status().message(), HasSubstr("4097"));
  EXPECT_THAT(r.status().message(), HasSubstr("4096"));
  // The bucket, not the max, exceeds capacity.
  absl::StatusOr<int64_t> b = ChooseRuntimeMaxTokens(V{100}, V{64, 128}, 120);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(b.status().message(), HasSubstr("128"));
  EXPECT_THAT(b.status().message(), HasSubstr("120"));
}

TEST(ChooseRuntimeMaxTokens, InvalidInput) {
  auto expect = [](const absl::StatusOr<int64_t>& r, const char* fragment) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(fragment)) << r.status();
  };
  expect(ChooseRuntimeMaxTokens(V{}, V{}, 16), "empty");
  expect(ChooseRuntimeMaxTokens(V{1, -2}, V{}, 16), "rank 1");
  expect(ChooseRuntimeMaxTokens(V{1}, V{}, 0), "capacity_tokens");
  expect(ChooseRuntimeMaxTokens(V{1}, V{8, 4}, 16), "ascending");
  expect(ChooseRuntimeMaxTokens(V{1}, V{4, 4}, 16), "entry 1");
  expect(ChooseRuntimeMaxTokens(V{1}, V{0, 4}, 16), "entry 0");
}

TEST(CheckRuntimeMaxTokens, Bounds) {
  EXPECT_TRUE(CheckRuntimeMaxTokens(5, 8, 16).ok());
  EXPECT_TRUE(CheckRuntimeMaxTokens(0, 0, 16).ok());    // all ranks empty
  EXPECT_TRUE(CheckRuntimeMaxTokens(16, 16, 16).ok());  // local == R == N

  absl::Status over = CheckRuntimeMaxTokens(5, 17, 16);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("17"));
  EXPECT_THAT(over.message(), HasSubstr("16"));

  absl::Status under = CheckRuntimeMaxTokens(9, 8, 16);
  EXPECT_EQ(under.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(under.message(), HasSubstr("8"));
  EXPECT_THAT(under.message(), HasSubstr("9"));

  EXPECT_EQ(CheckRuntimeMaxTokens(-1, 8, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRuntimeMaxTokens(0, -1, 16).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(CheckRuntimeMaxTokens(0, 0, 0).code(), absl::StatusCode::kInvalidArgument);
}

TEST(ScatteredTokens, TensorSplitShares) {
  // 5 tokens over 2 ranks -> 3, 2.
  EXPECT_EQ(ScatteredTokens(5, 2, 0), 3);
  EXPECT_EQ(ScatteredTokens(5, 2, 1), 2);
  // 6 over 4 -> 2, 2, 1, 1.
  EXPECT_EQ(ScatteredTokens(6, 4, 0), 2);
  EXPECT_EQ(ScatteredTokens(6, 4, 1), 2);
  EXPECT_EQ(ScatteredTokens(6, 4, 2), 1);
  EXPECT_EQ(ScatteredTokens(6, 4, 3), 1);
  // 2 over 4 -> 1, 1, 0, 0 (a rank may hold zero tokens).
  EXPECT_EQ(ScatteredTokens(2, 4, 1), 1);
  EXPECT_EQ(ScatteredTokens(2, 4, 2), 0);
  // DESIGN §4 worked example: local 6 rows, attn_tp 2 -> 3 each.
  EXPECT_EQ(ScatteredTokens(6, 2, 0), 3);
  EXPECT_EQ(ScatteredTokens(6, 2, 1), 3);
  EXPECT_EQ(ScatteredTokens(7, 1, 0), 7);
  EXPECT_EQ(ScatteredTokens(0, 4, 0), 0);
  // Out-of-contract input.
  EXPECT_EQ(ScatteredTokens(5, 2, 2), 0);
  EXPECT_EQ(ScatteredTokens(5, 0, 0), 0);
  EXPECT_EQ(ScatteredTokens(-5, 2, 0), 0);
}

TEST(MaxScatteredTokens, Ceiling) {
  EXPECT_EQ(MaxScatteredTokens(5, 2), 3);
  EXPECT_EQ(MaxScatteredTokens(6, 4), 2);
  EXPECT_EQ(MaxScatteredTokens(8, 4), 2);
  EXPECT_EQ(MaxScatteredTokens(0, 4), 0);
  EXPECT_EQ(MaxScatteredTokens(5, 0), 0);
}

// R for a DP-attention step: each rank feeds its split into dispatch. tp 4,
// attn_dp 2, DP groups with 5 and 2 tokens: ranks feed 3, 2, 1, 1 -> R 3.
TEST(ChooseRuntimeMaxTokens, DpAttentionSplits) {
  V per_rank;
  for (int64_t group_tokens : {5, 2}) {
    for (int r = 0; r < 2; ++r) per_rank.push_back(ScatteredTokens(group_tokens, 2, r));
  }
  EXPECT_EQ(per_rank, (V{3, 2, 1, 1}));
  EXPECT_EQ(*ChooseRuntimeMaxTokens(per_rank, V{}, 4096), 3);
}

}  // namespace
}  // namespace moe_ep::core
