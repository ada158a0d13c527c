// Integration tests of the one-sided GPU data plane in the worker service
// (server/onesided_data_plane.h; DESIGN §13; issue 15 item 5): two real
// moe-ep-worker processes on CUDA device 0, their peer windows mapped into
// each other through CUDA IPC (NCCL refuses two ranks on one GPU; this plane
// does not), driven over gRPC by the coordinator client. Forward's outputs
// are checked against the dense fp32 reference (core::DenseMoeReference)
// within the bf16 tolerance, its counters against the route computed here.
// Every test skips, printing why, without a GPU (and on a build without
// CUDA). The worker binary is MOE_EP_WORKER_BINARY when set (a bundle on
// the GPU machine), else the build's. Run them with
//   ./moe_ep_integration_tests --gtest_filter='GpuOneSided*'

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <numeric>
#include <set>
#include <thread>

#include "absl/time/clock.h"
#include "client/coordinator.h"
#include "client/grpc_status.h"
#include "client/local_cluster.h"
#include "client/placement_request.h"
#include "core/eplb.h"
#include "core/expert_load_file.h"
#include "core/expert_placement.h"
#include "core/expert_source.h"
#include "core/experts.h"
#include "core/moe_reference.h"
#include "core/placement_table.h"
#include "core/quantized_formats.h"
#include "core/routing.h"
#include "core/routing_source.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "gtest/gtest.h"
#include "server/device_info.h"
#include "tests/integration/fake_coordinator.h"
#include "tests/integration/rank_mask_fixture.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

#define MOE_EP_REQUIRE_GPU()                                                                  \
  do {                                                                                        \
    const int gpus_ = server::VisibleGpuCount();                                              \
    if (gpus_ < 1) {                                                                          \
      std::printf("[  SKIPPED ] needs a CUDA device; this %s sees none\n",                    \
                  server::BuiltWithCuda() ? "CUDA build" : "build without CUDA");             \
      GTEST_SKIP() << "needs a CUDA device" << (server::BuiltWithCuda() ? "" : " (no CUDA)"); \
    }                                                                                         \
  } while (0)

// Two workers of backend nccl on device 0 with `gpu_data_plane`.
struct SharedGpuGroup {
  std::unique_ptr<client::LocalCluster> cluster;
  std::unique_ptr<client::Coordinator> coordinator;
};

// `workers` workers of backend nccl on device 0 with `gpu_data_plane`.
client::LocalClusterOptions OnDeviceZero(int workers, const std::string& gpu_data_plane) {
  client::LocalClusterOptions options;
  options.num_workers = workers;
  options.backend = "nccl";
  const char* bundled = std::getenv("MOE_EP_WORKER_BINARY");
  options.worker_binary = bundled != nullptr && bundled[0] != '\0'
                              ? std::string(bundled)
                              : std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  options.extra_args = {"--device=0", "--gpu-data-plane=" + gpu_data_plane};
  options.stop_timeout = absl::Seconds(5);
  return options;
}

absl::StatusOr<SharedGpuGroup> StartOnDeviceZero(int workers, const std::string& gpu_data_plane) {
  SharedGpuGroup group;
  ASSIGN_OR_RETURN(group.cluster,
                   client::LocalCluster::Start(OnDeviceZero(workers, gpu_data_plane)));
  client::CoordinatorOptions coordinator_options;
  coordinator_options.backend = "nccl";
  coordinator_options.rpc_timeout = absl::Seconds(60);
  coordinator_options.group_timeout = absl::Seconds(20);
  ASSIGN_OR_RETURN(group.coordinator,
                   client::Coordinator::Connect(group.cluster->targets(), coordinator_options));
  RETURN_IF_ERROR(group.coordinator->WaitReady(absl::Seconds(30)));
  return group;
}

std::vector<float> OneSidedReference(const SmallModel& model, v1::ExpertKind kind, uint64_t seed,
                                     int layer, const RankInputs& in) {
  auto experts = kind == v1::EXPERT_KIND_IDENTITY
                     ? core::ExpertSet::Identity(0, model.num_experts, model.hidden)
                     : core::ExpertSet::GenerateSwiGlu(seed, layer, 0, model.num_experts,
                                                       model.hidden, model.intermediate)
                           .value();
  std::vector<float> out(in.num_tokens * model.hidden);
  absl::Status status =
      core::DenseMoeReference({&experts}, model.num_experts, in.hidden, in.ids, in.weights,
                              in.num_tokens, model.top_k, absl::MakeSpan(out));
  EXPECT_TRUE(status.ok()) << status;
  return out;
}

TEST(GpuOneSidedWorkers, TwoProcessesOnOneGpuForwardIdentityAndSwiGluAsTheReference) {
  MOE_EP_REQUIRE_GPU();
  absl::StatusOr<SharedGpuGroup> group = StartOnDeviceZero(2, "one-sided");
  ASSERT_TRUE(group.ok()) << group.status();
  client::Coordinator& c = *group->coordinator;
  absl::StatusOr<std::vector<v1::JoinResponse>> joined = c.FormGroup();
  ASSERT_TRUE(joined.ok()) << joined.status();
  for (const v1::JoinResponse& r : *joined) EXPECT_EQ(r.data_plane(), "one-sided");
  absl::StatusOr<std::vector<v1::GetStatusResponse>> status = c.Status();
  ASSERT_TRUE(status.ok()) << status.status();
  for (const v1::GetStatusResponse& s : *status) {
    EXPECT_EQ(s.backend(), "nccl");
    EXPECT_EQ(s.data_plane(), "one-sided");
  }

  const SmallModel model;  // H 64, 10 experts (5 a rank), top-3, I 32, 2 layers
  ASSERT_TRUE(c.ConfigureLayers(MakeConfigureRequest(2, model)).ok());
  ASSERT_TRUE(c.AllocateWorkspace(MakeAllocateRequest(model, 16)).ok());
  const uint64_t seed = 11;
  // Layer 0 identity experts, layer 1 SwiGLU.
  for (int layer = 0; layer < 2; ++layer) {
    v1::LoadExpertsRequest load;
    load.set_layer(layer);
    load.set_kind(layer == 0 ? v1::EXPERT_KIND_IDENTITY : v1::EXPERT_KIND_SWIGLU);
    load.set_seed(seed);
    load.set_intermediate_size(model.intermediate);
    absl::StatusOr<std::vector<v1::LoadExpertsResponse>> loaded = c.LoadExperts(load);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
  }
  // Uneven tokens (rank 1 has 0 in the second step) and invalid ids.
  const std::vector<std::vector<int64_t>> steps = {{7, 12}, {5, 0}};
  core::ExpertPlacement placement = *core::ExpertPlacement::Contiguous(model.num_experts, 2);
  for (size_t step = 0; step < steps.size(); ++step) {
    const int64_t epoch = static_cast<int64_t>(step) + 1;
    std::vector<RankInputs> inputs;
    inputs.reserve(2);
    for (int r = 0; r < 2; ++r) {
      inputs.push_back(MakeInputs(100 * step + r, steps[step][r], model, /*invalid_every=*/5));
    }
    absl::StatusOr<client::TokenCountSync> sync = c.SyncTokenCounts(epoch, steps[step]);
    ASSERT_TRUE(sync.ok()) << sync.status();
    ASSERT_TRUE(c.CommitGeometry(epoch, sync->runtime_max_tokens_per_rank, steps[step]).ok());
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<v1::ForwardRequest> requests;
      requests.reserve(inputs.size());
      for (const RankInputs& in : inputs) {
        requests.push_back(MakeForwardRequest(layer, epoch, in, model));
      }
      absl::StatusOr<std::vector<v1::ForwardResponse>> out = c.Forward(requests);
      ASSERT_TRUE(out.ok()) << out.status();
      for (int r = 0; r < 2; ++r) {
        const v1::ExpertKind kind = layer == 0 ? v1::EXPERT_KIND_IDENTITY : v1::EXPERT_KIND_SWIGLU;
        ExpectClose(DecodeBf16((*out)[r].output()),
                    OneSidedReference(model, kind, seed, layer, inputs[r]), model.hidden,
                    "step " + std::to_string(step) + " layer " + std::to_string(layer) + " rank " +
                        std::to_string(r));
        absl::StatusOr<core::DispatchRoute> route =
            core::ComputeDispatchRoute(inputs[r].ids, inputs[r].num_tokens, model.top_k, placement);
        ASSERT_TRUE(route.ok()) << route.status();
        EXPECT_EQ((*out)[r].tokens_sent(), static_cast<int64_t>(route->dest_rank.size()))
            << "rank " << r;
        EXPECT_EQ((*out)[r].runtime_max_tokens_per_rank(), sync->runtime_max_tokens_per_rank);
      }
      // Every copy sent is a copy received somewhere.
      EXPECT_EQ((*out)[0].tokens_sent() + (*out)[1].tokens_sent(),
                (*out)[0].tokens_received() + (*out)[1].tokens_received());
    }
  }

  // Benchmark on the group's plane reports latencies and names the plane;
  // the nccl plane cannot run on this group.
  v1::BenchmarkRequest bench = MakeBenchmarkRequest();
  absl::StatusOr<std::vector<v1::BenchmarkResponse>> timed = c.Benchmark(bench);
  ASSERT_TRUE(timed.ok()) << timed.status();
  for (const v1::BenchmarkResponse& r : *timed) {
    EXPECT_EQ(r.data_plane(), "one-sided");
    EXPECT_GT(r.dispatch_p50_us(), 0.0);
    EXPECT_GT(r.combine_p50_us(), 0.0);
    EXPECT_GE(r.dispatch_p99_us(), r.dispatch_p50_us());
    EXPECT_GT(r.dispatch_bytes(), 0);
  }
  bench.set_data_plane("nccl");
  absl::StatusOr<std::vector<v1::BenchmarkResponse>> refused = c.Benchmark(bench);
  ASSERT_FALSE(refused.ok());
  EXPECT_THAT(refused.status().message(), HasSubstr("cannot run on this group"));
}

// The checkpoint formats on the one-sided plane (issue 35 item 3; issue 34
// item 2's matrix): two worker processes sharing the GPU compute fp8
// block-scaled (layer 0) and gpt-oss mxfp4 (layer 1) experts as the CPU
// experts of the same seeded sources (core::MakeHostExperts: the quantized
// reference), within ExpectClose's bf16 bound.
TEST(GpuOneSidedWorkers, TwoProcessesComputeFp8AndMxfp4ExpertsAsTheReference) {
  MOE_EP_REQUIRE_GPU();
  absl::StatusOr<SharedGpuGroup> group = StartOnDeviceZero(2, "one-sided");
  ASSERT_TRUE(group.ok()) << group.status();
  client::Coordinator& c = *group->coordinator;
  absl::StatusOr<std::vector<v1::JoinResponse>> joined = c.FormGroup();
  ASSERT_TRUE(joined.ok()) << joined.status();
  for (const v1::JoinResponse& r : *joined) EXPECT_EQ(r.data_plane(), "one-sided");
  SmallModel model;  // fp8 tiles H and I by 128; mxfp4 steps them by 64
  model.hidden = 128;
  model.intermediate = 128;
  ASSERT_TRUE(c.ConfigureLayers(MakeConfigureRequest(2, model)).ok());
  ASSERT_TRUE(c.AllocateWorkspace(MakeAllocateRequest(model, 16)).ok());
  const uint64_t seed = 13;
  const v1::ExpertKind kinds[2] = {v1::EXPERT_KIND_FP8_BLOCK_SWIGLU, v1::EXPERT_KIND_MXFP4_GPT_OSS};
  const core::quant::ExpertWeightFormat formats[2] = {core::quant::ExpertWeightFormat::kFp8Block128,
                                                      core::quant::ExpertWeightFormat::kMxfp4};
  std::vector<core::ExpertSet> host;
  for (int layer = 0; layer < 2; ++layer) {
    v1::LoadExpertsRequest load;
    load.set_layer(layer);
    load.set_kind(kinds[layer]);
    load.set_seed(seed);
    load.set_intermediate_size(model.intermediate);
    absl::StatusOr<std::vector<v1::LoadExpertsResponse>> loaded = c.LoadExperts(load);
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    core::ExpertSource all = core::ExpertSource::Seeded(
        seed, layer, model.num_experts, 0, model.num_experts, model.hidden, model.intermediate);
    all.weight_format = formats[layer];
    absl::StatusOr<core::ExpertSet> experts = core::MakeHostExperts(all);
    ASSERT_TRUE(experts.ok()) << experts.status();
    host.push_back(*std::move(experts));
  }
  const std::vector<int64_t> tokens = {9, 6};
  absl::StatusOr<client::TokenCountSync> sync = c.SyncTokenCounts(1, tokens);
  ASSERT_TRUE(sync.ok()) << sync.status();
  ASSERT_TRUE(c.CommitGeometry(1, sync->runtime_max_tokens_per_rank, tokens).ok());
  std::vector<RankInputs> inputs;
  inputs.reserve(2);
  for (int r = 0; r < 2; ++r) inputs.push_back(MakeInputs(40 + r, tokens[r], model, 4));
  for (int layer = 0; layer < 2; ++layer) {
    std::vector<v1::ForwardRequest> requests;
    requests.reserve(2);
    for (const RankInputs& in : inputs) requests.push_back(MakeForwardRequest(layer, 1, in, model));
    absl::StatusOr<std::vector<v1::ForwardResponse>> out = c.Forward(requests);
    ASSERT_TRUE(out.ok()) << out.status();
    for (int r = 0; r < 2; ++r) {
      std::vector<float> want(inputs[r].num_tokens * model.hidden);
      const absl::Status ref = core::DenseMoeReference(
          {&host[layer]}, model.num_experts, inputs[r].hidden, inputs[r].ids, inputs[r].weights,
          inputs[r].num_tokens, model.top_k, absl::MakeSpan(want));
      ASSERT_TRUE(ref.ok()) << ref;
      ExpectClose(DecodeBf16((*out)[r].output()), want, model.hidden,
                  "layer " + std::to_string(layer) + " rank " + std::to_string(r));
    }
  }
}

TEST(GpuOneSidedWorkers, AutoPicksOneSidedForTwoProcessesOnOneGpu) {
  MOE_EP_REQUIRE_GPU();
  absl::StatusOr<SharedGpuGroup> group = StartOnDeviceZero(2, "auto");
  ASSERT_TRUE(group.ok()) << group.status();
  absl::StatusOr<std::vector<v1::JoinResponse>> joined = group->coordinator->FormGroup();
  ASSERT_TRUE(joined.ok()) << joined.status();
  for (const v1::JoinResponse& r : *joined) EXPECT_EQ(r.data_plane(), "one-sided");
}

}  // namespace
}  // namespace moe_ep::testing

namespace moe_ep::testing {
namespace {

// Rank masks and placement tables on the one-sided plane (DESIGN §15;
// issue 17 item 5): 4 worker processes on CUDA device 0 (CUDA IPC windows),
// 10 experts on 4 ranks x 5 slots (2 redundant a rank), each rank's experts
// one range of ids: rank 0 [0, 5), rank 1 [5, 10), rank 2 [2, 7), rank 3
// [4, 9) (tables whose ranks hold other sets: EplbTables... below). Experts
// 0 and 1 live only on rank 0, expert 9 only on rank 1; every other expert
// has two or three replicas. Steps run with that table and are checked
// against the CPU reference with the same table (core::ReferenceEpForward:
// the outputs within the bf16 tolerance of the GPU's SwiGLU, the token
// copies sent per rank exactly: they follow the replica each choice went
// to); then `victim` is killed with SIGKILL during a step, the survivors
// mask it, and every later step equals the reference under the same mask,
// the lost experts reported by id. The time from the kill to the first
// correct masked step is printed (bench/results/masks-onesided/README.md);
// nothing asserts a time.
constexpr int kOsWorld = 4;
constexpr int64_t kOsCapacity = 32;
constexpr uint64_t kOsSeed = 11;
constexpr int kOsSteps = 6;
constexpr int kOsKillAtStep = 2;

core::PlacementTable OneSidedTable() {
  return core::PlacementTable::FromSlotExperts(
             10, {{0, 1, 2, 3, 4}, {5, 6, 7, 8, 9}, {2, 3, 4, 5, 6}, {4, 5, 6, 7, 8}})
      .value();
}

class GpuOneSidedMasks : public ::testing::TestWithParam<int> {
 protected:
  void SetUp() override {
    if (server::VisibleGpuCount() < 1) return;  // the test body skips
    auto cluster = client::LocalCluster::Start(OnDeviceZero(kOsWorld, "one-sided"));
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    client::CoordinatorOptions coordinator_options;
    coordinator_options.backend = "nccl";
    coordinator_options.rpc_timeout = absl::Seconds(60);
    coordinator_options.group_timeout = absl::Seconds(10);
    coordinator_options.rank_masks = true;
    auto coordinator = client::Coordinator::Connect(cluster_->targets(), coordinator_options);
    ASSERT_TRUE(coordinator.ok()) << coordinator.status();
    coordinator_ = std::move(*coordinator);
    ASSERT_TRUE(coordinator_->WaitReady(absl::Seconds(30)).ok());
    for (const std::string& target : cluster_->targets()) {
      absl::StatusOr<std::shared_ptr<grpc::Channel>> channel = ConnectedChannel(target);
      ASSERT_TRUE(channel.ok()) << channel.status();
      stubs_.push_back(v1::Worker::NewStub(*channel));
    }
    client::Coordinator& c = *coordinator_;
    absl::StatusOr<std::vector<v1::JoinResponse>> joined = c.FormGroup();
    ASSERT_TRUE(joined.ok()) << joined.status();
    for (const v1::JoinResponse& r : *joined) ASSERT_EQ(r.data_plane(), "one-sided");
    const absl::Status set_up =
        SetUpMaskGroup(c, kOsWorld, model_, kOsCapacity, table_, kOsSeed, &setup_);
    ASSERT_TRUE(set_up.ok()) << set_up;
    sets_ = SlotExpertSets(table_, model_, kOsSeed, kOsWorld);
  }

  RankInputs InputsOf(int step, int rank) const {
    return MakeInputs(1000 * step + rank, 4 + (rank + step) % 3, model_);
  }

  // One step on `ranks`: SyncTokenCounts, CommitGeometry, Forward; `out`
  // indexed by rank.
  std::vector<absl::Status> Step(int step, const std::vector<int>& ranks,
                                 std::vector<v1::ForwardResponse>* out) {
    return StepOnRanks(
        step, ranks, kOsWorld, model_, std::chrono::seconds(60),
        [&](int r) -> v1::Worker::Stub& { return *stubs_[r]; },
        [&](int r) { return InputsOf(step, r); }, out);
  }

  // `got` (by rank) against the CPU reference of `step` under `live`.
  void ExpectReference(int step, const std::vector<int>& ranks, const std::vector<bool>& live,
                       const std::vector<v1::ForwardResponse>& got) {
    const core::PlacementTable masked = table_.WithMask(live).value();
    absl::StatusOr<core::EpReferenceResult> ref = MaskedReference(
        table_, live, sets_, model_.top_k, [&](int r) { return InputsOf(step, r); });
    ASSERT_TRUE(ref.ok()) << ref.status();
    for (int r : ranks) {
      const std::string what = "step " + std::to_string(step) + " rank " + std::to_string(r);
      std::vector<float> want(ref->output[r].size());
      for (size_t i = 0; i < want.size(); ++i) want[i] = core::Bf16ToFloat(ref->output[r][i]);
      ExpectClose(DecodeBf16(got[r].output()), want, model_.hidden, what);
      // One copy per distinct destination rank of the chosen replicas.
      EXPECT_EQ(got[r].tokens_sent(), static_cast<int64_t>(ref->routes[r].dest_rank.size()))
          << what;
      // A masked rank sent no tokens, as in the reference.
      ExpectLostExperts(masked, live[r] ? InputsOf(step, r).ids : std::vector<int32_t>{},
                        model_.num_experts, got[r], what);
    }
  }

  v1::GetStatusResponse StatusOf(int r) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::GetStatusResponse response;
    EXPECT_TRUE(stubs_[r]->GetStatus(&context, v1::GetStatusRequest(), &response).ok());
    return response;
  }

  // Kills `victim` during step `step` on every rank and sends that step
  // again to `survivors` until all of them answer (at most 5 times); the
  // replies by rank in *got. Returns the time from the kill.
  absl::Duration KillAndMask(int victim, int step, const std::vector<int>& survivors,
                             std::vector<v1::ForwardResponse>* got, int* attempts) {
    absl::Time killed;
    if (!KillDuringStep(
            *cluster_, {victim}, {0, 1, 2, 3}, survivors, /*max_attempts=*/6,
            [&](const std::vector<int>& ranks) { return Step(step, ranks, got); }, &killed,
            attempts)) {
      return absl::InfiniteDuration();
    }
    return absl::Now() - killed;
  }

  SmallModel model_;
  client::RankSetup setup_;
  const core::PlacementTable table_ = OneSidedTable();
  std::vector<core::ExpertSet> sets_;
  std::unique_ptr<client::LocalCluster> cluster_;
  std::unique_ptr<client::Coordinator> coordinator_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;
};

TEST_P(GpuOneSidedMasks, PlacementStepsThenKilledRankMaskedAsTheReference) {
  MOE_EP_REQUIRE_GPU();
  ASSERT_NE(cluster_, nullptr);
  const int victim = GetParam();
  const std::vector<int> all = {0, 1, 2, 3};
  std::vector<int> survivors;
  for (int r = 0; r < kOsWorld; ++r) {
    if (r != victim) survivors.push_back(r);
  }
  std::vector<bool> live(kOsWorld, true);
  live[victim] = false;
  const std::vector<bool> everyone(kOsWorld, true);

  std::vector<v1::ForwardResponse> got;
  for (int step = 0; step < kOsKillAtStep; ++step) {
    const std::vector<absl::Status> status = Step(step, all, &got);
    for (int r = 0; r < kOsWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
    ExpectReference(step, all, everyone, got);
    for (int r = 0; r < kOsWorld; ++r) EXPECT_TRUE(got[r].lost_experts().empty());
  }

  int attempts = 0;
  std::vector<v1::ForwardResponse> masked_got;
  std::vector<absl::Status> status;
  const absl::Duration to_mask =
      KillAndMask(victim, kOsKillAtStep, survivors, &masked_got, &attempts);
  ASSERT_NE(to_mask, absl::InfiniteDuration());
  ExpectReference(kOsKillAtStep, survivors, live, masked_got);
  for (int r : survivors) {
    const v1::GetStatusResponse s = StatusOf(r);
    EXPECT_FALSE(s.group_broken()) << "rank " << r << ": " << s.broken_reason();
    EXPECT_THAT(s.masked_ranks(), ::testing::ElementsAre(victim)) << "rank " << r;
    EXPECT_EQ(s.mask_round(), 1) << "rank " << r;
  }
  // Victim 0 loses experts 0 and 1 (their only replicas); victim 2 none.
  std::set<int> reported;
  for (int step = kOsKillAtStep + 1; step < kOsSteps; ++step) {
    status = Step(step, survivors, &masked_got);
    for (size_t i = 0; i < survivors.size(); ++i) {
      ASSERT_TRUE(status[i].ok()) << "rank " << survivors[i] << ": " << status[i];
    }
    ExpectReference(step, survivors, live, masked_got);
    for (int r : survivors) {
      reported.insert(masked_got[r].lost_experts().begin(), masked_got[r].lost_experts().end());
    }
  }
  if (victim == 0) {
    EXPECT_EQ(reported, (std::set<int>{0, 1}));
  } else {
    EXPECT_TRUE(reported.empty());
  }
  std::cout << "[onesided-mask] killed rank " << victim << ": first correct masked step "
            << absl::ToDoubleMilliseconds(to_mask) << " ms after the kill (" << attempts
            << " step attempts)" << std::endl;
}

INSTANTIATE_TEST_SUITE_P(Victims, GpuOneSidedMasks, ::testing::Values(0, 2),
                         [](const ::testing::TestParamInfo<int>& info) {
                           return "kill_rank" + std::to_string(info.param);
                         });

}  // namespace
}  // namespace moe_ep::testing

namespace moe_ep::testing {
namespace {

// A restarted rank rejoins the one-sided group (DESIGN §15; issue 17 item
// 5): rank 2 of 4 processes on one GPU is killed during step 2, the
// survivors mask it and serve; its worker is restarted on its address,
// joins alone (a one-sided plane of itself), is set up with the group's
// requests and Rejoin re-admits it: the members' IPC windows are made
// again, and steps 4 and 5 on all four ranks equal the unmasked reference.
class GpuOneSidedRejoin : public GpuOneSidedMasks {};

TEST_F(GpuOneSidedRejoin, RestartedRankRejoinsAndStepsEqualTheFullReference) {
  MOE_EP_REQUIRE_GPU();
  ASSERT_NE(cluster_, nullptr);
  constexpr int kVictim = 2;
  const std::vector<int> all = {0, 1, 2, 3};
  const std::vector<int> survivors = {0, 1, 3};
  const std::vector<bool> everyone(kOsWorld, true);
  std::vector<bool> live(kOsWorld, true);
  live[kVictim] = false;
  std::vector<v1::ForwardResponse> got;
  for (int step = 0; step < kOsKillAtStep; ++step) {
    const std::vector<absl::Status> status = Step(step, all, &got);
    for (int r = 0; r < kOsWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
  }
  int attempts = 0;
  const absl::Duration to_mask = KillAndMask(kVictim, kOsKillAtStep, survivors, &got, &attempts);
  ASSERT_NE(to_mask, absl::InfiniteDuration());
  ExpectReference(kOsKillAtStep, survivors, live, got);

  const absl::Time restarted = absl::Now();
  ASSERT_TRUE(cluster_->Restart(kVictim).ok());
  // A fresh channel: the old one saw the worker die and may be in reconnect
  // backoff, failing the next call at once while the peers wait for it.
  absl::StatusOr<std::shared_ptr<grpc::Channel>> fresh =
      ConnectedChannel(cluster_->targets()[kVictim]);
  ASSERT_TRUE(fresh.ok()) << fresh.status();
  stubs_[kVictim] = v1::Worker::NewStub(*fresh);
  absl::StatusOr<v1::RejoinResponse> rejoined = coordinator_->RejoinRank(kVictim, setup_);
  ASSERT_TRUE(rejoined.ok()) << rejoined.status();
  EXPECT_TRUE(rejoined->masked_ranks().empty());
  EXPECT_EQ(rejoined->mask_round(), 2);
  absl::Duration to_first_step;
  for (int step = kOsKillAtStep + 2; step < kOsSteps; ++step) {
    const std::vector<absl::Status> status = Step(step, all, &got);
    for (int r = 0; r < kOsWorld; ++r) ASSERT_TRUE(status[r].ok()) << "rank " << r << status[r];
    ExpectReference(step, all, everyone, got);
    if (step == kOsKillAtStep + 2) to_first_step = absl::Now() - restarted;
  }
  for (int r = 0; r < kOsWorld; ++r) {
    const v1::GetStatusResponse s = StatusOf(r);
    EXPECT_FALSE(s.group_broken()) << "rank " << r << ": " << s.broken_reason();
    EXPECT_TRUE(s.masked_ranks().empty()) << "rank " << r;
  }
  std::cout << "[onesided-rejoin] killed rank " << kVictim << ": first correct masked step "
            << absl::ToDoubleMilliseconds(to_mask) << " ms after the kill (" << attempts
            << " step attempts); restart -> first correct unmasked step "
            << absl::ToDoubleMilliseconds(to_first_step) << " ms" << std::endl;
}

}  // namespace
}  // namespace moe_ep::testing

namespace moe_ep::testing {
namespace {

// EPLB's real output on 4 one-sided worker processes sharing GPU 0 (DESIGN
// §17; issue 34 item 2): SGLang's DeepSeek-V3 prefill load of file layers 10
// and 40, 256 experts on 4 ranks x 72 slots (8 redundant a rank,
// core::RebalanceHierarchical with 8 groups on one node), installed on this
// model's layers 0 (seeded SwiGLU) and 1 (identity); the ranks hold ids that
// are not ranges (asserted). Three steps of top-8 choices drawn from the
// same load (uneven tokens, one rank with none in a step) equal the CPU
// reference under the same tables (core::ReferenceEpForward: outputs within
// the bf16 tolerance, token copies sent per rank exactly). This was
// FAILED_PRECONDITION at InstallPlacement while the one-sided route map
// needed ranges of ids.
constexpr int kEplbWorld = 4;
constexpr uint64_t kEplbSeed = 13;

std::string TraceFile() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  const std::string data = (env != nullptr && *env != '\0') ? env : MOE_EP_DATA_DIR;
  return data + "/traces/sglang_ep_statistics_deepseek/prefill_in4096.json";
}

TEST(GpuOneSidedWorkers, EplbTablesOfTheDeepSeekV3LoadEqualTheReference) {
  MOE_EP_REQUIRE_GPU();
  const std::string file = TraceFile();
  if (!std::filesystem::exists(file)) GTEST_SKIP() << "DeepSeek-V3 load not found at " << file;
  absl::StatusOr<std::vector<std::vector<double>>> load = core::ReadExpertLoadFile(file);
  ASSERT_TRUE(load.ok()) << load.status();
  SmallModel model;
  model.num_experts = 256;
  model.top_k = 8;
  const int file_layers[2] = {10, 40};
  std::vector<core::PlacementTable> tables;
  int not_ranges = 0;
  for (int file_layer : file_layers) {
    absl::StatusOr<core::PlacementTable> t =
        core::RebalanceHierarchical((*load)[file_layer], {256 + 32, kEplbWorld, 8, 1});
    ASSERT_TRUE(t.ok()) << t.status();
    for (int r = 0; r < kEplbWorld; ++r) {
      const std::vector<int> held = core::DistinctSlotExperts(*t, r);
      not_ranges += held.back() - held.front() + 1 != static_cast<int>(held.size());
    }
    tables.push_back(std::move(*t));
  }
  ASSERT_GT(not_ranges, 0) << "EPLB's ranks must hold ids that are not ranges";
  // The CPU experts of each rank under each layer's table.
  std::vector<std::vector<core::ExpertSet>> sets(2);
  for (int r = 0; r < kEplbWorld; ++r) {
    for (int layer = 0; layer < 2; ++layer) {
      const core::ExpertSource source =
          layer == 0 ? core::ExpertSource::Seeded(kEplbSeed, 0, model.num_experts, 0, 0,
                                                  model.hidden, model.intermediate)
                     : core::ExpertSource::Identity(1, model.num_experts, 0, 0, model.hidden);
      absl::StatusOr<core::ExpertSet> set =
          core::MakeHostExperts(source.WithExperts(core::DistinctSlotExperts(tables[layer], r)));
      ASSERT_TRUE(set.ok()) << set.status();
      sets[layer].push_back(std::move(*set));
    }
  }
  core::RoutingSourceOptions routing;
  routing.kind = "load:" + file;
  routing.num_experts = model.num_experts;
  routing.top_k = model.top_k;
  routing.seed = kEplbSeed;
  absl::StatusOr<core::RoutingSource> source = core::RoutingSource::Create(routing);
  ASSERT_TRUE(source.ok()) << source.status();

  absl::StatusOr<SharedGpuGroup> group = StartOnDeviceZero(kEplbWorld, "one-sided");
  ASSERT_TRUE(group.ok()) << group.status();
  client::Coordinator& c = *group->coordinator;
  absl::StatusOr<std::vector<v1::JoinResponse>> joined = c.FormGroup();
  ASSERT_TRUE(joined.ok()) << joined.status();
  for (const v1::JoinResponse& r : *joined) ASSERT_EQ(r.data_plane(), "one-sided");
  ASSERT_TRUE(c.ConfigureLayers(MakeConfigureRequest(kEplbWorld, model)).ok());
  v1::AllocateWorkspaceRequest allocate = MakeAllocateRequest(model, 64);
  allocate.set_redundant_slots_per_rank(8);
  absl::StatusOr<std::vector<v1::AllocateWorkspaceResponse>> allocated =
      c.AllocateWorkspace(allocate);
  ASSERT_TRUE(allocated.ok()) << allocated.status();
  for (int layer = 0; layer < 2; ++layer) {
    absl::StatusOr<std::vector<v1::InstallPlacementResponse>> installed =
        c.InstallPlacement(client::MakeInstallPlacementRequest(layer, tables[layer]));
    ASSERT_TRUE(installed.ok()) << "layer " << layer << ": " << installed.status();
    v1::LoadExpertsRequest experts;
    experts.set_layer(layer);
    experts.set_kind(layer == 0 ? v1::EXPERT_KIND_SWIGLU : v1::EXPERT_KIND_IDENTITY);
    experts.set_seed(kEplbSeed);
    experts.set_intermediate_size(model.intermediate);
    absl::StatusOr<std::vector<v1::LoadExpertsResponse>> loaded = c.LoadExperts(experts);
    ASSERT_TRUE(loaded.ok()) << "layer " << layer << ": " << loaded.status();
  }

  const std::vector<std::vector<int64_t>> steps = {{24, 17, 40, 9}, {31, 0, 12, 64}, {5, 5, 5, 5}};
  for (size_t step = 0; step < steps.size(); ++step) {
    const int64_t epoch = static_cast<int64_t>(step) + 1;
    absl::StatusOr<client::TokenCountSync> sync = c.SyncTokenCounts(epoch, steps[step]);
    ASSERT_TRUE(sync.ok()) << sync.status();
    ASSERT_TRUE(c.CommitGeometry(epoch, sync->runtime_max_tokens_per_rank, steps[step]).ok());
    for (int layer = 0; layer < 2; ++layer) {
      std::vector<RankInputs> inputs;
      std::vector<v1::ForwardRequest> requests;
      for (int r = 0; r < kEplbWorld; ++r) {
        RankInputs in = MakeInputs(500 * step + 10 * layer + r, steps[step][r], model);
        absl::StatusOr<core::Routing> drawn = source->Generate(
            file_layers[layer], static_cast<int64_t>(step), r, kEplbWorld, in.num_tokens);
        ASSERT_TRUE(drawn.ok()) << drawn.status();
        in.ids = drawn->topk_ids;
        in.weights = drawn->topk_weights;
        requests.push_back(MakeForwardRequest(layer, epoch, in, model));
        inputs.push_back(std::move(in));
      }
      std::vector<core::EpRankInput> ref_inputs;
      std::vector<const core::ExpertSet*> set_ptrs;
      for (int r = 0; r < kEplbWorld; ++r) {
        ref_inputs.push_back(
            {inputs[r].hidden, inputs[r].ids, inputs[r].weights, inputs[r].num_tokens});
        set_ptrs.push_back(&sets[layer][r]);
      }
      absl::StatusOr<core::EpReferenceResult> ref =
          core::ReferenceEpForward(tables[layer], set_ptrs, ref_inputs, model.top_k);
      ASSERT_TRUE(ref.ok()) << ref.status();
      absl::StatusOr<std::vector<v1::ForwardResponse>> out = c.Forward(requests);
      ASSERT_TRUE(out.ok()) << "step " << step << " layer " << layer << ": " << out.status();
      for (int r = 0; r < kEplbWorld; ++r) {
        const std::string what = "step " + std::to_string(step) + " layer " +
                                 std::to_string(layer) + " rank " + std::to_string(r);
        std::vector<float> want(ref->output[r].size());
        for (size_t i = 0; i < want.size(); ++i) want[i] = core::Bf16ToFloat(ref->output[r][i]);
        ExpectClose(DecodeBf16((*out)[r].output()), want, model.hidden, what);
        EXPECT_EQ((*out)[r].tokens_sent(), static_cast<int64_t>(ref->routes[r].dest_rank.size()))
            << what;
        EXPECT_TRUE((*out)[r].lost_experts().empty()) << what;
      }
    }
  }
}

}  // namespace
}  // namespace moe_ep::testing
