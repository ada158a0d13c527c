// Rank masks in the core (DESIGN §15; issue 17 item 3): a placement table
// under a mask (live replicas, lost experts, fingerprint), the routes and
// payload ids under it, core::MaskedCollective over a survivors' Gloo group
// in the original numbering, and the dispatcher on it equal to the CPU
// reference under the same mask, bit for bit.

#include <memory>
#include <vector>

#include "core/ep_dispatcher.h"
#include "core/expert_source.h"
#include "core/masked_collective.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
#include "core/routing.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace rank_mask_test {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

// 4 ranks x 3 slots, 8 experts: 3 only on rank 2, 7 on ranks 0 and 2, 0 on
// ranks 0 and 3.
PlacementTable Table() {
  return PlacementTable::FromSlotExperts(8, {{7, 0, 1}, {2, 4, 5}, {3, 7, 6}, {0, 6, 1}}).value();
}

TEST(PlacementTableMask, LiveReplicasLostExpertsAndFingerprint) {
  const PlacementTable table = Table();
  const PlacementTable masked = table.WithMask({true, true, false, true}).value();
  EXPECT_TRUE(masked.masked());
  EXPECT_FALSE(masked.IsLive(2));
  EXPECT_THAT(masked.LostExperts(), ElementsAre(3));
  ASSERT_EQ(masked.LiveReplicas(7).size(), 1u);
  EXPECT_EQ(masked.LiveReplicas(7)[0], (ReplicaSlot{0, 0}));
  EXPECT_TRUE(masked.LiveReplicas(3).empty());
  EXPECT_EQ(masked.Replicas(3).size(), 1u);  // the physical map stays
  // Expert 6 on ranks 2 and 3: every token goes to rank 3 now.
  for (int t = 0; t < 4; ++t) EXPECT_EQ(masked.ChooseReplica(1, t, 6).rank, 3);
  EXPECT_NE(masked.Fingerprint(), table.Fingerprint());
  EXPECT_THAT(masked.CanonicalText(), HasSubstr("live=0,1,3;"));
  EXPECT_FALSE(masked == table);
  // All live: the table itself.
  const PlacementTable none = table.WithMask({true, true, true, true}).value();
  EXPECT_FALSE(none.masked());
  EXPECT_TRUE(none == table);
  EXPECT_EQ(none.Fingerprint(), table.Fingerprint());
  EXPECT_EQ(table.WithMask({true}).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(table.WithMask({false, false, false, false}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PlacementTableMask, LostChoicesGoNowhereAndCarryTheInvalidId) {
  const PlacementTable masked = Table().WithMask({true, true, false, true}).value();
  // Token 0 chooses 3 (lost) and 2 (rank 1); token 1 chooses 3 only.
  const std::vector<int32_t> ids = {3, 2, 3, -1};
  const DispatchRoute route = ComputeDispatchRoute(ids, 2, 2, masked, 0).value();
  EXPECT_THAT(route.send_counts, ElementsAre(0, 1, 0, 0));
  EXPECT_THAT(route.dest_rank, ElementsAre(1));
  EXPECT_EQ(PayloadExpertId(masked, 0, 0, 3, 1, -1), -1);
  EXPECT_EQ(PayloadExpertId(masked, 0, 0, 2, 1, -1), 2);
  // Expert 7 has one live replica: its id passes unchanged.
  EXPECT_EQ(PayloadExpertId(masked, 0, 0, 7, 0, -1), 7);
}

TEST(PlacementTableMask, TheReferenceRejectsTokensOnAMaskedRank) {
  const PlacementTable masked = Table().WithMask({true, true, false, true}).value();
  std::vector<ExpertSet> sets;
  sets.reserve(4);
  for (int r = 0; r < 4; ++r) {
    sets.push_back(
        MakeHostExperts(
            ExpertSource::Seeded(3, 0, 8, 0, 0, 4, 8).WithExperts(DistinctSlotExperts(masked, r)))
            .value());
  }
  std::vector<const ExpertSet*> ptrs = {&sets[0], &sets[1], &sets[2], &sets[3]};
  const std::vector<bf16_t> x(4, FloatToBf16(1.0f));
  const std::vector<int32_t> ids = {1};
  const std::vector<float> w = {1.0f};
  std::vector<EpRankInput> inputs(4);
  inputs[2] = {x, ids, w, 1};
  auto ref = ReferenceEpForward(masked, ptrs, inputs, 1);
  EXPECT_EQ(ref.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(ref.status().message()), HasSubstr("rank 2 is masked out"));
}

EpDispatcherOptions MaskOptions() {
  EpDispatcherOptions o;
  o.workspace.ep_size = 4;
  o.workspace.capacity_tokens = 8;
  o.workspace.hidden = 16;
  o.workspace.top_k = 2;
  o.workspace.dtype = DispatchDType::kBF16;
  o.num_experts = 8;
  o.redundant_slots_per_rank = 1;
  return o;
}

std::vector<int32_t> IdsOf(int rank, int64_t tokens) {
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < tokens; ++t) {
    ids.push_back(static_cast<int32_t>((t + rank) % 8));
    ids.push_back(static_cast<int32_t>((3 * t + rank + 1) % 8));
  }
  return ids;
}

TEST(MaskedCollective, SurvivorsDispatchEqualsTheMaskedReference) {
  const std::vector<bool> live = {true, true, false, true};
  const std::vector<int> survivors = {0, 1, 3};
  const PlacementTable table = Table();
  auto masked = std::make_shared<const PlacementTable>(table.WithMask(live).value());
  const int64_t h = 16;
  std::vector<ExpertSet> sets;
  sets.reserve(4);
  for (int r = 0; r < 4; ++r) {
    sets.push_back(
        MakeHostExperts(
            ExpertSource::Seeded(9, 0, 8, 0, 0, h, 8).WithExperts(DistinctSlotExperts(table, r)))
            .value());
  }
  std::vector<std::vector<bf16_t>> x(4);
  std::vector<std::vector<int32_t>> ids(4);
  std::vector<std::vector<float>> w(4);
  std::vector<int64_t> tokens = {5, 3, 0, 6};
  for (int r : survivors) {
    for (int64_t i = 0; i < tokens[r] * h; ++i) {
      x[r].push_back(FloatToBf16(0.01f * static_cast<float>((i * 7 + r) % 50) - 0.25f));
    }
    ids[r] = IdsOf(r, tokens[r]);
    for (int64_t i = 0; i < tokens[r] * 2; ++i) w[r].push_back(0.125f * (1 + (i + r) % 4));
  }
  std::vector<const ExpertSet*> ptrs = {&sets[0], &sets[1], &sets[2], &sets[3]};
  std::vector<EpRankInput> inputs(4);
  for (int r : survivors) inputs[r] = {x[r], ids[r], w[r], tokens[r]};
  auto ref = ReferenceEpForward(*masked, ptrs, inputs, 2);
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto store = NewHashStore();
  RunOnRanks(3, [&](int index) {
    const int rank = survivors[index];
    auto inner = JoinLoopback(store, index, 3, absl::Seconds(20), "gen1/mask1");
    ASSERT_TRUE(inner.ok()) << inner.status();
    auto group = MaskedCollective::Create(std::move(*inner), rank, live);
    ASSERT_TRUE(group.ok()) << group.status();
    EXPECT_EQ((*group)->size(), 4);
    EXPECT_EQ((*group)->rank(), rank);
    EXPECT_FALSE((*group)->IsLive(2));
    // The masked rank's row is zeros.
    auto counts = AllGatherInt64(**group, 10 + rank);
    ASSERT_TRUE(counts.ok()) << counts.status();
    EXPECT_THAT(*counts, ElementsAre(10, 11, 0, 13));
    auto dispatcher = EpDispatcher::Create(group->get(), MaskOptions(), 0);
    ASSERT_TRUE(dispatcher.ok()) << dispatcher.status();
    ASSERT_TRUE((*dispatcher)->SetPlacement(masked).ok());
    ASSERT_TRUE((*dispatcher)->CommitGeometry(1, 6, tokens[rank]).ok());
    std::vector<bf16_t> out(tokens[rank] * h);
    absl::Status forward =
        (*dispatcher)
            ->Forward(x[rank], ids[rank], w[rank], tokens[rank], sets[rank], absl::MakeSpan(out));
    ASSERT_TRUE(forward.ok()) << forward;
    ASSERT_EQ(out.size(), ref->output[rank].size());
    for (size_t i = 0; i < out.size(); ++i) {
      EXPECT_EQ(out[i], ref->output[rank][i]) << "rank " << rank << " elem " << i;
    }
    // Expert 3 (only on rank 2) is reported when this rank's tokens chose it.
    int64_t lost = 0;
    for (int32_t id : ids[rank]) lost += id == 3 ? 1 : 0;
    EXPECT_EQ((*dispatcher)->last_step().lost_choices, lost) << "rank " << rank;
    if (lost > 0) {
      EXPECT_THAT((*dispatcher)->last_step().lost_experts, ElementsAre(3));
    }
    // A route to the masked rank is refused, never sent.
    std::vector<char> buf(4, 0);
    std::vector<int64_t> send = {0, 0, 1, 0};
    std::vector<int64_t> recv = {0, 0, 0, 0};
    EXPECT_EQ((*group)->AllToAllV(buf.data(), send, buf.data(), recv).code(),
              absl::StatusCode::kInternal);
  });
}

}  // namespace
}  // namespace rank_mask_test
}  // namespace moe_ep::core
