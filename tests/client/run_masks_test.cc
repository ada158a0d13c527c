#include "client/run_masks.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::ElementsAre;

TEST(RingReplicaTable, RedundantSlotsHoldTheNextRanksExperts) {
  const absl::StatusOr<core::PlacementTable> table = RingReplicaTable(8, 4, 1);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_THAT(table->SlotExperts(0), ElementsAre(0, 1, 2));
  EXPECT_THAT(table->SlotExperts(1), ElementsAre(2, 3, 4));
  EXPECT_THAT(table->SlotExperts(2), ElementsAre(4, 5, 6));
  EXPECT_THAT(table->SlotExperts(3), ElementsAre(6, 7, 0));
  // Rank 2 lost: 4 lives on rank 1 and 6 on rank 3; 5 had no other replica.
  EXPECT_THAT(LostExperts(*table, {true, true, false, true}), ElementsAre(5));
  EXPECT_THAT(LostExperts(*table, {true, true, true, true}), ElementsAre());
  EXPECT_THAT(LostExperts(*table, {false, true, false, true}), ElementsAre(1, 5));
}

TEST(RingReplicaTable, UnevenSplitsAndTwoRedundantSlots) {
  // 10 experts on 4 ranks: 3, 3, 2, 2 of their own; 3 + 2 slots each.
  const absl::StatusOr<core::PlacementTable> table = RingReplicaTable(10, 4, 2);
  ASSERT_TRUE(table.ok()) << table.status();
  EXPECT_THAT(table->SlotExperts(0), ElementsAre(0, 1, 2, 3, 4));
  EXPECT_THAT(table->SlotExperts(2), ElementsAre(6, 7, 8, 9, 0));
  EXPECT_THAT(table->SlotExperts(3), ElementsAre(8, 9, 0, 1, 2));
  EXPECT_THAT(LostExperts(*table, {true, true, false, true}), ElementsAre());
  EXPECT_EQ(RingReplicaTable(4, 4, 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(RingReplicaTable(3, 4, 0).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(DropLostChoices, LostIdsBecomeInvalid) {
  std::vector<int32_t> ids = {5, 1, -1, 5, 7, 2};
  EXPECT_EQ(DropLostChoices({2, 5}, absl::MakeSpan(ids)), 3);
  EXPECT_THAT(ids, ElementsAre(-1, 1, -1, -1, 7, -1));
  EXPECT_EQ(DropLostChoices({}, absl::MakeSpan(ids)), 0);
}

}  // namespace
}  // namespace moe_ep::client
