#pragma once

// The rank-mask fixture of the integration tests (DESIGN §15; issue 17 item
// 3): 4 real Gloo workers on loopback with 2 redundant slots a rank, a
// placement table, seeded SwiGLU experts on layer 0, raw per-rank step calls
// (SyncTokenCounts, CommitGeometry, Forward) and the CPU reference under a
// mask (core::PlacementTable::WithMask). Used by rank_mask_test.cc (the
// workers mask on their own; a client re-admits) and coordinator_mask_test.cc
// (the coordinator service keeps the group masked and re-adds). The free
// helpers above the fixture (set-up, step, reference, lost experts, a kill
// during a step) also serve the one-sided plane's mask tests
// (onesided_service_test.cc), whose group is made differently.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <csignal>
#include <iostream>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "client/coordinator.h"
#include "client/grpc_status.h"
#include "client/local_cluster.h"
#include "client/placement_request.h"
#include "core/expert_source.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tensor_codec.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {

constexpr int kWorld = 4;
constexpr int64_t kCapacity = 32;
constexpr uint64_t kSeed = 11;
constexpr int kSteps = 8;
constexpr int kKillAtStep = 3;

// 10 experts on 4 ranks x 5 slots (ceil(10 / 4) + 2 redundant): expert 0
// lives only on rank 0 and expert 9 only on rank 2; every other expert has
// two or three replicas.
inline core::PlacementTable Table() {
  return core::PlacementTable::FromSlotExperts(
             10, {{0, 1, 2, 3, 4}, {5, 6, 7, 8, 1}, {9, 2, 5, 6, 3}, {4, 7, 8, 1, 2}})
      .value();
}

template <typename Fn>
std::vector<absl::Status> OnRanks(const std::vector<int>& ranks, Fn fn) {
  std::vector<absl::Status> out(ranks.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < ranks.size(); ++i) {
    threads.emplace_back([&, i] { out[i] = fn(ranks[i]); });
  }
  for (auto& t : threads) t.join();
  return out;
}

// The experts of rank r's distinct slot experts under `table`, r in [0,
// world): layer 0's seeded SwiGLU experts of `seed` (what the CPU reference
// computes with).
inline std::vector<core::ExpertSet> SlotExpertSets(const core::PlacementTable& table,
                                                   const SmallModel& model, uint64_t seed,
                                                   int world) {
  std::vector<core::ExpertSet> sets;
  for (int r = 0; r < world; ++r) {
    sets.push_back(
        core::MakeHostExperts(core::ExpertSource::Seeded(seed, 0, model.num_experts, 0, 0,
                                                         model.hidden, model.intermediate)
                                  .WithExperts(core::DistinctSlotExperts(table, r)))
            .value());
  }
  return sets;
}

// The set-up of a formed `world`-rank group through `c`: configured,
// allocated for `capacity` tokens with 2 redundant slots a rank, `table`
// installed on layer 0, layer 0's seeded SwiGLU experts of `seed` loaded.
// The requests go to *setup (for a rank that comes back: RejoinRank).
// Returns the first call's error.
inline absl::Status SetUpMaskGroup(client::Coordinator& c, int world, const SmallModel& model,
                                   int64_t capacity, const core::PlacementTable& table,
                                   uint64_t seed, client::RankSetup* setup) {
  setup->configure = MakeConfigureRequest(world, model);
  RETURN_IF_ERROR(c.ConfigureLayers(setup->configure).status());
  setup->allocate = MakeAllocateRequest(model, capacity);
  setup->allocate.set_redundant_slots_per_rank(2);
  RETURN_IF_ERROR(c.AllocateWorkspace(setup->allocate).status());
  setup->placements.push_back(client::MakeInstallPlacementRequest(0, table));
  RETURN_IF_ERROR(c.InstallPlacement(setup->placements[0]).status());
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_SWIGLU);
  load.set_seed(seed);
  load.set_intermediate_size(model.intermediate);
  setup->loads.push_back(load);
  return c.LoadExperts(load).status();
}

// One step of layer 0 (epoch step + 1) on `ranks` of a `world`-rank group:
// SyncTokenCounts, CommitGeometry, Forward through `stub(r)`, each call with
// `timeout`, rank r's tokens `inputs(r)`; a phase that any rank failed ends
// the step. Fills `out` [world] by rank; returns each rank's status by its
// position in `ranks`.
template <typename StubOf, typename InputsOf>
std::vector<absl::Status> StepOnRanks(int step, const std::vector<int>& ranks, int world,
                                      const SmallModel& model, std::chrono::seconds timeout,
                                      StubOf stub, InputsOf inputs,
                                      std::vector<v1::ForwardResponse>* out) {
  const int64_t epoch = step + 1;
  std::vector<v1::SyncTokenCountsResponse> sync(world);
  std::vector<absl::Status> status = OnRanks(ranks, [&](int r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::SyncTokenCountsRequest request;
    request.set_epoch(epoch);
    request.set_local_tokens(inputs(r).num_tokens);
    return client::ToAbslStatus(stub(r).SyncTokenCounts(&context, request, &sync[r]));
  });
  for (const absl::Status& s : status) {
    if (!s.ok()) return status;
  }
  status = OnRanks(ranks, [&](int r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::CommitGeometryRequest request;
    request.set_epoch(epoch);
    request.set_runtime_max_tokens_per_rank(sync[r].runtime_max_tokens_per_rank());
    request.set_local_tokens(inputs(r).num_tokens);
    v1::CommitGeometryResponse response;
    return client::ToAbslStatus(stub(r).CommitGeometry(&context, request, &response));
  });
  for (const absl::Status& s : status) {
    if (!s.ok()) return status;
  }
  out->assign(world, v1::ForwardResponse());
  return OnRanks(ranks, [&](int r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    return client::ToAbslStatus(
        stub(r).Forward(&context, MakeForwardRequest(0, epoch, inputs(r), model), &(*out)[r]));
  });
}

// The CPU reference (core::ReferenceEpForward) of one step under `table`
// masked by `live` [world]: rank r's tokens `inputs(r)` when live (a masked
// rank has none), its experts sets[r].
template <typename InputsOf>
absl::StatusOr<core::EpReferenceResult> MaskedReference(const core::PlacementTable& table,
                                                        const std::vector<bool>& live,
                                                        const std::vector<core::ExpertSet>& sets,
                                                        int top_k, InputsOf inputs_of) {
  const int world = static_cast<int>(live.size());
  ASSIGN_OR_RETURN(const core::PlacementTable masked, table.WithMask(live));
  std::vector<RankInputs> inputs;
  std::vector<core::EpRankInput> ref_inputs;
  std::vector<const core::ExpertSet*> set_ptrs;
  inputs.reserve(world);
  ref_inputs.reserve(world);
  set_ptrs.reserve(world);
  for (int r = 0; r < world; ++r) {
    inputs.push_back(live[r] ? inputs_of(r) : RankInputs{});
    set_ptrs.push_back(&sets[r]);
  }
  for (int r = 0; r < world; ++r) {
    ref_inputs.push_back(
        {inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].num_tokens});
  }
  return core::ReferenceEpForward(masked, set_ptrs, ref_inputs, top_k);
}

// That `got` reports what rank's choices `ids` lost under `masked`: the
// experts (ascending ids) of the valid choices that have no live replica,
// and how many such choices. `what` names the step and rank.
inline void ExpectLostExperts(const core::PlacementTable& masked, const std::vector<int32_t>& ids,
                              int num_experts, const v1::ForwardResponse& got,
                              const std::string& what) {
  std::set<int> lost;
  int64_t choices = 0;
  for (int32_t id : ids) {
    if (id >= 0 && id < num_experts && masked.LiveReplicas(id).empty()) {
      lost.insert(id);
      ++choices;
    }
  }
  EXPECT_EQ(std::vector<int>(got.lost_experts().begin(), got.lost_experts().end()),
            std::vector<int>(lost.begin(), lost.end()))
      << what;
  EXPECT_EQ(got.lost_choices(), choices) << what;
}

// KillDuringStep()
//
// Kills `victims` with SIGKILL (through `cluster`) 2 ms into
// `step_on(all)`, then runs `step_on(survivors)` until every survivor
// answers. `step_on(ranks)` runs the step on `ranks` and returns their
// statuses. *attempts counts the step attempts, the one killed included;
// *killed is when the kill started. After `max_attempts` attempts
// (several mask rounds may each ask for the step again) it adds a failure
// and returns false.
template <typename StepOn>
bool KillDuringStep(client::LocalCluster& cluster, const std::vector<int>& victims,
                    const std::vector<int>& all, const std::vector<int>& survivors,
                    int max_attempts, StepOn step_on, absl::Time* killed, int* attempts) {
  std::thread killer([&] {
    absl::SleepFor(absl::Milliseconds(2));
    for (int victim : victims) EXPECT_TRUE(cluster.Kill(victim, SIGKILL).ok());
  });
  *killed = absl::Now();
  (void)step_on(all);
  killer.join();
  *attempts = 1;
  while (true) {
    const std::vector<absl::Status> status = step_on(survivors);
    ++*attempts;
    if (std::all_of(status.begin(), status.end(), [](const absl::Status& s) { return s.ok(); })) {
      return true;
    }
    if (*attempts >= max_attempts) {
      ADD_FAILURE() << "survivors did not mask ranks " << ::testing::PrintToString(victims) << ": "
                    << status[0];
      return false;
    }
  }
}

class RankMaskTest : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    StartWorkers();
    if (HasFatalFailure()) return;
    FormAndSetUp();
  }

  // Four workers on loopback (no group yet), of backend_ with worker_args_.
  void StartWorkers() {
    auto fake = FakeCoordinator::Start(kWorld, worker_args_, /*rank_masks=*/true, backend_);
    ASSERT_TRUE(fake.ok()) << fake.status();
    fake_ = std::move(*fake);
  }

  // The expert weights of every rank's slots under table_ (the reference's).
  void MakeExpertSets() { sets_ = SlotExpertSets(table_, model_, kSeed, kWorld); }

  // The group through the fake's Coordinator: formed, configured,
  // allocated with 2 redundant slots a rank, table_ installed, layer 0's
  // seeded experts loaded.
  void FormAndSetUp() {
    client::Coordinator& c = fake_->coordinator();
    ASSERT_TRUE(c.FormGroup().ok());
    const absl::Status set_up =
        SetUpMaskGroup(c, kWorld, model_, kCapacity, table_, kSeed, &setup_);
    ASSERT_TRUE(set_up.ok()) << set_up;
    MakeExpertSets();
  }

  RankInputs InputsOf(int step, int rank) const {
    return MakeInputs(1000 * step + rank, 4 + (rank + step) % 3, model_);
  }

  // One step on `ranks`: SyncTokenCounts, CommitGeometry, Forward. Fills
  // `out` (indexed by rank) and returns each rank's status.
  std::vector<absl::Status> Step(int step, const std::vector<int>& ranks,
                                 std::vector<v1::ForwardResponse>* out) {
    return StepOnRanks(
        step, ranks, kWorld, model_, std::chrono::seconds(30),
        [&](int r) -> v1::Worker::Stub& { return fake_->stub(r); },
        [&](int r) { return InputsOf(step, r); }, out);
  }

  // The reference of `step` under `live`: masked ranks have no tokens.
  core::EpReferenceResult Reference(int step, const std::vector<bool>& live) {
    auto ref = MaskedReference(table_, live, sets_, model_.top_k,
                               [&](int r) { return InputsOf(step, r); });
    EXPECT_TRUE(ref.ok()) << ref.status();
    return *std::move(ref);
  }

  void ExpectEqualsReference(int step, const std::vector<int>& ranks, const std::vector<bool>& live,
                             const std::vector<v1::ForwardResponse>& got) {
    const core::EpReferenceResult ref = Reference(step, live);
    const core::PlacementTable masked = table_.WithMask(live).value();
    for (int r : ranks) {
      const std::vector<float> out = DecodeBf16(got[r].output());
      ASSERT_EQ(out.size(), ref.output[r].size()) << "step " << step << " rank " << r;
      for (size_t row = 0; row * model_.hidden < out.size(); ++row) {
        // bf16_ulps_ > 0 (a GPU plane): its own bf16 roundings of the
        // partial sums, within that many bf16 steps of the row's magnitude.
        float scale = 0;
        for (int64_t h = 0; h < model_.hidden; ++h) {
          scale =
              std::max(scale, std::abs(core::Bf16ToFloat(ref.output[r][row * model_.hidden + h])));
        }
        const float tolerance = bf16_ulps_ * 0.0078125f * scale;
        for (int64_t h = 0; h < model_.hidden; ++h) {
          const size_t i = row * model_.hidden + h;
          const float want = core::Bf16ToFloat(ref.output[r][i]);
          if (bf16_ulps_ == 0) {
            ASSERT_EQ(out[i], want) << "step " << step << " rank " << r << " elem " << i;
          } else {
            ASSERT_NEAR(out[i], want, tolerance + 1e-6f)
                << "step " << step << " rank " << r << " elem " << i;
          }
        }
      }
      // The lost experts this rank's tokens chose, by id.
      ExpectLostExperts(masked, InputsOf(step, r).ids, model_.num_experts, got[r],
                        "step " + std::to_string(step) + " rank " + std::to_string(r));
    }
  }

  // Kills `victims` while step kKillAtStep runs on every rank and sends the
  // step again to the survivors until all of them answer; checks that step
  // against the masked reference. Returns the time from the kill.
  absl::Duration KillDuringStepAndMask(const std::vector<int>& victims,
                                       const std::vector<int>& survivors, int* attempts) {
    std::vector<v1::ForwardResponse> got;
    absl::Time killed;
    // Two victims dying a few ms apart can take a mask round each, and
    // every round asks for the step again: allow several rounds.
    if (!KillDuringStep(
            fake_->cluster(), victims, {0, 1, 2, 3}, survivors, /*max_attempts=*/20,
            [&](const std::vector<int>& ranks) { return Step(kKillAtStep, ranks, &got); }, &killed,
            attempts)) {
      return absl::InfiniteDuration();
    }
    std::vector<v1::ForwardResponse> by_rank(kWorld);
    for (size_t i = 0; i < survivors.size(); ++i) by_rank[survivors[i]] = got[survivors[i]];
    std::vector<bool> live(kWorld, true);
    for (int victim : victims) live[victim] = false;
    ExpectEqualsReference(kKillAtStep, survivors, live, by_rank);
    return absl::Now() - killed;
  }

  SmallModel model_;
  std::string backend_ = "gloo";
  std::vector<std::string> worker_args_;
  // 0: outputs equal the reference bit for bit (Gloo: the same fp32 sums);
  // else within this many bf16 steps of each row's magnitude.
  float bf16_ulps_ = 0;
  client::RankSetup setup_;
  core::PlacementTable table_ = Table();
  std::vector<core::ExpertSet> sets_;
  std::unique_ptr<FakeCoordinator> fake_;
};

}  // namespace moe_ep::testing
