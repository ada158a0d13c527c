#include "core/placement_table.h"

#include <map>
#include <utility>
#include <vector>

#include "core/expert_placement.h"
#include "core/fingerprint.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace placement_table_test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::vector<ReplicaSlot> ReplicaList(absl::Span<const ReplicaSlot> span) {
  return std::vector<ReplicaSlot>(span.begin(), span.end());
}

void ExpectInvalid(const absl::StatusOr<PlacementTable>& t, const std::string& fragment) {
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr(fragment));
}

TEST(PlacementTable, ContiguousEightOnTwo) {
  auto t = PlacementTable::Contiguous(8, 2);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->num_experts(), 8);
  EXPECT_EQ(t->ep_size(), 2);
  EXPECT_EQ(t->num_slots(), 8);
  EXPECT_THAT(t->SlotExperts(0), ElementsAre(0, 1, 2, 3));
  EXPECT_THAT(t->SlotExperts(1), ElementsAre(4, 5, 6, 7));
  EXPECT_THAT(t->PhysicalToLogical(), ElementsAre(0, 1, 2, 3, 4, 5, 6, 7));
  EXPECT_THAT(ReplicaList(t->Replicas(5)), ElementsAre(ReplicaSlot{1, 1}));
}

// The default table is exactly where the tree places experts today
// (ExpertPlacement, DESIGN §7), including the uneven split.
TEST(PlacementTable, ContiguousMatchesExpertPlacement) {
  for (auto [experts, ranks] : std::vector<std::pair<int, int>>{{10, 4}, {256, 8}, {60, 8}}) {
    auto t = PlacementTable::Contiguous(experts, ranks);
    ASSERT_TRUE(t.ok()) << t.status();
    auto p = ExpertPlacement::Contiguous(experts, ranks);
    ASSERT_TRUE(p.ok());
    for (int r = 0; r < ranks; ++r) {
      ASSERT_EQ(t->NumSlots(r), p->NumLocalExperts(r)) << experts << "/" << ranks << " rank " << r;
      for (int s = 0; s < t->NumSlots(r); ++s) {
        EXPECT_EQ(t->SlotExperts(r)[s], p->FirstExpert(r) + s);
      }
    }
    for (int e = 0; e < experts; ++e) {
      ASSERT_EQ(t->Replicas(e).size(), 1u);
      EXPECT_EQ(t->Replicas(e)[0].rank, p->RankOf(e)) << "expert " << e;
    }
  }
  auto uneven = PlacementTable::Contiguous(10, 4);
  ASSERT_TRUE(uneven.ok());
  EXPECT_THAT(uneven->SlotExperts(1), ElementsAre(3, 4, 5));
  EXPECT_THAT(uneven->SlotExperts(3), ElementsAre(8, 9));
}

TEST(PlacementTable, ContiguousRejectsWhatExpertPlacementRejects) {
  ExpectInvalid(PlacementTable::Contiguous(0, 2), "num_experts");
  ExpectInvalid(PlacementTable::Contiguous(4, 0), "ep_size");
  ExpectInvalid(PlacementTable::Contiguous(3, 4), "every rank owns an expert");
}

TEST(PlacementTable, FromSlotExpertsOrdersReplicasByRankThenSlot) {
  // 3 experts on 2 ranks x 3 slots; expert 0 has three replicas.
  auto t = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {2, 0, 2}});
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->num_slots(), 6);
  EXPECT_THAT(ReplicaList(t->Replicas(0)),
              ElementsAre(ReplicaSlot{0, 1}, ReplicaSlot{0, 2}, ReplicaSlot{1, 1}));
  EXPECT_THAT(ReplicaList(t->Replicas(1)), ElementsAre(ReplicaSlot{0, 0}));
  EXPECT_THAT(ReplicaList(t->Replicas(2)), ElementsAre(ReplicaSlot{1, 0}, ReplicaSlot{1, 2}));
}

TEST(PlacementTable, FromSlotExpertsRejectsBadMaps) {
  ExpectInvalid(PlacementTable::FromSlotExperts(0, {{0}}), "num_experts: expected >= 1, got 0");
  ExpectInvalid(PlacementTable::FromSlotExperts(2, {}), "got no rank");
  ExpectInvalid(PlacementTable::FromSlotExperts(2, {{0, 1}, {}}), "rank 1 has no slot");
  // 4 slots on 2 ranks must be 2 + 2.
  ExpectInvalid(PlacementTable::FromSlotExperts(3, {{0, 1, 2}, {0}}),
                "rank 0 has 3 slots, expected 2");
  // 5 slots on 2 ranks: 3 + 2 (the §7 split), not 2 + 3.
  ExpectInvalid(PlacementTable::FromSlotExperts(3, {{0, 1}, {2, 0, 1}}),
                "rank 0 has 2 slots, expected 3");
  EXPECT_TRUE(PlacementTable::FromSlotExperts(3, {{0, 1, 2}, {2, 0}}).ok());
  ExpectInvalid(PlacementTable::FromSlotExperts(3, {{0, 1}, {3, 2}}),
                "rank 1 slot 0 holds expert 3, expected an id in [0, 3)");
  ExpectInvalid(PlacementTable::FromSlotExperts(3, {{0, -1}, {2, 2}}),
                "rank 0 slot 1 holds expert -1");
  ExpectInvalid(PlacementTable::FromSlotExperts(4, {{0, 1}, {3, 3}}),
                "logical expert 2 is held by no slot");
}

TEST(PlacementTable, FromReplicasEqualsTheSamePhysicalMap) {
  // Lists in any order; the table sorts them.
  auto a =
      PlacementTable::FromReplicas(3, 2, 3, {{{1, 1}, {0, 2}, {0, 1}}, {{0, 0}}, {{1, 2}, {1, 0}}});
  ASSERT_TRUE(a.ok()) << a.status();
  auto b = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {2, 0, 2}});
  ASSERT_TRUE(b.ok());
  EXPECT_TRUE(*a == *b);
  EXPECT_EQ(a->Fingerprint(), b->Fingerprint());
  EXPECT_THAT(ReplicaList(a->Replicas(0)),
              ElementsAre(ReplicaSlot{0, 1}, ReplicaSlot{0, 2}, ReplicaSlot{1, 1}));
}

TEST(PlacementTable, FromReplicasRejectsBadLists) {
  ExpectInvalid(PlacementTable::FromReplicas(2, 1, 0, {{{0, 0}}, {{0, 1}}}), "got 2, 1 and 0");
  ExpectInvalid(PlacementTable::FromReplicas(2, 1, 2, {{{0, 0}}}),
                "one list per logical expert (2), got 1");
  ExpectInvalid(PlacementTable::FromReplicas(2, 1, 2, {{{0, 0}, {0, 1}}, {}}),
                "logical expert 1 has no replica");
  ExpectInvalid(PlacementTable::FromReplicas(2, 2, 1, {{{0, 0}}, {{2, 0}}}),
                "expert 1 replica 0: rank 2 outside [0, 2)");
  ExpectInvalid(PlacementTable::FromReplicas(2, 2, 1, {{{0, 0}}, {{1, 1}}}),
                "expert 1 replica 0: slot 1 outside [0, 1) on rank 1");
  ExpectInvalid(PlacementTable::FromReplicas(2, 2, 1, {{{0, 0}, {1, 0}}, {{1, 0}}}),
                "rank 1 slot 0 is given twice, to expert 0 and to expert 1");
  ExpectInvalid(PlacementTable::FromReplicas(2, 2, 2, {{{0, 0}, {1, 0}}, {{1, 1}}}),
                "rank 0 slot 1 holds no expert; all 2 x 2 slots must be filled");
}

TEST(PlacementTable, ChooseReplicaIsRoundRobinOffsetByRank) {
  // Expert 0: replicas (0,1), (0,2), (1,1).
  auto t = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {2, 0, 2}});
  ASSERT_TRUE(t.ok());
  // (token + rank) mod 3 -> 0, 1, 2.
  EXPECT_EQ(t->ChooseReplica(0, 0, 0), (ReplicaSlot{0, 1}));
  EXPECT_EQ(t->ChooseReplica(0, 1, 0), (ReplicaSlot{0, 2}));
  EXPECT_EQ(t->ChooseReplica(1, 1, 0), (ReplicaSlot{1, 1}));
  EXPECT_EQ(t->ChooseReplica(1, 5, 0), (ReplicaSlot{0, 1}));
  EXPECT_EQ(t->ChooseReplica(1, int64_t{1} << 40, 0), t->Replicas(0)[((int64_t{1} << 40) + 1) % 3]);
  // A single replica receives every token.
  for (int64_t tok = 0; tok < 10; ++tok)
    EXPECT_EQ(t->ChooseReplica(1, tok, 1), (ReplicaSlot{0, 0}));
}

TEST(PlacementTable, ChooseReplicaRepeatsAndSplitsEvenly) {
  auto a = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {2, 0, 2}});
  auto b = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {2, 0, 2}});
  ASSERT_TRUE(a.ok() && b.ok());
  std::map<std::pair<int, int>, int> hits;
  for (int rank = 0; rank < 2; ++rank) {
    for (int64_t tok = 0; tok < 300; ++tok) {
      const ReplicaSlot x = a->ChooseReplica(rank, tok, 0);
      ASSERT_EQ(x, b->ChooseReplica(rank, tok, 0));
      ++hits[{x.rank, x.slot}];
    }
  }
  // 600 tokens over 3 replicas.
  ASSERT_EQ(hits.size(), 3u);
  for (const auto& [slot, n] : hits) EXPECT_EQ(n, 200) << slot.first << "/" << slot.second;
}

TEST(PlacementTable, FingerprintIsFnvOfCanonicalText) {
  auto t = PlacementTable::Contiguous(4, 2);
  ASSERT_TRUE(t.ok());
  EXPECT_EQ(t->CanonicalText(), "moe-ep-placement/v1;experts=4;rank0=0,1;rank1=2,3;");
  // Computed outside the tree (Python FNV-1a 64 of the text above).
  EXPECT_EQ(Hex64(t->Fingerprint()), "d45e4d1bfa524415");
}

TEST(PlacementTable, FingerprintChangesWhenAReplicaMoves) {
  auto base = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {2, 0, 2}});
  // Expert 0's replica on rank 1 slot 1 moves to rank 1 slot 0 (expert 2's
  // replica takes its place): same counts per rank and per expert.
  auto moved = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {0, 2, 2}});
  // Expert 0's third replica becomes an expert 2 replica.
  auto changed = PlacementTable::FromSlotExperts(3, {{1, 0, 0}, {2, 2, 2}});
  ASSERT_TRUE(base.ok() && moved.ok() && changed.ok());
  EXPECT_NE(base->Fingerprint(), moved->Fingerprint());
  EXPECT_NE(base->Fingerprint(), changed->Fingerprint());
  EXPECT_NE(moved->Fingerprint(), changed->Fingerprint());
  EXPECT_FALSE(*base == *moved);
  // Swapping two ranks' contents also moves replicas.
  auto c = PlacementTable::Contiguous(4, 2);
  auto swapped = PlacementTable::FromSlotExperts(4, {{2, 3}, {0, 1}});
  ASSERT_TRUE(c.ok() && swapped.ok());
  EXPECT_NE(c->Fingerprint(), swapped->Fingerprint());
}

}  // namespace
}  // namespace placement_table_test
}  // namespace moe_ep::core
