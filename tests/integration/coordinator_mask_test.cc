// The coordinator service keeps a masked group up (DESIGN §15, §16; issue
// 17 item 3: "with replicas installed, the coordinator masks and re-adds
// instead of re-forming"). A GroupKeeper (the reconciler of `moe-ep
// coordinator`) forms 4 real Gloo workers on loopback from a desired state
// with 2 redundant slots a rank and a placement; the test runs steps on the
// workers (SyncTokenCounts, CommitGeometry, Forward), kills a rank with
// SIGKILL during one, and checks that the keeper reports the survivors' mask
// without a new generation, that the masked steps equal the reference under
// the same mask, and that after the worker is restarted on its address the
// keeper re-adds it (Join alone, the group's set-up, Rejoin) and the steps
// equal the unmasked reference bit for bit. Rank 0 (whose store formed the
// group) and rank 2 are killed in turn, ranks 0 and 1 together, and with a
// placement that leaves an expert on one rank only the keeper re-forms
// instead (RANK_LOSS_MASK_COVERED). The same
// kill, mask and re-add runs on 4 GPU workers sharing one device through the
// one-sided plane (backend "nccl"; skips without a GPU; run on the GPU
// machine with bench/results/masks-coordinator-gpu/gpu-run.sh). The times measured are printed
// (bench/results/masks/README.md); the test asserts values, not times.

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "client/group_keeper.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/coordinator.pb.h"
#include "server/device_info.h"
#include "tests/integration/rank_mask_fixture.h"

namespace moe_ep::testing {
namespace {

using ::testing::ElementsAre;

// 10 experts on 4 ranks x 5 slots, every expert on exactly two ranks, and no
// two ranks hold both replicas of one expert among ranks {0, 1}: any one
// rank, or ranks 0 and 1 together, can be lost with every expert served.
core::PlacementTable CoveredTable() {
  return core::PlacementTable::FromSlotExperts(
             10, {{0, 1, 2, 3, 4}, {5, 6, 7, 8, 9}, {2, 3, 4, 5, 6}, {0, 1, 7, 8, 9}})
      .value();
}

// SmallModel (tests/integration/fake_coordinator.h) as a config.json.
std::string WriteSmallModel(const SmallModel& m) {
  std::string path = (std::filesystem::temp_directory_path() /
                      ("coordinator-mask-" + std::to_string(getpid()) + ".json"))
                         .string();
  std::ofstream(path) << "{\"model_type\": \"qwen3_moe\", \"hidden_size\": " << m.hidden
                      << ", \"num_hidden_layers\": " << m.num_layers
                      << ", \"num_experts\": " << m.num_experts
                      << ", \"num_experts_per_tok\": " << m.top_k
                      << ", \"moe_intermediate_size\": " << m.intermediate
                      << ", \"intermediate_size\": " << 4 * m.intermediate << "}";
  return path;
}

int CountEvents(const v1::GetGroupResponse& g, const std::string& kind) {
  return static_cast<int>(std::count_if(g.history().begin(), g.history().end(),
                                        [&](const v1::GroupEvent& e) { return e.kind() == kind; }));
}

class CoordinatorMaskTest : public RankMaskTest {
 protected:
  void SetUp() override {
    table_ = CoveredTable();
    StartWorkers();
    if (HasFatalFailure()) return;
    MakeExpertSets();
    model_path_ = WriteSmallModel(model_);
  }

  void TearDown() override {
    keeper_.reset();  // before the workers go
    if (!model_path_.empty()) std::filesystem::remove(model_path_);
  }

  // The desired state: the workers, the small model's layer 0 with seeded
  // SwiGLU experts (the fixture's seed), table_ on 2 redundant slots a rank.
  v1::DesiredState State() const {
    v1::DesiredState state;
    for (const std::string& t : fake_->cluster().targets()) state.add_targets(t);
    state.set_backend(backend_);
    state.set_model(model_path_);
    state.set_layers(1);
    state.set_capacity_tokens(kCapacity);
    state.mutable_experts()->set_kind(v1::EXPERT_KIND_SWIGLU);
    state.mutable_experts()->set_seed(kSeed);
    state.set_group_timeout_ms(group_timeout_ms_);
    state.set_rpc_timeout_ms(60000);
    state.set_redundant_slots_per_rank(2);
    for (int r = 0; r < kWorld; ++r) {
      const std::vector<int>& slots = table_.SlotExperts(r);
      state.add_placement()->mutable_slot_experts()->Assign(slots.begin(), slots.end());
    }
    return state;
  }

  void StartKeeper(v1::RankLossPolicy policy) {
    client::GroupKeeperOptions options;
    options.probe_interval = absl::Milliseconds(100);
    options.probe_timeout = absl::Seconds(1);
    options.backoff_initial = absl::Milliseconds(100);
    options.backoff_max = absl::Seconds(1);
    options.settle_timeout = absl::Seconds(10);
    options.rank_loss = policy;
    auto keeper = client::GroupKeeper::Start(options, State());
    ASSERT_TRUE(keeper.ok()) << keeper.status();
    keeper_ = std::move(*keeper);
  }

  // Polls the keeper's GetGroup every 10 ms until `done` holds or `timeout`.
  bool WaitFor(const std::function<bool(const v1::GetGroupResponse&)>& done, absl::Duration timeout,
               v1::GetGroupResponse* last) {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      *last = keeper_->Snapshot();
      if (done(*last)) return true;
      if (absl::Now() > deadline) return false;
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  static std::string Describe(const v1::GetGroupResponse& g) {
    std::string out = "phase " + v1::GroupPhase_Name(g.phase()) + ", generation " +
                      std::to_string(g.generation()) + ", last error: " + g.last_error() +
                      "; history:";
    for (const v1::GroupEvent& e : g.history()) {
      out += "\n  " + e.kind() + " rank " + std::to_string(e.rank()) + ": " + e.message();
    }
    return out;
  }

  // Steps [first, last) on every rank, each equal to the unmasked reference
  // with no lost expert reported.
  void FullSteps(int first, int last) {
    const std::vector<int> all = {0, 1, 2, 3};
    const std::vector<bool> everyone(kWorld, true);
    std::vector<v1::ForwardResponse> got;
    for (int step = first; step < last; ++step) {
      const std::vector<absl::Status> status = Step(step, all, &got);
      for (int r = 0; r < kWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
      ExpectEqualsReference(step, all, everyone, got);
      for (int r = 0; r < kWorld; ++r) EXPECT_TRUE(got[r].lost_experts().empty()) << "rank " << r;
    }
  }

  // Kills `victims` during a step, checks the keeper keeps generation and
  // reports the mask, one more masked step, restarts the victims and checks
  // the keeper re-adds them without a new generation; then full steps.
  void KillMaskRestartReadd(const std::vector<int>& victims) {
    std::vector<int> survivors;
    std::vector<bool> live(kWorld, true);
    for (int r = 0; r < kWorld; ++r) {
      if (std::find(victims.begin(), victims.end(), r) == victims.end()) {
        survivors.push_back(r);
      } else {
        live[r] = false;
      }
    }
    StartKeeper(v1::RANK_LOSS_MASK_COVERED);
    if (HasFatalFailure()) return;
    v1::GetGroupResponse g;
    ASSERT_TRUE(WaitFor([](const auto& x) { return x.phase() == v1::GROUP_PHASE_READY; },
                        absl::Seconds(60), &g))
        << Describe(g);
    const int64_t generation = g.generation();
    ASSERT_GT(generation, 0);
    EXPECT_EQ(g.rank_loss_policy(), v1::RANK_LOSS_MASK_COVERED);
    FullSteps(0, kKillAtStep);
    if (HasFatalFailure()) return;

    const absl::Time killed = absl::Now();
    int attempts = 0;
    const absl::Duration to_mask = KillDuringStepAndMask(victims, survivors, &attempts);
    ASSERT_NE(to_mask, absl::InfiniteDuration());
    // The keeper reports the survivors' mask and keeps the generation.
    ASSERT_TRUE(WaitFor(
        [&](const auto& x) {
          return x.phase() == v1::GROUP_PHASE_MASKED &&
                 std::vector<int>(x.masked_ranks().begin(), x.masked_ranks().end()) == victims;
        },
        absl::Seconds(30), &g))
        << Describe(g);
    const absl::Duration to_reported = absl::Now() - killed;
    EXPECT_EQ(g.generation(), generation) << Describe(g);
    EXPECT_EQ(g.formations(), 1) << Describe(g);
    EXPECT_TRUE(g.lost_experts().empty()) << Describe(g);
    EXPECT_GE(g.mask_round(), 1);
    for (int v : victims) EXPECT_EQ(g.ranks(v).state(), v1::RANK_STATE_MASKED) << Describe(g);
    for (int r : survivors) EXPECT_EQ(g.ranks(r).state(), v1::RANK_STATE_READY) << Describe(g);
    EXPECT_GE(CountEvents(g, "masked"), 1) << Describe(g);
    EXPECT_EQ(CountEvents(g, "group_broken"), 0) << Describe(g);

    // The masked group keeps serving under the coordinator.
    std::vector<v1::ForwardResponse> got;
    std::vector<absl::Status> status = Step(kKillAtStep + 1, survivors, &got);
    for (size_t i = 0; i < survivors.size(); ++i) {
      ASSERT_TRUE(status[i].ok()) << "rank " << survivors[i] << ": " << status[i];
    }
    std::vector<v1::ForwardResponse> by_rank(kWorld);
    for (int r : survivors) by_rank[r] = got[r];
    ExpectEqualsReference(kKillAtStep + 1, survivors, live, by_rank);

    // The restart: the keeper re-adds the ranks at this step boundary.
    const absl::Time restarted = absl::Now();
    for (int v : victims) ASSERT_TRUE(fake_->RestartWorker(v).ok());
    ASSERT_TRUE(WaitFor(
        [&](const auto& x) {
          return x.phase() == v1::GROUP_PHASE_READY &&
                 x.readds() == static_cast<int64_t>(victims.size());
        },
        absl::Seconds(60), &g))
        << Describe(g);
    const absl::Duration to_readded = absl::Now() - restarted;
    EXPECT_EQ(g.generation(), generation) << Describe(g);
    EXPECT_EQ(g.formations(), 1) << Describe(g);
    EXPECT_TRUE(g.masked_ranks().empty()) << Describe(g);
    EXPECT_EQ(CountEvents(g, "formed"), 1) << Describe(g);
    EXPECT_GE(CountEvents(g, "readded"), 1) << Describe(g);
    EXPECT_EQ(CountEvents(g, "readd_failed"), 0) << Describe(g);
    for (int r = 0; r < kWorld; ++r) {
      const v1::GetStatusResponse s = fake_->StatusOf(r);
      EXPECT_EQ(s.generation(), generation) << "rank " << r;
      EXPECT_TRUE(s.masked_ranks().empty()) << "rank " << r;
      EXPECT_FALSE(s.group_broken()) << "rank " << r << ": " << s.broken_reason();
    }
    FullSteps(kKillAtStep + 2, kSteps);
    std::cout << "[coordinator-mask] killed ranks " << ::testing::PrintToString(victims)
              << ": first correct masked step " << absl::ToDoubleMilliseconds(to_mask)
              << " ms after the kill (" << attempts << " step attempts), coordinator reports "
              << "the mask " << absl::ToDoubleMilliseconds(to_reported)
              << " ms after it; restart -> re-added and READY "
              << absl::ToDoubleMilliseconds(to_readded) << " ms (re-add itself "
              << g.last_readd_seconds() * 1e3 << " ms), generation " << generation << " kept"
              << std::endl;
  }

  std::string model_path_;
  int64_t group_timeout_ms_ = 5000;
  std::unique_ptr<client::GroupKeeper> keeper_;
};

TEST_P(CoordinatorMaskTest, KeepsTheGroupMaskedAndReaddsTheRestartedRank) {
  KillMaskRestartReadd({GetParam()});
}

INSTANTIATE_TEST_SUITE_P(Victims, CoordinatorMaskTest, ::testing::Values(0, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "kill_rank" + std::to_string(info.param);
                         });

// Ranks 0 and 1 killed in the same step, restarted together: the keeper
// re-adds both (rank 0 included: its store died with it; the survivors'
// rounds are hosted by rank 2's store).
class CoordinatorMaskTwoRanksTest : public CoordinatorMaskTest {};

TEST_F(CoordinatorMaskTwoRanksTest, KeepsTheGroupMaskedAndReaddsBothRanks) {
  KillMaskRestartReadd({0, 1});
}

// RANK_LOSS_MASK_COVERED with a placement that keeps expert 9 on rank 2
// only: losing rank 2 would lose an expert, so the keeper re-forms a new
// generation once the rank is back, as without masks.
class CoordinatorMaskUncoveredTest : public CoordinatorMaskTest {
 protected:
  void SetUp() override {
    CoordinatorMaskTest::SetUp();
    table_ = Table();
    MakeExpertSets();
  }
};

TEST_F(CoordinatorMaskUncoveredTest, ReformsWhenAnExpertLosesItsLastReplica) {
  StartKeeper(v1::RANK_LOSS_MASK_COVERED);
  v1::GetGroupResponse g;
  ASSERT_TRUE(WaitFor([](const auto& x) { return x.phase() == v1::GROUP_PHASE_READY; },
                      absl::Seconds(60), &g))
      << Describe(g);
  const int64_t generation = g.generation();
  FullSteps(0, kKillAtStep);
  int attempts = 0;
  ASSERT_NE(KillDuringStepAndMask({2}, {0, 1, 3}, &attempts), absl::InfiniteDuration());
  // The keeper sees the mask leave expert 9 without a replica: not kept.
  ASSERT_TRUE(WaitFor([](const auto& x) { return CountEvents(x, "group_broken") >= 1; },
                      absl::Seconds(30), &g))
      << Describe(g);
  EXPECT_THAT(g.lost_experts(), ElementsAre(9)) << Describe(g);
  EXPECT_NE(g.phase(), v1::GROUP_PHASE_MASKED) << Describe(g);
  ASSERT_TRUE(fake_->RestartWorker(2).ok());
  ASSERT_TRUE(WaitFor(
      [&](const auto& x) {
        return x.phase() == v1::GROUP_PHASE_READY && x.generation() > generation;
      },
      absl::Seconds(60), &g))
      << Describe(g);
  EXPECT_EQ(g.formations(), 2) << Describe(g);
  EXPECT_EQ(g.readds(), 0) << Describe(g);
  // A fresh generation: every rank serves the full table again.
  FullSteps(kKillAtStep + 1, kSteps);
}

// The keeper on a GPU group (issue 17): 4 worker processes of backend nccl
// sharing CUDA device 0 through the one-sided CUDA IPC plane, the desired
// backend "nccl". A rank killed during a step is masked (phase MASKED, the
// generation kept), the masked steps match the reference under the mask,
// and the restarted rank is re-added. GPU outputs round their partial sums
// in bf16: compared within 4 bf16 steps of each row's magnitude. Skips,
// printing why, without a GPU.
class GpuOneSidedCoordinatorMask : public CoordinatorMaskTest {
 protected:
  void SetUp() override {
    if (server::VisibleGpuCount() < 1) return;  // the test body skips
    backend_ = "nccl";
    worker_args_ = {"--device=0", "--gpu-data-plane=one-sided"};
    bf16_ulps_ = 4;
    group_timeout_ms_ = 10000;
    // CoveredTable as on Gloo: the one-sided plane takes any table (rank 3
    // holds {0,1,7,8,9}, not a range; DESIGN §17, issue 34 item 2).
    CoordinatorMaskTest::SetUp();
  }
};

TEST_P(GpuOneSidedCoordinatorMask, KeepsTheGroupMaskedAndReaddsTheRestartedRank) {
  if (server::VisibleGpuCount() < 1) {
    std::printf("[  SKIPPED ] needs a CUDA device; this %s sees none\n",
                server::BuiltWithCuda() ? "CUDA build" : "build without CUDA");
    GTEST_SKIP() << "needs a CUDA device";
  }
  ASSERT_NE(fake_, nullptr);
  KillMaskRestartReadd({GetParam()});
  for (int r = 0; r < kWorld && !HasFailure(); ++r) {
    EXPECT_EQ(fake_->StatusOf(r).data_plane(), "one-sided") << "rank " << r;
  }
}

INSTANTIATE_TEST_SUITE_P(Victims, GpuOneSidedCoordinatorMask, ::testing::Values(0, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "kill_rank" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace moe_ep::testing
