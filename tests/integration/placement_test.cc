// Placement tables and load statistics end to end (DESIGN §15; issue 17
// items 1-2): real Gloo workers on loopback. InstallPlacement installs a
// non-contiguous table with replicas; LoadExperts loads each rank's slots;
// Forward equals the CPU reference under the same table, bit for bit, and
// repeats bit for bit; GetExpertLoad returns the tokens per logical expert
// (read and reset); a bad or different table on one rank fails every rank
// and leaves the group usable.

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "client/grpc_status.h"
#include "client/placement_request.h"
#include "core/expert_source.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

constexpr int64_t kPlacementCapacity = 32;
constexpr uint64_t kPlacementSeed = 7;

core::PlacementTable Table(int num_experts, std::vector<std::vector<int>> slots) {
  return core::PlacementTable::FromSlotExperts(num_experts, std::move(slots)).value();
}

// 10 experts (SmallModel) with one redundant slot a rank.
core::PlacementTable TableFor(int world) {
  if (world == 2) return Table(10, {{9, 0, 1, 2, 3, 4}, {5, 6, 7, 8, 9, 4}});
  return Table(10, {{0, 1, 2, 9}, {3, 4, 5, 9}, {6, 7, 8, 9}, {9, 0, 4, 8}});
}

class PlacementTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    auto fake = FakeCoordinator::Start(GetParam());
    ASSERT_TRUE(fake.ok()) << fake.status();
    fake_ = std::move(*fake);
    client::Coordinator& c = fake_->coordinator();
    ASSERT_TRUE(c.FormGroup().ok());
    ASSERT_TRUE(c.ConfigureLayers(MakeConfigureRequest(GetParam(), model_)).ok());
    v1::AllocateWorkspaceRequest allocate = MakeAllocateRequest(model_, kPlacementCapacity);
    allocate.set_redundant_slots_per_rank(1);
    auto allocated = c.AllocateWorkspace(allocate);
    ASSERT_TRUE(allocated.ok()) << allocated.status();
    // ceil(10 / world) + 1.
    EXPECT_EQ((*allocated)[0].max_slots_per_rank(), (10 + GetParam() - 1) / GetParam() + 1);
  }

  absl::Status LoadExperts() {
    v1::LoadExpertsRequest load;
    load.set_layer(0);
    load.set_kind(v1::EXPERT_KIND_SWIGLU);
    load.set_seed(kPlacementSeed);
    load.set_intermediate_size(model_.intermediate);
    return fake_->coordinator().LoadExperts(load).status();
  }

  // One Forward of layer 0 at `epoch` with every rank's `inputs`.
  absl::StatusOr<std::vector<v1::ForwardResponse>> Step(int64_t epoch,
                                                        const std::vector<RankInputs>& inputs) {
    std::vector<int64_t> tokens;
    tokens.reserve(inputs.size());
    for (const RankInputs& in : inputs) tokens.push_back(in.num_tokens);
    client::Coordinator& c = fake_->coordinator();
    auto sync = c.SyncTokenCounts(epoch, tokens);
    if (!sync.ok()) return sync.status();
    absl::Status committed = c.CommitGeometry(epoch, sync->runtime_max_tokens_per_rank, tokens);
    if (!committed.ok()) return committed;
    std::vector<v1::ForwardRequest> requests;
    requests.reserve(inputs.size());
    for (const RankInputs& in : inputs)
      requests.push_back(MakeForwardRequest(0, epoch, in, model_));
    return c.Forward(requests);
  }

  std::vector<RankInputs> Inputs() const {
    std::vector<RankInputs> inputs;
    inputs.reserve(GetParam());
    for (int r = 0; r < GetParam(); ++r) inputs.push_back(MakeInputs(50 + r, 3 + 2 * r, model_));
    return inputs;
  }

  SmallModel model_;
  std::unique_ptr<FakeCoordinator> fake_;
};

TEST_P(PlacementTest, ForwardEqualsTheReferenceUnderTheTableAndRepeats) {
  const int world = GetParam();
  const core::PlacementTable table = TableFor(world);
  auto installed =
      fake_->coordinator().InstallPlacement(client::MakeInstallPlacementRequest(0, table));
  ASSERT_TRUE(installed.ok()) << installed.status();
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ((*installed)[r].fingerprint(), table.Fingerprint());
    EXPECT_EQ((*installed)[r].num_slots(), table.num_slots());
    // SetUp loaded nothing yet, so nothing was dropped.
    EXPECT_FALSE((*installed)[r].experts_dropped());
  }
  ASSERT_TRUE(LoadExperts().ok());

  // The reference: each rank's distinct slot experts, seeded as the workers
  // seed them.
  const std::vector<RankInputs> inputs = Inputs();
  std::vector<core::ExpertSet> sets;
  sets.reserve(world);
  for (int r = 0; r < world; ++r) {
    sets.push_back(
        core::MakeHostExperts(core::ExpertSource::Seeded(kPlacementSeed, 0, model_.num_experts, 0,
                                                         0, model_.hidden, model_.intermediate)
                                  .WithExperts(core::DistinctSlotExperts(table, r)))
            .value());
  }
  std::vector<const core::ExpertSet*> set_ptrs;
  std::vector<core::EpRankInput> ref_inputs;
  for (int r = 0; r < world; ++r) {
    set_ptrs.push_back(&sets[r]);
    ref_inputs.push_back(
        {inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].num_tokens});
  }
  auto ref = core::ReferenceEpForward(table, set_ptrs, ref_inputs, model_.top_k);
  ASSERT_TRUE(ref.ok()) << ref.status();

  auto first = Step(1, inputs);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = Step(2, inputs);
  ASSERT_TRUE(second.ok()) << second.status();
  for (int r = 0; r < world; ++r) {
    const std::vector<float> got = DecodeBf16((*first)[r].output());
    ASSERT_EQ(got.size(), ref->output[r].size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i], core::Bf16ToFloat(ref->output[r][i])) << "rank " << r << " elem " << i;
    }
    EXPECT_EQ((*first)[r].output().data(), (*second)[r].output().data()) << "rank " << r;
  }

  // Load statistics: two steps of the same inputs, so every logical expert
  // has twice its occurrences in all ranks' ids.
  std::vector<int64_t> expected(model_.num_experts, 0);
  for (const RankInputs& in : inputs) {
    for (int32_t id : in.ids) {
      if (id >= 0 && id < model_.num_experts) expected[id] += 2;
    }
  }
  v1::GetExpertLoadRequest read;
  read.set_layer(0);
  read.set_reset(true);
  auto load = fake_->coordinator().GetExpertLoad(read);
  ASSERT_TRUE(load.ok()) << load.status();
  std::vector<int64_t> summed(model_.num_experts, 0);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ((*load)[r].steps(), 2);
    EXPECT_EQ((*load)[r].placement_fingerprint(), table.Fingerprint());
    ASSERT_EQ((*load)[r].tokens_per_expert_size(), model_.num_experts);
    for (int e = 0; e < model_.num_experts; ++e) summed[e] += (*load)[r].tokens_per_expert(e);
  }
  EXPECT_EQ(summed, expected);
  // Reset: the window is empty, the /metrics totals are not.
  read.set_reset(false);
  auto after = fake_->coordinator().GetExpertLoad(read);
  ASSERT_TRUE(after.ok()) << after.status();
  std::vector<int64_t> totals(model_.num_experts, 0);
  for (int r = 0; r < world; ++r) {
    EXPECT_EQ((*after)[r].steps(), 0);
    for (int e = 0; e < model_.num_experts; ++e) EXPECT_EQ((*after)[r].tokens_per_expert(e), 0);
    const v1::GetStatusResponse status = fake_->StatusOf(r);
    ASSERT_EQ(status.expert_tokens_size(), 1);
    EXPECT_EQ(status.expert_tokens(0).layer(), 0);
    for (int e = 0; e < model_.num_experts; ++e) {
      totals[e] += status.expert_tokens(0).tokens_per_expert(e);
    }
  }
  EXPECT_EQ(totals, expected);
}

TEST_P(PlacementTest, ReinstallingChangedSlotsDropsTheLayersExperts) {
  ASSERT_TRUE(LoadExperts().ok());
  auto installed = fake_->coordinator().InstallPlacement(
      client::MakeInstallPlacementRequest(0, TableFor(GetParam())));
  ASSERT_TRUE(installed.ok()) << installed.status();
  // Rank 0's experts change under either table.
  EXPECT_TRUE((*installed)[0].experts_dropped());
  auto forward = Step(1, Inputs());
  EXPECT_EQ(forward.status().code(), absl::StatusCode::kFailedPrecondition) << forward.status();
  EXPECT_THAT(std::string(forward.status().message()), HasSubstr("call LoadExperts first"));
  ASSERT_TRUE(LoadExperts().ok());
  EXPECT_TRUE(Step(2, Inputs()).ok());
}

TEST_P(PlacementTest, TablesBeyondTheSlotBudgetAreRejected) {
  // Two redundant slots a rank: one more than AllocateWorkspace allowed.
  const int world = GetParam();
  std::vector<std::vector<int>> slots(world);
  const int per_rank = (10 + world - 1) / world + 2;
  for (int r = 0; r < world; ++r) {
    for (int s = 0; s < per_rank; ++s) slots[r].push_back((r * per_rank + s) % 10);
  }
  auto installed = fake_->coordinator().InstallPlacement(
      client::MakeInstallPlacementRequest(0, Table(10, slots)));
  EXPECT_EQ(installed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(installed.status().message()),
              HasSubstr(absl::StrCat("slots, the workspace's budget is ", per_rank - 1)));
}

INSTANTIATE_TEST_SUITE_P(Worlds, PlacementTest, ::testing::Values(2, 4),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "world" + std::to_string(info.param);
                         });

// --- one bad rank of 3 -----------------------------------------------------

class PlacementIsolation : public ::testing::Test {
 protected:
  static constexpr int kWorld = 3;
  void SetUp() override {
    auto fake = FakeCoordinator::Start(kWorld);
    ASSERT_TRUE(fake.ok()) << fake.status();
    fake_ = std::move(*fake);
    ASSERT_TRUE(fake_->SetUp(model_, kPlacementCapacity, v1::EXPERT_KIND_IDENTITY).ok());
  }

  std::vector<absl::Status> InstallOnEachRank(
      const std::function<v1::InstallPlacementRequest(int)>& make) {
    return fake_->OnEachRank([&](int rank) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
      v1::InstallPlacementResponse response;
      return client::ToAbslStatus(
          fake_->stub(rank).InstallPlacement(&context, make(rank), &response));
    });
  }

  SmallModel model_;
  std::unique_ptr<FakeCoordinator> fake_;
};

TEST_F(PlacementIsolation, AnInvalidTableOnOneRankIsNamedByEveryPeer) {
  // No redundancy (S = E = 10 on 3 ranks: 4, 3, 3 slots), a permuted table.
  const core::PlacementTable good = Table(10, {{9, 8, 7, 6}, {5, 4, 3}, {2, 1, 0}});
  const std::vector<absl::Status> out = InstallOnEachRank([&](int rank) {
    v1::InstallPlacementRequest request = client::MakeInstallPlacementRequest(0, good);
    if (rank == 1) request.mutable_ranks(2)->set_slot_experts(0, 12);
    return request;
  });
  EXPECT_EQ(out[1].code(), absl::StatusCode::kInvalidArgument) << out[1];
  EXPECT_THAT(std::string(out[1].message()), HasSubstr("rank 2 slot 0 holds expert 12"));
  for (int r : {0, 2}) {
    EXPECT_EQ(out[r].code(), absl::StatusCode::kAborted) << out[r];
    EXPECT_THAT(std::string(out[r].message()),
                HasSubstr("rank 1 rejected its InstallPlacement request: INVALID_ARGUMENT"));
  }
  // Nothing was installed anywhere and the group is usable.
  for (int r = 0; r < kWorld; ++r) EXPECT_FALSE(fake_->StatusOf(r).group_broken());
  const std::vector<absl::Status> again =
      InstallOnEachRank([&](int) { return client::MakeInstallPlacementRequest(0, good); });
  for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(again[r].ok()) << again[r];
}

TEST_F(PlacementIsolation, ADifferentTableOnOneRankAbortsEveryRank) {
  const core::PlacementTable good = Table(10, {{9, 8, 7, 6}, {5, 4, 3}, {2, 1, 0}});
  const core::PlacementTable other = Table(10, {{0, 1, 2, 3}, {4, 5, 6}, {7, 8, 9}});
  const std::vector<absl::Status> out = InstallOnEachRank(
      [&](int rank) { return client::MakeInstallPlacementRequest(0, rank == 2 ? other : good); });
  for (int r = 0; r < kWorld; ++r) {
    EXPECT_EQ(out[r].code(), absl::StatusCode::kAborted) << out[r];
    EXPECT_THAT(std::string(out[r].message()),
                HasSubstr("placement_fingerprint differs across ranks"));
  }
  for (int r = 0; r < kWorld; ++r) EXPECT_FALSE(fake_->StatusOf(r).group_broken());
}

}  // namespace
}  // namespace moe_ep::testing
