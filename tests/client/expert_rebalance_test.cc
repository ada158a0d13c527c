#include "client/expert_rebalance.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::GetExpertLoadResponse Load(std::vector<int64_t> tokens) {
  v1::GetExpertLoadResponse r;
  r.mutable_tokens_per_expert()->Assign(tokens.begin(), tokens.end());
  return r;
}

TEST(SumExpertLoad, SumsTheRanks) {
  auto sum = SumExpertLoad({Load({1, 0, 2}), Load({0, 3, 1})}, 3);
  ASSERT_TRUE(sum.ok()) << sum.status();
  EXPECT_THAT(*sum, ElementsAre(1, 3, 3));
  auto bad = SumExpertLoad({Load({1, 0, 2}), Load({0, 3})}, 3);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(bad.status().message()), HasSubstr("rank 1 reports 2 experts"));
}

TEST(BalanceOf, IsMaxAndMeanOfTheRankLoads) {
  auto table = core::PlacementTable::FromSlotExperts(3, {{0, 1}, {0, 2}});
  ASSERT_TRUE(table.ok());
  auto b = BalanceOf(*table, {6, 2, 4});
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->max_tokens, 7);
  EXPECT_EQ(b->mean_tokens, 6);
  EXPECT_DOUBLE_EQ(b->ratio(), 7.0 / 6.0);
  EXPECT_EQ(RankBalance{}.ratio(), 0.0);
}

TEST(RebalanceForBudget, FillsTheBudgetAndReplicatesTheHottest) {
  // 10 experts, 4 ranks, 1 redundant: 4 slots a rank; expert 9 is hot.
  std::vector<double> load(10, 10.0);
  load[9] = 400.0;
  auto table = RebalanceForBudget(load, 4, 1);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_EQ(table->num_slots(), 16);
  for (int r = 0; r < 4; ++r) EXPECT_EQ(table->NumSlots(r), 4);
  // The 6 redundant slots all go to expert 9 (400 / 7 > 10 still).
  EXPECT_EQ(table->Replicas(9).size(), 7u);
  auto contiguous = core::PlacementTable::Contiguous(10, 4);
  const double before = BalanceOf(*contiguous, load)->ratio();
  const double after = BalanceOf(*table, load)->ratio();
  EXPECT_LT(after, before);
}

TEST(RenderLoadTable, ShowsEachPhase) {
  LayerRebalance l;
  l.layer = 3;
  l.before = {30, 10};
  l.predicted = {11, 10};
  l.slots_per_rank = 4;
  l.redundant_slots_per_rank = 1;
  l.fingerprint = 0xabc;
  const std::string text = RenderLoadTable({l});
  EXPECT_THAT(text, HasSubstr("3.0000 (30 / 10.0)"));
  EXPECT_THAT(text, HasSubstr("1.1000 (11 / 10.0)"));
  EXPECT_THAT(text, HasSubstr("4 (1 redundant)"));
  EXPECT_THAT(text, HasSubstr("0000000000000abc"));
}

}  // namespace
}  // namespace moe_ep::client
