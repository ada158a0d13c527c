#include "core/shrink_plan.h"

#include <gtest/gtest.h>

#include <vector>

namespace moe_ep::core {
namespace {

using Kind = ShrinkPlan::Kind;

std::vector<bool> Live(int world, const std::vector<int>& dead) {
  std::vector<bool> live(world, true);
  for (const int d : dead) live[d] = false;
  return live;
}

TEST(ShrinkPlan, NothingLostKeepsTheCommunicator) {
  absl::StatusOr<ShrinkPlan> plan = PlanShrink({0, 1, 2, 3}, Live(4, {}), 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kind, Kind::kKeep);
  EXPECT_TRUE(plan->exclude.empty());
  EXPECT_EQ(plan->members, (std::vector<int>{0, 1, 2, 3}));
  EXPECT_EQ(plan->new_rank, 2);
}

TEST(ShrinkPlan, KilledRankIsExcludedAndTheRestCloseTheGap) {
  // World 4, rank 2 killed: survivors 0, 1, 3 become communicator ranks 0, 1, 2.
  for (const int me : {0, 1, 3}) {
    absl::StatusOr<ShrinkPlan> plan = PlanShrink({0, 1, 2, 3}, Live(4, {2}), me);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kind, Kind::kShrink);
    EXPECT_EQ(plan->exclude, (std::vector<int>{2}));
    EXPECT_EQ(plan->members, (std::vector<int>{0, 1, 3}));
    EXPECT_EQ(plan->new_rank, me == 3 ? 2 : me);
  }
  // Rank 0 killed in world 2: the survivor is rank 0 of a world-1 communicator.
  absl::StatusOr<ShrinkPlan> two = PlanShrink({0, 1}, Live(2, {0}), 1);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(two->kind, Kind::kShrink);
  EXPECT_EQ(two->exclude, (std::vector<int>{0}));
  EXPECT_EQ(two->new_rank, 0);
}

TEST(ShrinkPlan, SecondLossExcludesInTheShrunkNumbering) {
  // Parent already lacks original rank 1 (members 0, 2, 3 = comm ranks 0, 1, 2);
  // now original rank 3 dies too: exclude comm rank 2, not 3.
  absl::StatusOr<ShrinkPlan> plan = PlanShrink({0, 2, 3}, Live(4, {1, 3}), 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kind, Kind::kShrink);
  EXPECT_EQ(plan->exclude, (std::vector<int>{2}));
  EXPECT_EQ(plan->members, (std::vector<int>{0, 2}));
  EXPECT_EQ(plan->new_rank, 1);
}

TEST(ShrinkPlan, ReturningRankNeedsAFreshCommunicator) {
  // Survivors {0, 1, 3} readmit 2: every member re-initialises, 2 included.
  for (const int me : {0, 2, 3}) {
    absl::StatusOr<ShrinkPlan> plan =
        PlanShrink(me == 2 ? std::vector<int>{2} : std::vector<int>{0, 1, 3}, Live(4, {}), me);
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_EQ(plan->kind, Kind::kReinit);
    EXPECT_TRUE(plan->exclude.empty());
    EXPECT_EQ(plan->members, (std::vector<int>{0, 1, 2, 3}));
    EXPECT_EQ(plan->new_rank, me);
  }
  // A rejoin while another rank is lost: members are the live ranks only.
  absl::StatusOr<ShrinkPlan> plan = PlanShrink({0, 3}, Live(4, {1}), 3);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->kind, Kind::kReinit);
  EXPECT_EQ(plan->members, (std::vector<int>{0, 2, 3}));
  EXPECT_EQ(plan->new_rank, 2);
}

TEST(ShrinkPlan, RejectsBadArgumentsByName) {
  auto code = [](const absl::StatusOr<ShrinkPlan>& p) { return p.status().code(); };
  EXPECT_EQ(code(PlanShrink({}, Live(2, {}), 0)), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ShrinkPlan> unsorted = PlanShrink({1, 0}, Live(2, {}), 0);
  EXPECT_EQ(code(unsorted), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(unsorted.status().message().find("entry 1 is 0"), absl::string_view::npos)
      << unsorted.status();
  EXPECT_EQ(code(PlanShrink({0, 4}, Live(4, {}), 0)), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(code(PlanShrink({0, 1}, Live(2, {}), 2)), absl::StatusCode::kInvalidArgument);
  absl::StatusOr<ShrinkPlan> masked = PlanShrink({0, 1}, Live(2, {1}), 1);
  EXPECT_EQ(code(masked), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(masked.status().message().find("rank 1 is masked"), absl::string_view::npos);
}

TEST(ShrinkPlan, CommRankOfAndLiveMembers) {
  EXPECT_EQ(LiveMembers(Live(5, {0, 3})), (std::vector<int>{1, 2, 4}));
  EXPECT_EQ(CommRankOf({1, 2, 4}, 4), 2);
  EXPECT_EQ(CommRankOf({1, 2, 4}, 1), 0);
  EXPECT_EQ(CommRankOf({1, 2, 4}, 3), -1);
  EXPECT_EQ(CommRankOf({1, 2, 4}, 5), -1);
}

}  // namespace
}  // namespace moe_ep::core
