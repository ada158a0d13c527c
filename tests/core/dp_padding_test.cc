#include "core/dp_padding.h"

#include <cstdint>
#include <limits>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// DESIGN §4 worked example: tp=4, attn_dp=2 (attn_tp=2), counts [5, 2].
TEST(ComputeDpGatherLayout, DesignWorkedExample) {
  const std::vector<int64_t> counts = {5, 2};
  for (int dp_rank : {0, 1}) {
    absl::StatusOr<DpGatherLayout> l = ComputeDpGatherLayout(counts, 2, false, dp_rank);
    ASSERT_TRUE(l.ok()) << l.status();
    EXPECT_EQ(l->mode, DpPaddingMode::kMaxLen);
    EXPECT_THAT(l->aligned_counts, ElementsAre(6, 2));
    EXPECT_THAT(l->padded_counts, ElementsAre(6, 6));
    EXPECT_THAT(l->offsets, ElementsAre(0, 6));
    EXPECT_EQ(l->global_rows, 12);
    EXPECT_EQ(l->local_rows, 6);
    EXPECT_EQ(DpScatteredRowsPerRank(*l), 3);
  }
}

// [6, 0] over 2 DP groups: 2*6 >= 6*2 holds with equality -> still MAX_LEN.
TEST(ComputeDpGatherLayout, EqualityBoundaryIsMaxLen) {
  absl::StatusOr<DpGatherLayout> l = ComputeDpGatherLayout({6, 0}, 2, false, 1);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->mode, DpPaddingMode::kMaxLen);
  EXPECT_THAT(l->padded_counts, ElementsAre(6, 6));
  EXPECT_EQ(l->global_rows, 12);
  EXPECT_EQ(l->local_rows, 6);
  EXPECT_EQ(DpScatteredRowsPerRank(*l), 3);
}

// [6, 0, 0] over 3 DP groups: 2*6 = 12 < 6*3 = 18 -> SUM_LEN.
TEST(ComputeDpGatherLayout, SumLen) {
  absl::StatusOr<DpGatherLayout> l = ComputeDpGatherLayout({6, 0, 0}, 2, false, 0);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->mode, DpPaddingMode::kSumLen);
  EXPECT_THAT(l->aligned_counts, ElementsAre(6, 0, 0));
  EXPECT_THAT(l->padded_counts, ElementsAre(6, 0, 0));
  EXPECT_THAT(l->offsets, ElementsAre(0, 6, 6));
  EXPECT_EQ(l->global_rows, 6);
  EXPECT_EQ(l->local_rows, 6);
  EXPECT_EQ(DpScatteredRowsPerRank(*l), 3);

  absl::StatusOr<DpGatherLayout> empty_group = ComputeDpGatherLayout({6, 0, 0}, 2, false, 2);
  ASSERT_TRUE(empty_group.ok());
  EXPECT_EQ(empty_group->local_rows, 0);
  EXPECT_EQ(DpScatteredRowsPerRank(*empty_group), 0);
}

// attn_tp 4, counts [7, 1, 0, 0] -> aligned [8, 4, 0, 0], sum 12, max 8:
// 24 < 32 -> SUM_LEN, offsets [0, 8, 12, 12].
TEST(ComputeDpGatherLayout, SumLenAlignsEachGroup) {
  absl::StatusOr<DpGatherLayout> l = ComputeDpGatherLayout({7, 1, 0, 0}, 4, false, 1);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->mode, DpPaddingMode::kSumLen);
  EXPECT_THAT(l->aligned_counts, ElementsAre(8, 4, 0, 0));
  EXPECT_THAT(l->offsets, ElementsAre(0, 8, 12, 12));
  EXPECT_EQ(l->global_rows, 12);
  EXPECT_EQ(l->local_rows, 4);
  EXPECT_EQ(DpScatteredRowsPerRank(*l), 1);
}

TEST(ComputeDpGatherLayout, CudaGraphCaptureForcesMaxLen) {
  absl::StatusOr<DpGatherLayout> l = ComputeDpGatherLayout({6, 0, 0}, 2, true, 2);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->mode, DpPaddingMode::kMaxLen);
  EXPECT_THAT(l->padded_counts, ElementsAre(6, 6, 6));
  EXPECT_THAT(l->offsets, ElementsAre(0, 6, 12));
  EXPECT_EQ(l->global_rows, 18);
  EXPECT_EQ(l->local_rows, 6);
}

TEST(ComputeDpGatherLayout, AttnTpOneNeedsNoAlignment) {
  // tp = attn_dp = 2: counts [3, 1], 8 >= 6 -> MAX_LEN, global 6.
  absl::StatusOr<DpGatherLayout> l = ComputeDpGatherLayout({3, 1}, 1, false, 1);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_THAT(l->aligned_counts, ElementsAre(3, 1));
  EXPECT_EQ(l->mode, DpPaddingMode::kMaxLen);
  EXPECT_EQ(l->global_rows, 6);
  EXPECT_EQ(l->local_rows, 3);
  EXPECT_EQ(DpScatteredRowsPerRank(*l), 3);
}

TEST(ComputeDpGatherLayout, AllGroupsEmpty) {
  absl::StatusOr<DpGatherLayout> l = ComputeDpGatherLayout({0, 0}, 2, false, 0);
  ASSERT_TRUE(l.ok()) << l.status();
  EXPECT_EQ(l->mode, DpPaddingMode::kMaxLen);
  EXPECT_EQ(l->global_rows, 0);
  EXPECT_EQ(l->local_rows, 0);
}

TEST(ComputeDpGatherLayout, RejectsBadInput) {
  auto expect = [](const absl::StatusOr<DpGatherLayout>& l, const char* fragment) {
    EXPECT_EQ(l.status().code(), absl::StatusCode::kInvalidArgument) << l.status();
    EXPECT_THAT(l.status().message(), HasSubstr(fragment));
  };
  expect(ComputeDpGatherLayout({}, 2, false, 0), "empty");
  expect(ComputeDpGatherLayout({4, -1}, 2, false, 0), "DP rank 1");
  expect(ComputeDpGatherLayout({4, 2}, 0, false, 0), "attn_tp_size");
  expect(ComputeDpGatherLayout({4, 2}, 2, false, 2), "dp_rank");
  expect(ComputeDpGatherLayout({4, 2}, 2, false, -1), "dp_rank");
  const int64_t big = std::numeric_limits<int64_t>::max();
  expect(ComputeDpGatherLayout({big, 0}, 2, false, 0), "overflow");
  expect(ComputeDpGatherLayout({big - 1, big - 1}, 1, false, 0), "overflow");
}

TEST(DpPaddingModeName, Names) {
  EXPECT_EQ(DpPaddingModeName(DpPaddingMode::kMaxLen), "MAX_LEN");
  EXPECT_EQ(DpPaddingModeName(DpPaddingMode::kSumLen), "SUM_LEN");
}

}  // namespace
}  // namespace moe_ep::core
