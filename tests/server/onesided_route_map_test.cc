// Tests of the one-sided plane's host routing (server/onesided_route_map.h;
// DESIGN §15, §17; issue 17 item 5, issue 34 item 2): the dispatch ids of any
// placement table under a rank mask, the replica chosen as the CPU reference
// chooses it, and the lost choices; EPLB's real output on the DeepSeek-V3
// load (../shared/data/traces/sglang_ep_statistics_deepseek), whose ranks do
// not hold ranges of ids, checked against the dispatcher's contiguous rule.
// Host code only: these run without a GPU.

#include "server/onesided_route_map.h"

#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <string>

#include "core/eplb.h"
#include "core/expert_load_file.h"
#include "core/expert_placement.h"
#include "core/expert_source.h"
#include "core/placement_table.h"
#include "core/routing_source.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;

// 4 experts on 3 ranks x 2 slots: expert 0 only on rank 0, expert 3 only
// on rank 1, experts 1 and 2 twice.
core::PlacementTable Table() {
  return core::PlacementTable::FromSlotExperts(4, {{0, 1}, {2, 3}, {1, 2}}).value();
}

TEST(OneSidedRouteMap, EveryRankLiveNumbersTheRanksExpertsInRankOrder) {
  const OneSidedRouteMap map = MakeOneSidedRouteMap(Table());
  EXPECT_THAT(map.live_ranks, ElementsAre(0, 1, 2));
  EXPECT_THAT(map.dispatch_rank, ElementsAre(0, 1, 2));
  EXPECT_THAT(map.num_local, ElementsAre(2, 2, 2));
  EXPECT_THAT(map.dispatch_base, ElementsAre(0, 2, 4));
  EXPECT_EQ(map.num_dispatch_experts, 6);
  EXPECT_EQ(map.table_fingerprint, Table().Fingerprint());
  // Local slots: rank 0 {0, 1}, rank 1 {2, 3}, rank 2 {1, 2}.
  EXPECT_THAT(map.local_slot, ElementsAre(0, 1, -1, -1, -1, -1, 0, 1, -1, 0, 1, -1));
  EXPECT_THAT(OneSidedSlotIds(map, 2), ElementsAre(4, 5));
}

TEST(OneSidedRouteMap, AMaskedRankLeavesTheNumberingAndItsExpertsAreLost) {
  const core::PlacementTable masked = Table().WithMask({true, false, true}).value();
  const OneSidedRouteMap map = MakeOneSidedRouteMap(masked);
  EXPECT_THAT(map.live_ranks, ElementsAre(0, 2));
  EXPECT_THAT(map.dispatch_rank, ElementsAre(0, -1, 1));
  EXPECT_THAT(map.dispatch_base, ElementsAre(0, -1, 2));
  EXPECT_EQ(map.num_dispatch_experts, 4);
  EXPECT_NE(map.table_fingerprint, Table().Fingerprint());

  // Source rank 0, two tokens: [0, 3], [2, -1]. Expert 3 lives only on the
  // masked rank 1: lost (id -1, weight 0). Expert 2: live replicas are
  // (2, 1) only, rank 2's local slot 1 -> dispatch id 2 + 1 = 3. Expert 0
  // -> (0, 0) -> 0.
  const std::vector<int32_t> ids = {0, 3, 2, -1};
  const std::vector<float> weights = {0.5f, 0.25f, 0.75f, 0.125f};
  const OneSidedChoices got = MapOneSidedChoices(masked, map, 0, ids, weights, 2, 2);
  EXPECT_THAT(got.ids, ElementsAre(0, -1, 3, -1));
  EXPECT_THAT(got.weights, ElementsAre(0.5f, 0.0f, 0.75f, 0.125f));
  EXPECT_EQ(got.lost_choices, 1);
  EXPECT_THAT(got.lost_experts, ElementsAre(3));
}

TEST(OneSidedRouteMap, ReplicaChoiceIsTheTablesRoundRobin) {
  // Expert 1 has replicas (0, 1) and (2, 0). ChooseReplica(rank, t, 1) =
  // replicas[(t + rank) mod 2]: from rank 1, token 0 -> (2, 0), token 1 ->
  // (0, 1). Expert 1 is rank 2's local slot 0, its base is 4: (2, 0) -> 4 +
  // 0; rank 0's slot 1, base 0: (0, 1) -> 1.
  const core::PlacementTable table = Table();
  const OneSidedRouteMap map = MakeOneSidedRouteMap(table);
  const std::vector<int32_t> ids = {1, 1, 1};
  const std::vector<float> weights = {1.0f, 1.0f, 1.0f};
  const OneSidedChoices got = MapOneSidedChoices(table, map, 1, ids, weights, 3, 1);
  EXPECT_THAT(got.ids, ElementsAre(4, 1, 4));
  EXPECT_EQ(got.lost_choices, 0);
  EXPECT_TRUE(got.lost_experts.empty());
  // Out-of-range ids stay invalid with their weights.
  const std::vector<int32_t> bad = {4, -1};
  const std::vector<float> w = {0.5f, 0.5f};
  const OneSidedChoices invalid = MapOneSidedChoices(table, map, 0, bad, w, 1, 2);
  EXPECT_THAT(invalid.ids, ElementsAre(-1, -1));
  EXPECT_THAT(invalid.weights, ElementsAre(0.5f, 0.5f));
  EXPECT_EQ(invalid.lost_choices, 0);
}

TEST(OneSidedRouteMap, TheContiguousTableMapsEveryIdToItself) {
  const core::PlacementTable table = core::PlacementTable::Contiguous(10, 4).value();
  const OneSidedRouteMap map = MakeOneSidedRouteMap(table);
  EXPECT_EQ(map.num_dispatch_experts, 10);
  std::vector<int32_t> ids(10);
  for (int i = 0; i < 10; ++i) ids[i] = i;
  const std::vector<float> weights(10, 1.0f);
  const OneSidedChoices got = MapOneSidedChoices(table, map, 3, ids, weights, 10, 1);
  EXPECT_EQ(got.ids, ids);
  // Rank 0 (3 experts) masked: 3, 2, 2 is still the split of 7 on 3 ranks.
  const core::PlacementTable masked = table.WithMask({false, true, true, true}).value();
  const OneSidedRouteMap survivors = MakeOneSidedRouteMap(masked);
  EXPECT_THAT(survivors.dispatch_base, ElementsAre(-1, 0, 3, 5));
  const OneSidedChoices moved = MapOneSidedChoices(masked, survivors, 3, ids, weights, 10, 1);
  EXPECT_THAT(moved.ids, ElementsAre(-1, -1, -1, 0, 1, 2, 3, 4, 5, 6));
  EXPECT_THAT(moved.lost_experts, ElementsAre(0, 1, 2));
}

// Any table (DESIGN §17; issue 34 item 2): these two were refused while a
// rank's experts had to be one range of ids in the §7 split.
TEST(OneSidedRouteMap, TakesRanksWhoseExpertsAreNotARange) {
  // Rank 0 holds {0, 2}, rank 1 {1, 3}: 2, 2 is the split of 4, so no
  // padding; expert 2 is rank 0's slot 1 (id 1), expert 1 rank 1's slot 0
  // (id 2 + 0).
  const core::PlacementTable gaps =
      core::PlacementTable::FromSlotExperts(4, {{0, 2}, {1, 3}}).value();
  const OneSidedRouteMap map = MakeOneSidedRouteMap(gaps);
  EXPECT_THAT(map.dispatch_base, ElementsAre(0, 2));
  EXPECT_EQ(map.num_dispatch_experts, 4);
  const std::vector<int32_t> ids = {0, 2, 1, 3};
  const std::vector<float> weights(4, 1.0f);
  EXPECT_THAT(MapOneSidedChoices(gaps, map, 0, ids, weights, 2, 2).ids, ElementsAre(0, 1, 2, 3));
}

TEST(OneSidedRouteMap, PadsRanksWhoseCountsAreNotTheSplit) {
  // Rank 0 holds expert 0 twice (1 distinct), rank 1 {1, 2}: 1, 2 is not
  // the split of 3 on 2 ranks (2, 1), so each live rank gets M = 2 ids:
  // bases {0, 2}, V = 4, and the dispatcher's Contiguous(4, 2) gives rank 0
  // [0, 2) (id 1 unused) and rank 1 [2, 4).
  const core::PlacementTable uneven =
      core::PlacementTable::FromSlotExperts(3, {{0, 0}, {1, 2}}).value();
  const OneSidedRouteMap map = MakeOneSidedRouteMap(uneven);
  EXPECT_THAT(map.num_local, ElementsAre(1, 2));
  EXPECT_THAT(map.dispatch_base, ElementsAre(0, 2));
  EXPECT_EQ(map.num_dispatch_experts, 4);
  EXPECT_THAT(OneSidedSlotIds(map, 0), ElementsAre(0));
  EXPECT_THAT(OneSidedSlotIds(map, 1), ElementsAre(2, 3));
  const std::vector<int32_t> ids = {0, 1, 2};
  const std::vector<float> weights(3, 1.0f);
  EXPECT_THAT(MapOneSidedChoices(uneven, map, 1, ids, weights, 1, 3).ids, ElementsAre(0, 2, 3));
  // Rank 1 masked: its experts are lost, rank 0 alone is the split of 1.
  const core::PlacementTable masked = uneven.WithMask({true, false}).value();
  const OneSidedRouteMap alone = MakeOneSidedRouteMap(masked);
  EXPECT_THAT(alone.dispatch_base, ElementsAre(0, -1));
  EXPECT_EQ(alone.num_dispatch_experts, 1);
  const OneSidedChoices got = MapOneSidedChoices(masked, alone, 0, ids, weights, 1, 3);
  EXPECT_THAT(got.ids, ElementsAre(0, -1, -1));
  EXPECT_THAT(got.lost_experts, ElementsAre(1, 2));
}

std::string DataDir() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  return (env != nullptr && *env != '\0') ? env : MOE_EP_DATA_DIR;
}

// Every choice's dispatch id checked against rules the map does not use: the
// dispatcher sends id v to live rank c with Contiguous(V, live) (its own
// placement), which must be the live rank of the replica ChooseReplica
// picked, and that rank's slot v - base holds the chosen logical expert
// (its DistinctSlotExperts at that position). Ids of lost experts are -1.
void ExpectDispatchIdsServeTheTable(const core::PlacementTable& table, int source_rank,
                                    const std::vector<int32_t>& ids, int64_t tokens, int top_k) {
  const OneSidedRouteMap map = MakeOneSidedRouteMap(table);
  const absl::StatusOr<core::ExpertPlacement> dispatcher =
      core::ExpertPlacement::Contiguous(map.num_dispatch_experts, map.ep_size());
  ASSERT_TRUE(dispatcher.ok()) << dispatcher.status();
  for (int c = 0; c < map.ep_size(); ++c) {
    const int r = map.live_ranks[c];
    const std::vector<int> slot_ids = OneSidedSlotIds(map, r);
    ASSERT_FALSE(slot_ids.empty());
    EXPECT_GE(slot_ids.front(), dispatcher->FirstExpert(c)) << "rank " << r;
    EXPECT_LT(slot_ids.back(), dispatcher->FirstExpert(c) + dispatcher->NumLocalExperts(c))
        << "rank " << r;
  }
  const std::vector<float> weights(ids.size(), 0.5f);
  const OneSidedChoices got =
      MapOneSidedChoices(table, map, source_rank, ids, weights, tokens, top_k);
  for (int64_t i = 0; i < tokens * top_k; ++i) {
    const int32_t id = ids[i];
    if (table.LiveReplicas(id).empty()) {
      EXPECT_EQ(got.ids[i], -1) << "choice " << i;
      EXPECT_EQ(got.weights[i], 0.0f);
      continue;
    }
    const core::ReplicaSlot replica = table.ChooseReplica(source_rank, i / top_k, id);
    const int32_t v = got.ids[i];
    ASSERT_GE(v, 0) << "choice " << i;
    ASSERT_LT(v, map.num_dispatch_experts);
    const int c = dispatcher->RankOf(v);
    ASSERT_EQ(map.live_ranks[c], replica.rank) << "choice " << i << " expert " << id;
    const std::vector<int> held = core::DistinctSlotExperts(table, replica.rank);
    const int slot = v - map.dispatch_base[replica.rank];
    ASSERT_LT(slot, static_cast<int>(held.size()));
    EXPECT_EQ(held[slot], id) << "choice " << i;
    EXPECT_EQ(got.weights[i], 0.5f);
  }
}

// EPLB's real output (issue 34 item 2): DeepSeek-V3's prefill load of every
// MoE layer, 256 experts on 4 and 8 ranks with 32 redundant slots
// (core::RebalanceHierarchical, 8 groups, one node). Its ranks hold ids that
// are not ranges (asserted, so the case cannot pass vacuously); every
// routed choice of tokens drawn from the same load lands on the chosen
// replica's slot, unmasked and with one rank masked.
TEST(OneSidedRouteMap, ServesEplbTablesOfTheDeepSeekV3Load) {
  const std::string file = DataDir() + "/traces/sglang_ep_statistics_deepseek/prefill_in4096.json";
  if (!std::filesystem::exists(file)) GTEST_SKIP() << "DeepSeek-V3 load not found at " << file;
  const absl::StatusOr<std::vector<std::vector<double>>> load = core::ReadExpertLoadFile(file);
  ASSERT_TRUE(load.ok()) << load.status();
  core::RoutingSourceOptions routing;
  routing.kind = "load:" + file;
  routing.num_experts = 256;
  routing.top_k = 8;
  routing.seed = 5;
  const absl::StatusOr<core::RoutingSource> source = core::RoutingSource::Create(routing);
  ASSERT_TRUE(source.ok()) << source.status();
  int tables = 0;
  int not_ranges = 0;
  int padded = 0;  // tables whose ranks' distinct counts are not the §7 split
  for (const int world : {4, 8}) {
    for (size_t layer = 0; layer < load->size(); ++layer) {
      const std::vector<double>& counts = (*load)[layer];
      if (std::accumulate(counts.begin(), counts.end(), 0.0) == 0) continue;  // dense layer
      const absl::StatusOr<core::PlacementTable> table =
          core::RebalanceHierarchical(counts, {256 + 32, world, 8, 1});
      ASSERT_TRUE(table.ok()) << table.status();
      ++tables;
      const OneSidedRouteMap map = MakeOneSidedRouteMap(*table);
      padded += map.num_dispatch_experts != 256;
      for (int r = 0; r < world; ++r) {
        const std::vector<int> held = core::DistinctSlotExperts(*table, r);
        not_ranges += held.back() - held.front() + 1 != static_cast<int>(held.size());
      }
      const int source_rank = static_cast<int>(layer) % world;
      const absl::StatusOr<core::Routing> step =
          source->Generate(static_cast<int>(layer), 0, source_rank, world, 64);
      ASSERT_TRUE(step.ok()) << step.status();
      ExpectDispatchIdsServeTheTable(*table, source_rank, step->topk_ids, 64, 8);
      std::vector<bool> live(world, true);
      live[(source_rank + 1) % world] = false;
      const absl::StatusOr<core::PlacementTable> masked = table->WithMask(live);
      ASSERT_TRUE(masked.ok()) << masked.status();
      ExpectDispatchIdsServeTheTable(*masked, source_rank, step->topk_ids, 64, 8);
      if (HasFailure()) return;
    }
  }
  std::cout << "[eplb-route-map] " << tables << " tables, " << not_ranges
            << " ranks holding no range of ids, " << padded << " tables with padded dispatch ids"
            << std::endl;
  EXPECT_EQ(tables, 2 * 58);  // layers 3..60 of the file, at two world sizes
  EXPECT_GT(not_ranges, 0) << "EPLB's tables must exercise ranks that hold no range of ids";
}

}  // namespace
}  // namespace moe_ep::server
