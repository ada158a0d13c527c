#pragma once

// The rank-mask fixture of the integration tests (DESIGN §15; issue 17 item
// 3): 4 real Gloo workers on loopback with 2 redundant slots a rank, a
// placement table, seeded SwiGLU experts on layer 0, raw per-rank step calls
// (SyncTokenCounts, CommitGeometry, Forward) and the CPU reference under a
// mask (core::PlacementTable::WithMask). Used by rank_mask_test.cc (the
// workers mask on their own; a client re-admits) and coordinator_mask_test.cc
// (the coordinator service keeps the group masked and re-adds).

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
#include "client/grpc_status.h"
#include "client/placement_request.h"
#include "core/expert_source.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
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
  void MakeExpertSets() {
    sets_.clear();
    for (int r = 0; r < kWorld; ++r) {
      sets_.push_back(
          core::MakeHostExperts(core::ExpertSource::Seeded(kSeed, 0, model_.num_experts, 0, 0,
                                                           model_.hidden, model_.intermediate)
                                    .WithExperts(core::DistinctSlotExperts(table_, r)))
              .value());
    }
  }

  // The group through the fake's Coordinator: formed, configured,
  // allocated with 2 redundant slots a rank, table_ installed, layer 0's
  // seeded experts loaded.
  void FormAndSetUp() {
    client::Coordinator& c = fake_->coordinator();
    ASSERT_TRUE(c.FormGroup().ok());
    // The group's set-up, kept for a rank that comes back (RejoinRank).
    setup_.configure = MakeConfigureRequest(kWorld, model_);
    ASSERT_TRUE(c.ConfigureLayers(setup_.configure).ok());
    setup_.allocate = MakeAllocateRequest(model_, kCapacity);
    setup_.allocate.set_redundant_slots_per_rank(2);
    ASSERT_TRUE(c.AllocateWorkspace(setup_.allocate).ok());
    setup_.placements.push_back(client::MakeInstallPlacementRequest(0, table_));
    auto installed = c.InstallPlacement(setup_.placements[0]);
    ASSERT_TRUE(installed.ok()) << installed.status();
    v1::LoadExpertsRequest load;
    load.set_layer(0);
    load.set_kind(v1::EXPERT_KIND_SWIGLU);
    load.set_seed(kSeed);
    load.set_intermediate_size(model_.intermediate);
    setup_.loads.push_back(load);
    ASSERT_TRUE(c.LoadExperts(load).ok());
    MakeExpertSets();
  }

  RankInputs InputsOf(int step, int rank) const {
    return MakeInputs(1000 * step + rank, 4 + (rank + step) % 3, model_);
  }

  // One step on `ranks`: SyncTokenCounts, CommitGeometry, Forward. Fills
  // `out` (indexed by rank) and returns each rank's status.
  std::vector<absl::Status> Step(int step, const std::vector<int>& ranks,
                                 std::vector<v1::ForwardResponse>* out) {
    const int64_t epoch = step + 1;
    std::vector<v1::SyncTokenCountsResponse> sync(kWorld);
    std::vector<absl::Status> status = OnRanks(ranks, [&](int r) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::SyncTokenCountsRequest request;
      request.set_epoch(epoch);
      request.set_local_tokens(InputsOf(step, r).num_tokens);
      return client::ToAbslStatus(fake_->stub(r).SyncTokenCounts(&context, request, &sync[r]));
    });
    for (const absl::Status& s : status) {
      if (!s.ok()) return status;
    }
    status = OnRanks(ranks, [&](int r) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      v1::CommitGeometryRequest request;
      request.set_epoch(epoch);
      request.set_runtime_max_tokens_per_rank(sync[r].runtime_max_tokens_per_rank());
      request.set_local_tokens(InputsOf(step, r).num_tokens);
      v1::CommitGeometryResponse response;
      return client::ToAbslStatus(fake_->stub(r).CommitGeometry(&context, request, &response));
    });
    for (const absl::Status& s : status) {
      if (!s.ok()) return status;
    }
    out->assign(kWorld, v1::ForwardResponse());
    return OnRanks(ranks, [&](int r) {
      grpc::ClientContext context;
      context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
      return client::ToAbslStatus(fake_->stub(r).Forward(
          &context, MakeForwardRequest(0, epoch, InputsOf(step, r), model_), &(*out)[r]));
    });
  }

  // The reference of `step` under `live`: masked ranks have no tokens.
  core::EpReferenceResult Reference(int step, const std::vector<bool>& live) {
    const core::PlacementTable masked = table_.WithMask(live).value();
    std::vector<RankInputs> inputs;
    std::vector<core::EpRankInput> ref_inputs;
    std::vector<const core::ExpertSet*> set_ptrs;
    inputs.reserve(kWorld);
    ref_inputs.reserve(kWorld);
    for (int r = 0; r < kWorld; ++r) {
      inputs.push_back(live[r] ? InputsOf(step, r) : RankInputs{});
      set_ptrs.push_back(&sets_[r]);
    }
    for (int r = 0; r < kWorld; ++r) {
      ref_inputs.push_back(
          {inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].num_tokens});
    }
    auto ref = core::ReferenceEpForward(masked, set_ptrs, ref_inputs, model_.top_k);
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
      std::set<int> lost;
      int64_t choices = 0;
      for (int32_t id : InputsOf(step, r).ids) {
        if (id >= 0 && id < model_.num_experts && masked.LiveReplicas(id).empty()) {
          lost.insert(id);
          ++choices;
        }
      }
      EXPECT_EQ(std::vector<int>(got[r].lost_experts().begin(), got[r].lost_experts().end()),
                std::vector<int>(lost.begin(), lost.end()))
          << "step " << step << " rank " << r;
      EXPECT_EQ(got[r].lost_choices(), choices) << "step " << step << " rank " << r;
    }
  }

  // Kills `victims` while step kKillAtStep runs on every rank and sends the
  // step again to the survivors until all of them answer; checks that step
  // against the masked reference. Returns the time from the kill.
  absl::Duration KillDuringStepAndMask(const std::vector<int>& victims,
                                       const std::vector<int>& survivors, int* attempts) {
    std::vector<v1::ForwardResponse> got;
    std::thread killer([&] {
      absl::SleepFor(absl::Milliseconds(2));
      for (int victim : victims) EXPECT_TRUE(fake_->cluster().Kill(victim, SIGKILL).ok());
    });
    const absl::Time killed = absl::Now();
    (void)Step(kKillAtStep, {0, 1, 2, 3}, &got);
    killer.join();
    *attempts = 1;
    while (true) {
      const std::vector<absl::Status> status = Step(kKillAtStep, survivors, &got);
      ++*attempts;
      if (std::all_of(status.begin(), status.end(), [](const absl::Status& s) { return s.ok(); })) {
        break;
      }
      // Two victims dying a few ms apart can take a mask round each, and
      // every round asks for the step again: allow several rounds.
      if (*attempts >= 20) {
        ADD_FAILURE() << "survivors did not mask ranks " << ::testing::PrintToString(victims)
                      << ": " << status[0];
        return absl::InfiniteDuration();
      }
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
