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

#include <cstdio>
#include <cstdlib>
#include <numeric>

#include "client/coordinator.h"
#include "client/local_cluster.h"
#include "core/expert_placement.h"
#include "core/experts.h"
#include "core/moe_reference.h"
#include "core/routing.h"
#include "core/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/device_info.h"
#include "tests/integration/fake_coordinator.h"

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

absl::StatusOr<SharedGpuGroup> StartOnDeviceZero(int workers, const std::string& gpu_data_plane) {
  SharedGpuGroup group;
  client::LocalClusterOptions options;
  options.num_workers = workers;
  options.backend = "nccl";
  const char* bundled = std::getenv("MOE_EP_WORKER_BINARY");
  options.worker_binary = bundled != nullptr && bundled[0] != '\0'
                              ? std::string(bundled)
                              : std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  options.extra_args = {"--device=0", "--gpu-data-plane=" + gpu_data_plane};
  options.stop_timeout = absl::Seconds(5);
  ASSIGN_OR_RETURN(group.cluster, client::LocalCluster::Start(options));
  client::CoordinatorOptions coordinator_options;
  coordinator_options.backend = "nccl";
  coordinator_options.rpc_timeout = absl::Seconds(60);
  coordinator_options.group_timeout = absl::Seconds(20);
  ASSIGN_OR_RETURN(group.coordinator,
                   client::Coordinator::Connect(group.cluster->targets(), coordinator_options));
  RETURN_IF_ERROR(group.coordinator->WaitReady(absl::Seconds(30)));
  return group;
}

std::vector<float> Reference(const SmallModel& model, v1::ExpertKind kind, uint64_t seed, int layer,
                             const RankInputs& in) {
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

// bf16 output vs fp32 reference: the bf16 roundings of the per-rank partial
// sums (<= K terms) and of the result, relative to the row's magnitude.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, int64_t hidden,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t row = 0; row * hidden < want.size(); ++row) {
    float scale = 0;
    for (int64_t h = 0; h < hidden; ++h) scale = std::max(scale, std::abs(want[row * hidden + h]));
    for (int64_t h = 0; h < hidden; ++h) {
      const size_t i = row * hidden + h;
      ASSERT_NEAR(got[i], want[i], 4 * 0.0078125f * scale + 1e-6f)
          << what << " row " << row << " col " << h;
    }
  }
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
        ExpectClose(DecodeBf16((*out)[r].output()), Reference(model, kind, seed, layer, inputs[r]),
                    model.hidden,
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
  v1::BenchmarkRequest bench;
  bench.set_tokens_per_rank(32);
  bench.set_hidden_size(128);
  bench.set_top_k(4);
  bench.set_num_experts(8);
  bench.set_routing("uniform");
  bench.set_iterations(5);
  bench.set_warmup(1);
  bench.set_seed(3);
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
