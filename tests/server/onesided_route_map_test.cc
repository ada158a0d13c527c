// Tests of the one-sided plane's host routing (server/onesided_route_map.h;
// DESIGN §15; issue 17 item 5): the dispatch ids of a placement table under
// a rank mask, the replica chosen as the CPU reference chooses it, and the
// lost choices. Host code only: these run without a GPU.

#include "server/onesided_route_map.h"

#include "core/placement_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// 4 experts on 3 ranks x 2 slots: expert 0 only on rank 0, expert 3 only
// on rank 1, experts 1 and 2 twice.
core::PlacementTable Table() {
  return core::PlacementTable::FromSlotExperts(4, {{0, 1}, {2, 3}, {1, 2}}).value();
}

TEST(OneSidedRouteMap, EveryRankLiveNumbersTheRanksExpertsInRankOrder) {
  const absl::StatusOr<OneSidedRouteMap> map = MakeOneSidedRouteMap(Table());
  ASSERT_TRUE(map.ok()) << map.status();
  EXPECT_THAT(map->live_ranks, ElementsAre(0, 1, 2));
  EXPECT_THAT(map->dispatch_rank, ElementsAre(0, 1, 2));
  EXPECT_THAT(map->first_expert, ElementsAre(0, 2, 1));
  EXPECT_THAT(map->dispatch_base, ElementsAre(0, 2, 4));
  EXPECT_EQ(map->num_dispatch_experts, 6);
  EXPECT_EQ(map->table_fingerprint, Table().Fingerprint());
}

TEST(OneSidedRouteMap, AMaskedRankLeavesTheNumberingAndItsExpertsAreLost) {
  const core::PlacementTable masked = Table().WithMask({true, false, true}).value();
  const absl::StatusOr<OneSidedRouteMap> map = MakeOneSidedRouteMap(masked);
  ASSERT_TRUE(map.ok()) << map.status();
  EXPECT_THAT(map->live_ranks, ElementsAre(0, 2));
  EXPECT_THAT(map->dispatch_rank, ElementsAre(0, -1, 1));
  EXPECT_THAT(map->dispatch_base, ElementsAre(0, -1, 2));
  EXPECT_EQ(map->num_dispatch_experts, 4);
  EXPECT_NE(map->table_fingerprint, Table().Fingerprint());

  // Source rank 0, two tokens: [0, 3], [2, -1]. Expert 3 lives only on the
  // masked rank 1: lost (id -1, weight 0). Expert 2: live replicas are
  // (2, 1) only -> dispatch id 2 + (2 - 1) = 3. Expert 0 -> (0, 0) -> 0.
  const std::vector<int32_t> ids = {0, 3, 2, -1};
  const std::vector<float> weights = {0.5f, 0.25f, 0.75f, 0.125f};
  const OneSidedChoices got = MapOneSidedChoices(masked, *map, 0, ids, weights, 2, 2);
  EXPECT_THAT(got.ids, ElementsAre(0, -1, 3, -1));
  EXPECT_THAT(got.weights, ElementsAre(0.5f, 0.0f, 0.75f, 0.125f));
  EXPECT_EQ(got.lost_choices, 1);
  EXPECT_THAT(got.lost_experts, ElementsAre(3));
}

TEST(OneSidedRouteMap, ReplicaChoiceIsTheTablesRoundRobin) {
  // Expert 1 has replicas (0, 1) and (2, 0). ChooseReplica(rank, t, 1) =
  // replicas[(t + rank) mod 2]: from rank 1, token 0 -> (2, 0), token 1 ->
  // (0, 1). Rank 2's experts start at 1, its base is 4: (2, 0) -> 4 + 0;
  // rank 0's base 0, first 0: (0, 1) -> 1.
  const core::PlacementTable table = Table();
  const absl::StatusOr<OneSidedRouteMap> map = MakeOneSidedRouteMap(table);
  ASSERT_TRUE(map.ok()) << map.status();
  const std::vector<int32_t> ids = {1, 1, 1};
  const std::vector<float> weights = {1.0f, 1.0f, 1.0f};
  const OneSidedChoices got = MapOneSidedChoices(table, *map, 1, ids, weights, 3, 1);
  EXPECT_THAT(got.ids, ElementsAre(4, 1, 4));
  EXPECT_EQ(got.lost_choices, 0);
  EXPECT_TRUE(got.lost_experts.empty());
  // Out-of-range ids stay invalid with their weights.
  const std::vector<int32_t> bad = {4, -1};
  const std::vector<float> w = {0.5f, 0.5f};
  const OneSidedChoices invalid = MapOneSidedChoices(table, *map, 0, bad, w, 1, 2);
  EXPECT_THAT(invalid.ids, ElementsAre(-1, -1));
  EXPECT_THAT(invalid.weights, ElementsAre(0.5f, 0.5f));
  EXPECT_EQ(invalid.lost_choices, 0);
}

TEST(OneSidedRouteMap, TheContiguousTableMapsEveryIdToItself) {
  const core::PlacementTable table = core::PlacementTable::Contiguous(10, 4).value();
  const absl::StatusOr<OneSidedRouteMap> map = MakeOneSidedRouteMap(table);
  ASSERT_TRUE(map.ok()) << map.status();
  EXPECT_EQ(map->num_dispatch_experts, 10);
  std::vector<int32_t> ids(10);
  for (int i = 0; i < 10; ++i) ids[i] = i;
  const std::vector<float> weights(10, 1.0f);
  const OneSidedChoices got = MapOneSidedChoices(table, *map, 3, ids, weights, 10, 1);
  EXPECT_EQ(got.ids, ids);
  // Rank 0 (3 experts) masked: 3, 2, 2 is still the split of 7 on 3 ranks.
  const core::PlacementTable masked = table.WithMask({false, true, true, true}).value();
  const absl::StatusOr<OneSidedRouteMap> survivors = MakeOneSidedRouteMap(masked);
  ASSERT_TRUE(survivors.ok()) << survivors.status();
  EXPECT_THAT(survivors->dispatch_base, ElementsAre(-1, 0, 3, 5));
  const OneSidedChoices moved = MapOneSidedChoices(masked, *survivors, 3, ids, weights, 10, 1);
  EXPECT_THAT(moved.ids, ElementsAre(-1, -1, -1, 0, 1, 2, 3, 4, 5, 6));
  EXPECT_THAT(moved.lost_experts, ElementsAre(0, 1, 2));
}

TEST(OneSidedRouteMap, RefusesRanksWhoseExpertsAreNotARangeOrNotTheSplit) {
  // Rank 0 holds {0, 2}: not one range of ids.
  const core::PlacementTable gaps =
      core::PlacementTable::FromSlotExperts(4, {{0, 2}, {1, 3}}).value();
  const absl::StatusOr<OneSidedRouteMap> refused = MakeOneSidedRouteMap(gaps);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("rank 0 holds {0,2}"));
  // Rank 0 holds one distinct expert (twice), rank 1 two: 1, 2 is not the
  // split of 3 on 2 ranks (2, 1).
  const core::PlacementTable uneven =
      core::PlacementTable::FromSlotExperts(3, {{0, 0}, {1, 2}}).value();
  const absl::StatusOr<OneSidedRouteMap> split = MakeOneSidedRouteMap(uneven);
  ASSERT_FALSE(split.ok());
  EXPECT_EQ(split.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(split.status().message(), HasSubstr("rank 0 holds 1 distinct experts"));
}

}  // namespace
}  // namespace moe_ep::server
