// EpDispatcher under an installed placement table (DESIGN §15; issue 17
// item 1): replicas chosen by PlacementTable::ChooseReplica, payload ids of
// core::PayloadExpertId, the CPU reference under the same table, bit-for-bit
// repeats and the load counters.

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <random>
#include <vector>

#include "core/ep_dispatcher.h"
#include "core/expert_source.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/ep_dispatcher_harness.h"

namespace moe_ep::core {
namespace ep_dispatcher_placement_test {
namespace {

using ::moe_ep::core::testing::DispatcherOptions;
using ::moe_ep::core::testing::RandomInput;
using ::moe_ep::core::testing::RunEp;
using ::moe_ep::core::testing::StepInput;
using ::testing::ElementsAre;
using ::testing::HasSubstr;

EpDispatcherOptions Options(int ep_size, int64_t capacity, int64_t hidden, int top_k,
                            int num_experts, int redundant) {
  EpDispatcherOptions o = DispatcherOptions(ep_size, capacity, hidden, top_k, num_experts);
  o.redundant_slots_per_rank = redundant;
  return o;
}

std::shared_ptr<const PlacementTable> Table(int num_experts, std::vector<std::vector<int>> slots) {
  auto table = PlacementTable::FromSlotExperts(num_experts, std::move(slots));
  EXPECT_TRUE(table.ok()) << table.status();
  return std::make_shared<const PlacementTable>(*std::move(table));
}

// 2 ranks, 6 experts, 4 slots a rank: experts 5 and 2 have two replicas.
std::shared_ptr<const PlacementTable> TwoRankTable() {
  return Table(6, {{5, 2, 0, 3}, {1, 4, 5, 2}});
}
// 4 ranks, 8 experts, 3 slots a rank: 7 on ranks 0 and 1, 0 and 6 twice, and
// rank 2 holds expert 5 in two slots (one copy of its weights).
std::shared_ptr<const PlacementTable> FourRankTable() {
  return Table(8, {{7, 0, 3}, {1, 7, 6}, {2, 5, 5}, {4, 6, 0}});
}

// --- routing and payload ids ----------------------------------------------

TEST(ComputeDispatchRouteTable, ContiguousTableGivesThePlacementRoute) {
  const std::vector<int32_t> ids = {0, 7, 3, 3, -1, 9, 5, 2};
  auto placement = ExpertPlacement::Contiguous(8, 3).value();
  auto table = PlacementTable::Contiguous(8, 3).value();
  for (int source = 0; source < 3; ++source) {
    auto a = ComputeDispatchRoute(ids, 4, 2, placement).value();
    auto b = ComputeDispatchRoute(ids, 4, 2, table, source).value();
    EXPECT_EQ(a.send_counts, b.send_counts);
    EXPECT_EQ(a.dest_rank, b.dest_rank);
    EXPECT_EQ(a.dest_slot, b.dest_slot);
    EXPECT_EQ(a.tokens_for_rank, b.tokens_for_rank);
  }
}

TEST(ComputeDispatchRouteTable, ReplicaIsTokenPlusRankModuloReplicas) {
  auto table = TwoRankTable();
  // Expert 5: replicas (0,0), (1,2). Source rank 1: token 0 -> (0+1)%2 = 1
  // -> rank 1; token 1 -> 0 -> rank 0.
  const std::vector<int32_t> ids = {5, 5};
  auto route = ComputeDispatchRoute(ids, 2, 1, *table, 1).value();
  EXPECT_THAT(route.dest_rank, ElementsAre(1, 0));
  EXPECT_THAT(route.send_counts, ElementsAre(1, 1));
  EXPECT_EQ(ComputeDispatchRoute(ids, 2, 1, *table, 2).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PayloadExpertId, MasksReplicatedChoicesServedElsewhere) {
  auto table = TwoRankTable();
  // Source 0, token 0, expert 5 -> replica 0 on rank 0.
  EXPECT_EQ(PayloadExpertId(*table, 0, 0, 5, 0, -1), 5);
  EXPECT_EQ(PayloadExpertId(*table, 0, 0, 5, 1, -1), -1);
  EXPECT_EQ(PayloadExpertId(*table, 0, 0, 5, 1, 6), 6);
  // Single-replica and invalid ids pass unchanged.
  EXPECT_EQ(PayloadExpertId(*table, 0, 0, 1, 0, -1), 1);
  EXPECT_EQ(PayloadExpertId(*table, 0, 0, -1, 0, 6), -1);
}

TEST(CountExpertTokens, CountsValidChoices) {
  std::vector<int64_t> counts(3, 0);
  CountExpertTokens(std::vector<int32_t>{0, 2, 2, -1}, 3, absl::MakeSpan(counts));
  EXPECT_THAT(counts, ElementsAre(1, 0, 2));
  CountExpertTokens(std::vector<int32_t>{3, 1}, 3, absl::MakeSpan(counts));
  EXPECT_THAT(counts, ElementsAre(1, 1, 2));
}

// --- SetPlacement ----------------------------------------------------------

TEST(EpDispatcherSetPlacement, RejectsTablesOutsideTheSlotBudget) {
  RunEp(2, Options(2, 4, 4, 2, 6, 0), [&](int, EpDispatcher& d) {
    // Budget ceil(6/2) + 0 = 3 slots; the table needs 4.
    absl::Status s = d.SetPlacement(TwoRankTable());
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(s.message(), HasSubstr("rank 0 has 4 slots, the workspace's budget is 3"));
    EXPECT_EQ(d.placement()->Fingerprint(), PlacementTable::Contiguous(6, 2)->Fingerprint());
    absl::Status experts = d.SetPlacement(Table(5, {{0, 1, 2}, {3, 4, 0}}));
    EXPECT_THAT(experts.message(), HasSubstr("num_experts expected 6"));
  });
}

// --- hand-computed step ------------------------------------------------------

// Rank 0: t0 [5, 1], t1 [0, -1]; rank 1: t0 [5, 4], t1 [2, 3].
//   r0 t0: 5 -> (0+0)%2 = 0 -> rank 0; 1 -> rank 1.      dests {0, 1}
//   r0 t1: 0 -> rank 0.                                   dests {0}
//   r1 t0: 5 -> (0+1)%2 = 1 -> rank 1; 4 -> rank 1.      dests {1}
//   r1 t1: 2 -> (1+1)%2 = 0 -> rank 0; 3 -> rank 0.      dests {0}
// Rank 1 receives r0 t0 with expert 5 masked (rank 0 serves it), so with
// identity experts out = (sum of weights) * x, not 2 w_5 + w_1.
TEST(EpDispatcherPlacement, HandComputedRouteMaskAndCounts) {
  const int64_t h = 2;
  auto table = TwoRankTable();
  RunEp(2, Options(2, 4, h, 2, 6, 1), [&](int rank, EpDispatcher& d) {
    ASSERT_TRUE(d.SetPlacement(table).ok());
    const std::vector<int32_t> ids =
        rank == 0 ? std::vector<int32_t>{5, 1, 0, -1} : std::vector<int32_t>{5, 4, 2, 3};
    const std::vector<float> w = {0.5f, 0.25f, 0.75f, 0.125f};
    const std::vector<bf16_t> x = {FloatToBf16(1.0f), FloatToBf16(2.0f), FloatToBf16(-1.0f),
                                   FloatToBf16(4.0f)};
    ASSERT_TRUE(d.CommitGeometry(1, 2, 2).ok());
    ASSERT_TRUE(d.Dispatch(x, ids, w, 2).ok());
    if (rank == 0) {
      EXPECT_THAT(d.received_counts(), ElementsAre(2, 1));
      EXPECT_THAT(d.ReceivedIds(0), ElementsAre(5, 1, 0, -1));
      EXPECT_THAT(d.ReceivedIds(1), ElementsAre(2, 3, -1, -1));
    } else {
      EXPECT_THAT(d.received_counts(), ElementsAre(1, 1));
      EXPECT_THAT(d.ReceivedIds(0), ElementsAre(-1, 1, -1, -1));
      EXPECT_THAT(d.ReceivedIds(1), ElementsAre(5, 4, -1, -1));
    }
    const std::vector<int> mine = DistinctSlotExperts(*table, rank);
    std::vector<ExpertSet> parts;
    parts.reserve(mine.size());
    for (int e : mine) parts.push_back(ExpertSet::Identity(e, 1, h));
    ExpertSet experts = ExpertSet::Union(std::move(parts)).value();
    ASSERT_TRUE(d.ComputeExperts(experts).ok());
    std::vector<bf16_t> out(2 * h);
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    for (int64_t t = 0; t < 2; ++t) {
      const float wsum = rank == 0 && t == 1 ? w[2] : w[2 * t] + w[2 * t + 1];
      for (int64_t i = 0; i < h; ++i) {
        EXPECT_EQ(Bf16ToFloat(out[t * h + i]), wsum * Bf16ToFloat(x[t * h + i]))
            << "rank " << rank << " token " << t;
      }
    }
    const ExpertLoadCounts load = d.ReadExpertLoad(/*reset=*/true);
    EXPECT_EQ(load.steps, 1);
    if (rank == 0) {
      EXPECT_THAT(load.tokens_per_expert, ElementsAre(1, 1, 0, 0, 0, 1));
    } else {
      EXPECT_THAT(load.tokens_per_expert, ElementsAre(0, 0, 1, 1, 1, 1));
    }
    const ExpertLoadCounts after = d.ReadExpertLoad(false);
    EXPECT_EQ(after.steps, 0);
    EXPECT_THAT(after.tokens_per_expert, ElementsAre(0, 0, 0, 0, 0, 0));
  });
}

// --- against the CPU reference ----------------------------------------------

struct TableCase {
  int ep_size;
  int num_experts;
  std::shared_ptr<const PlacementTable> (*table)();
};

class EpDispatcherPlacementReferenceTest : public ::testing::TestWithParam<TableCase> {};

// One Gloo run of `steps` identical Forward steps with seeded SwiGLU experts
// under the case's table; returns each rank's outputs and checks received
// rows against ReferenceEpForward under the same table.
std::vector<std::vector<bf16_t>> RunAgainstReference(const TableCase& c) {
  const int ep = c.ep_size;
  const int64_t h = 16;
  const int64_t inter = 24;
  const int k = 3;
  const uint64_t seed = 11;
  const int layer = 1;
  auto table = c.table();
  std::vector<StepInput> inputs;
  inputs.reserve(ep);
  for (int r = 0; r < ep; ++r)
    inputs.push_back(RandomInput(300 + r, 3 + 2 * r, h, k, c.num_experts));
  std::vector<ExpertSet> rank_sets;
  for (int r = 0; r < ep; ++r) {
    ExpertSource source = ExpertSource::Seeded(seed, layer, c.num_experts, 0, 0, h, inter)
                              .WithExperts(DistinctSlotExperts(*table, r));
    rank_sets.push_back(MakeHostExperts(source).value());
  }
  std::vector<const ExpertSet*> set_ptrs;
  std::vector<EpRankInput> ref_inputs;
  for (int r = 0; r < ep; ++r) {
    set_ptrs.push_back(&rank_sets[r]);
    ref_inputs.push_back(
        EpRankInput{inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].tokens});
  }
  auto ref = ReferenceEpForward(*table, set_ptrs, ref_inputs, k);
  EXPECT_TRUE(ref.ok()) << ref.status();
  if (!ref.ok()) return {};
  const int64_t r_max = ref->runtime_max_tokens_per_rank;
  std::vector<std::vector<bf16_t>> outputs(ep);
  RunEp(ep, Options(ep, 16, h, k, c.num_experts, 1), [&](int rank, EpDispatcher& d) {
    ASSERT_TRUE(d.SetPlacement(table).ok());
    const StepInput& in = inputs[rank];
    ASSERT_TRUE(d.CommitGeometry(1, r_max, in.tokens).ok());
    ASSERT_TRUE(d.Dispatch(in.hidden, in.ids, in.weights, in.tokens).ok());
    const EpRankReceive& rx = ref->received[rank];
    EXPECT_EQ(d.received_counts(), rx.counts);
    for (int s = 0; s < ep; ++s) {
      auto rh = d.ReceivedHidden(s);
      auto ri = d.ReceivedIds(s);
      EXPECT_TRUE(std::equal(rh.begin(), rh.end(), rx.hidden.begin() + s * r_max * h))
          << "hidden from source " << s;
      EXPECT_TRUE(std::equal(ri.begin(), ri.end(), rx.ids.begin() + s * r_max * k))
          << "ids from source " << s;
    }
    ASSERT_TRUE(d.ComputeExperts(rank_sets[rank]).ok());
    std::vector<bf16_t> out(in.tokens * h);
    ASSERT_TRUE(d.Combine(absl::MakeSpan(out)).ok());
    // Same rows, same experts, same fp32 order: the reference's bits.
    EXPECT_EQ(out, ref->output[rank]) << "rank " << rank;
    outputs[rank] = out;
  });
  return outputs;
}

TEST_P(EpDispatcherPlacementReferenceTest, EqualsReferenceAndRepeatsBitForBit) {
  const auto first = RunAgainstReference(GetParam());
  const auto second = RunAgainstReference(GetParam());
  ASSERT_EQ(first.size(), static_cast<size_t>(GetParam().ep_size));
  EXPECT_EQ(first, second);
}

INSTANTIATE_TEST_SUITE_P(Tables, EpDispatcherPlacementReferenceTest,
                         ::testing::Values(TableCase{2, 6, &TwoRankTable},
                                           TableCase{4, 8, &FourRankTable}),
                         [](const ::testing::TestParamInfo<TableCase>& info) {
                           return "E" + std::to_string(info.param.ep_size);
                         });

// The reference under the table equals the dense reference (every replica
// holds its logical expert's weights).
TEST(ReferenceEpForwardTable, MatchesDenseReference) {
  const int64_t h = 8;
  const int64_t inter = 12;
  const int k = 2;
  auto table = FourRankTable();
  auto all = ExpertSet::GenerateSwiGlu(5, 0, 0, 8, h, inter).value();
  std::vector<ExpertSet> sets;
  sets.reserve(4);
  for (int r = 0; r < 4; ++r) {
    sets.push_back(MakeHostExperts(ExpertSource::Seeded(5, 0, 8, 0, 0, h, inter)
                                       .WithExperts(DistinctSlotExperts(*table, r)))
                       .value());
  }
  std::vector<StepInput> inputs;
  inputs.reserve(4);
  std::vector<EpRankInput> ref_inputs;
  ref_inputs.reserve(4);
  for (int r = 0; r < 4; ++r) inputs.push_back(RandomInput(40 + r, 4, h, k, 8));
  for (int r = 0; r < 4; ++r) {
    ref_inputs.push_back(
        EpRankInput{inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].tokens});
  }
  auto ref = ReferenceEpForward(*table, {&sets[0], &sets[1], &sets[2], &sets[3]}, ref_inputs, k);
  ASSERT_TRUE(ref.ok()) << ref.status();
  for (int r = 0; r < 4; ++r) {
    std::vector<float> dense(4 * h);
    ASSERT_TRUE(DenseMoeReference({&all}, 8, inputs[r].hidden, inputs[r].ids, inputs[r].weights, 4,
                                  k, absl::MakeSpan(dense))
                    .ok());
    for (int64_t i = 0; i < 4 * h; ++i) {
      EXPECT_NEAR(Bf16ToFloat(ref->output[r][i]), dense[i], 0.02 * std::abs(dense[i]) + 1e-3)
          << "rank " << r << " elem " << i;
    }
  }
}

}  // namespace
}  // namespace ep_dispatcher_placement_test
}  // namespace moe_ep::core
