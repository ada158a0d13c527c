#include "core/expert_placement.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

TEST(ExpertPlacement, TenExpertsOnFourRanks) {
  // DESIGN §7: base 2, rem 2 -> ranks own [0,3), [3,6), [6,8), [8,10).
  auto p = ExpertPlacement::Contiguous(10, 4);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->num_experts(), 10);
  EXPECT_EQ(p->ep_size(), 4);
  const std::vector<int> first = {0, 3, 6, 8};
  const std::vector<int> count = {3, 3, 2, 2};
  for (int r = 0; r < 4; ++r) {
    EXPECT_EQ(p->FirstExpert(r), first[r]) << "rank " << r;
    EXPECT_EQ(p->NumLocalExperts(r), count[r]) << "rank " << r;
  }
  const std::vector<int> owner = {0, 0, 0, 1, 1, 1, 2, 2, 3, 3};
  for (int e = 0; e < 10; ++e) EXPECT_EQ(p->RankOf(e), owner[e]) << "expert " << e;
}

TEST(ExpertPlacement, EvenSplit256On8) {
  auto p = ExpertPlacement::Contiguous(256, 8);
  ASSERT_TRUE(p.ok());
  for (int r = 0; r < 8; ++r) {
    EXPECT_EQ(p->FirstExpert(r), 32 * r);
    EXPECT_EQ(p->NumLocalExperts(r), 32);
  }
  EXPECT_EQ(p->RankOf(0), 0);
  EXPECT_EQ(p->RankOf(31), 0);
  EXPECT_EQ(p->RankOf(32), 1);
  EXPECT_EQ(p->RankOf(255), 7);
}

TEST(ExpertPlacement, UnevenSplitIsConsistent) {
  // 60 experts (Qwen1.5-MoE) on 7 ranks: base 8, rem 4.
  auto p = ExpertPlacement::Contiguous(60, 7);
  ASSERT_TRUE(p.ok());
  int next = 0;
  for (int r = 0; r < 7; ++r) {
    EXPECT_EQ(p->FirstExpert(r), next);
    EXPECT_EQ(p->NumLocalExperts(r), r < 4 ? 9 : 8);
    for (int i = 0; i < p->NumLocalExperts(r); ++i) EXPECT_EQ(p->RankOf(next + i), r);
    next += p->NumLocalExperts(r);
  }
  EXPECT_EQ(next, 60);
}

TEST(ExpertPlacement, OneRankOwnsAll) {
  auto p = ExpertPlacement::Contiguous(5, 1);
  ASSERT_TRUE(p.ok());
  EXPECT_EQ(p->NumLocalExperts(0), 5);
  EXPECT_EQ(p->RankOf(4), 0);
}

TEST(ExpertPlacement, ValidityRange) {
  auto p = ExpertPlacement::Contiguous(32, 4);
  ASSERT_TRUE(p.ok());
  EXPECT_FALSE(p->IsValid(-1));
  EXPECT_TRUE(p->IsValid(0));
  EXPECT_TRUE(p->IsValid(31));
  EXPECT_FALSE(p->IsValid(32));
  EXPECT_FALSE(p->IsValid(int64_t{1} << 40));
}

TEST(ExpertPlacement, RejectsBadArguments) {
  auto a = ExpertPlacement::Contiguous(0, 4);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("num_experts"));
  auto b = ExpertPlacement::Contiguous(8, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("ep_size"));
  auto c = ExpertPlacement::Contiguous(3, 4);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), HasSubstr("got 3"));
}

}  // namespace
}  // namespace moe_ep::core
