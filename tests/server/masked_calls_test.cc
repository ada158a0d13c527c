// Calls that need every rank under a rank mask (DESIGN §15; issue 17): two
// in-process Gloo workers joined with every rank's address; rank 1 goes away
// (its server and group are destroyed), rank 0 masks it on its next step
// call, and then ForwardLayers, Benchmark and the engine's in-process data
// calls (WorkerService::RunOnDataPlane, what libmoe_ep.so's moe_ep_dispatch
// and friends enter) fail FAILED_PRECONDITION naming rank 1 without running:
// never a route to the lost rank, never a wait on it. Forward keeps serving.

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "core/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tensor_codec.h"
#include "tests/server/in_process_worker.h"

namespace moe_ep::server {
namespace masked_calls_test {
namespace {

using ::testing::HasSubstr;
using testing::InProcessWorker;
using testing::OnAllRanks;
using testing::OneLayerOverTwoRanks;

constexpr int64_t kHidden = 4;

v1::AllocateWorkspaceRequest Allocate() {
  v1::AllocateWorkspaceRequest request;
  request.set_hidden_size(kHidden);
  request.set_top_k(2);
  request.set_num_experts(4);
  request.set_capacity_tokens(8);
  request.set_dispatch_dtype(v1::DISPATCH_DTYPE_BF16);
  return request;
}

// One token choosing experts 0 and 1 (rank 0's under the contiguous table).
v1::ForwardRequest OneToken(int64_t epoch) {
  std::vector<core::bf16_t> hidden;
  for (float v : {1.0f, 2.0f, 3.0f, 4.0f}) hidden.push_back(core::FloatToBf16(v));
  const int32_t ids[2] = {0, 1};
  const float weights[2] = {0.25f, 0.5f};
  v1::ForwardRequest request;
  request.set_layer(0);
  request.set_epoch(epoch);
  *request.mutable_hidden_states() = EncodeBf16(hidden, std::vector<int64_t>{1, kHidden});
  *request.mutable_topk_ids() = EncodeInt32(ids, std::vector<int64_t>{1, 2});
  *request.mutable_topk_weights() = EncodeFloat32(weights, std::vector<int64_t>{1, 2});
  return request;
}

TEST(MaskedCalls, CallsThatNeedEveryRankNameTheMaskedRank) {
  auto rank0 = std::make_unique<InProcessWorker>();
  auto rank1 = std::make_unique<InProcessWorker>();
  InProcessWorker* workers[2] = {rank0.get(), rank1.get()};
  const std::vector<std::string> addresses = {rank0->address(), rank1->address()};
  grpc::Status status[2];
  OnAllRanks(2, [&](int r) {
    v1::JoinRequest join;
    join.set_world_size(2);
    join.set_rank(r);
    join.set_backend("gloo");
    join.set_rendezvous_address(addresses[0]);
    join.set_generation(1);
    join.set_timeout_ms(4000);
    for (const std::string& a : addresses) join.add_rendezvous_addresses(a);
    v1::JoinResponse response;
    status[r] = workers[r]->Call(&v1::Worker::Stub::Join, join, &response);
  });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Configure(OneLayerOverTwoRanks(kHidden)); });
  ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0].error_message();
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Allocate(Allocate()); });
  ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0].error_message();
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_IDENTITY);
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Load(load); });
  ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0].error_message();

  // Rank 1 is lost; rank 0 masks it on its next step calls.
  rank1.reset();
  bool masked = false;
  for (int attempt = 0; attempt < 5 && !masked; ++attempt) {
    (void)rank0->Sync(2, 1);
    masked = rank0->Status().masked_ranks_size() == 1;
  }
  ASSERT_TRUE(masked) << rank0->Status().DebugString();
  EXPECT_EQ(rank0->Status().masked_ranks(0), 1);
  EXPECT_FALSE(rank0->Status().group_broken());

  // The engine's entry: refused before anything runs.
  bool ran = false;
  const absl::Status engine =
      rank0->service().RunOnDataPlane("moe_ep_dispatch", absl::Now() + absl::Seconds(10), true,
                                      [&](DataPlane&, const core::EpDispatcherOptions&) {
                                        ran = true;
                                        return absl::OkStatus();
                                      });
  EXPECT_FALSE(ran);
  EXPECT_EQ(engine.code(), absl::StatusCode::kFailedPrecondition) << engine;
  EXPECT_THAT(std::string(engine.message()),
              HasSubstr("moe_ep_dispatch: rank(s) [1] of 2 are masked out"));

  // ForwardLayers and Benchmark: the same, through the vote (rank 0 alone).
  v1::ForwardLayersRequest layers;
  layers.set_epoch(1);
  layers.mutable_stack()->set_seed(5);
  *layers.mutable_tokens() =
      EncodeFloat32(std::vector<float>(2 * kHidden, 0.5f), std::vector<int64_t>{2, kHidden});
  v1::ForwardLayersResponse layers_out;
  const grpc::Status forward_layers =
      rank0->Call(&v1::Worker::Stub::ForwardLayers, layers, &layers_out);
  EXPECT_EQ(forward_layers.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << forward_layers.error_message();
  EXPECT_THAT(forward_layers.error_message(),
              HasSubstr("ForwardLayers: rank(s) [1] of 2 are masked out"));
  v1::BenchmarkRequest bench;
  bench.set_tokens_per_rank(4);
  bench.set_hidden_size(kHidden);
  bench.set_top_k(2);
  bench.set_num_experts(4);
  bench.set_iterations(1);
  v1::BenchmarkResponse bench_out;
  const grpc::Status benchmark = rank0->Benchmark(bench, &bench_out);
  EXPECT_EQ(benchmark.error_code(), grpc::StatusCode::FAILED_PRECONDITION)
      << benchmark.error_message();
  EXPECT_THAT(benchmark.error_message(), HasSubstr("Benchmark: rank(s) [1] of 2 are masked out"));
  EXPECT_FALSE(rank0->Status().group_broken());

  // Forward serves the masked group: experts 0 and 1 live on rank 0
  // (identity), so the token comes back as (0.25 + 0.5) * x.
  v1::SyncTokenCountsResponse sync;
  ASSERT_TRUE(rank0->Sync(3, 1, &sync).ok());
  ASSERT_TRUE(rank0->Commit(3, sync.runtime_max_tokens_per_rank(), 1).ok());
  v1::ForwardResponse out;
  const grpc::Status forward = rank0->Forward(OneToken(3), &out);
  ASSERT_TRUE(forward.ok()) << forward.error_message();
  auto decoded = DecodeBf16(out.output(), "output", 2);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  std::vector<float> got;
  for (core::bf16_t v : decoded->values) got.push_back(core::Bf16ToFloat(v));
  EXPECT_THAT(got, ::testing::ElementsAre(0.75f, 1.5f, 2.25f, 3.0f));
}

}  // namespace
}  // namespace masked_calls_test
}  // namespace moe_ep::server
