#include "server/worker_service.h"

#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "core/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "proto/rpc/health.h"
#include "server/tensor_codec.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"
#include "tests/server/health_probe.h"
#include "tests/server/in_process_worker.h"

namespace moe_ep::server {
namespace worker_service_test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;
using testing::InProcessWorker;
using testing::OnAllRanks;

// GetStatus without the error counter (which bad calls are meant to bump).
std::string StatusSnapshot(InProcessWorker& worker) {
  v1::GetStatusResponse status = worker.Status();
  status.mutable_counters()->set_errors(0);
  return status.SerializeAsString();
}

v1::ConfigureLayersRequest ConfigureRequest(int tp, const std::vector<bool>& sparse) {
  v1::ConfigureLayersRequest request;
  request.mutable_layout()->set_tp_size(tp);
  request.mutable_layout()->set_attn_dp_size(1);
  request.set_a2a_enabled(true);
  v1::ModelDescription* model = request.mutable_model();
  model->set_name("hand");
  model->set_hidden_size(4);
  model->set_num_layers(static_cast<int>(sparse.size()));
  model->set_num_experts(4);
  model->set_top_k(2);
  for (bool s : sparse) model->add_sparse_layers(s);
  return request;
}

v1::AllocateWorkspaceRequest AllocateRequest() {
  v1::AllocateWorkspaceRequest request;
  request.set_hidden_size(4);
  request.set_top_k(2);
  request.set_num_experts(4);
  request.set_capacity_tokens(8);
  request.set_dispatch_dtype(v1::DISPATCH_DTYPE_BF16);
  return request;
}

v1::LoadExpertsRequest IdentityExperts(int layer) {
  v1::LoadExpertsRequest request;
  request.set_layer(layer);
  request.set_kind(v1::EXPERT_KIND_IDENTITY);
  return request;
}

// Hand values: every number is exact in bf16, and so are (sum w) * x.
// Token 0: ids {0, 3}, weights {0.25, 0.5}  -> 0.75 * x0.
// Token 1: ids {1, -1}, weights {0.75, 0.125}: -1 is "no expert" -> 0.75 * x1.
v1::ForwardRequest HandForward(int64_t epoch) {
  const float x[8] = {1, 2, 3, 4, 0.5f, -1, 2, 8};
  std::vector<core::bf16_t> hidden;
  for (float v : x) hidden.push_back(core::FloatToBf16(v));
  const int32_t ids[4] = {0, 3, 1, -1};
  const float weights[4] = {0.25f, 0.5f, 0.75f, 0.125f};
  v1::ForwardRequest request;
  request.set_layer(0);
  request.set_epoch(epoch);
  *request.mutable_hidden_states() = EncodeBf16(hidden, std::vector<int64_t>{2, 4});
  *request.mutable_topk_ids() = EncodeInt32(ids, std::vector<int64_t>{2, 2});
  *request.mutable_topk_weights() = EncodeFloat32(weights, std::vector<int64_t>{2, 2});
  return request;
}

std::vector<float> DecodeOutput(const v1::Tensor& tensor) {
  auto decoded = DecodeBf16(tensor, "output", 2);
  EXPECT_TRUE(decoded.ok()) << decoded.status();
  std::vector<float> out;
  for (core::bf16_t v : decoded->values) out.push_back(core::Bf16ToFloat(v));
  return out;
}

// Brings a 1-rank worker to ALLOCATED with identity experts on layer 0.
void SetUpOneRank(InProcessWorker& worker) {
  ASSERT_TRUE(worker.Join(1, 0, 1, worker.address(), "gloo").ok());
  ASSERT_TRUE(worker.Configure(ConfigureRequest(1, {true, false})).ok());
  ASSERT_TRUE(worker.Allocate(AllocateRequest()).ok());
  ASSERT_TRUE(worker.Load(IdentityExperts(0)).ok());
}

void ExpectError(const grpc::Status& status, grpc::StatusCode code, const std::string& fragment) {
  EXPECT_EQ(status.error_code(), code) << status.error_message();
  EXPECT_THAT(status.error_message(), HasSubstr(fragment));
}

TEST(WorkerService, OneRankFullFlowComputesWeightedSumExactly) {
  InProcessWorker worker;
  // Liveness ("") serves from the start; readiness waits for the group.
  EXPECT_EQ(ProbeHealth(worker.address(), rpc::kLivenessServiceName), kServing);
  EXPECT_EQ(ProbeHealth(worker.address(), rpc::kReadinessServiceName), kNotServing);
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_STARTED);
  // Rendezvous through this worker's own Rendezvous service (GrpcStore).
  ASSERT_TRUE(worker.Join(1, 0, 1, worker.address(), "gloo").ok());
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_JOINED);
  EXPECT_EQ(worker.Status().backend(), "gloo");
  EXPECT_EQ(ProbeHealth(worker.address(), rpc::kWorkerServiceName), kNotServing);

  v1::ConfigureLayersResponse plan;
  ASSERT_TRUE(worker.Configure(ConfigureRequest(1, {true, false}), &plan).ok());
  ASSERT_EQ(plan.layers_size(), 2);
  EXPECT_TRUE(plan.layers(0).sparse());
  EXPECT_EQ(plan.layers(0).mlp_mode(), v1::SCATTER_MODE_SCATTERED);  // a2a on, sparse
  EXPECT_EQ(plan.layers(1).mlp_mode(), v1::SCATTER_MODE_FULL);       // dense, moe_dense unset
  EXPECT_EQ(plan.fingerprint().size(), 16u);
  EXPECT_EQ(worker.Status().plan_summary(), "2 layers, 1 sparse");

  v1::AllocateWorkspaceResponse alloc;
  ASSERT_TRUE(worker.Allocate(AllocateRequest(), &alloc).ok());
  EXPECT_EQ(alloc.dispatch_bytes_per_token(), 2 * 4 + 8 * 2);  // 2H + 8K
  EXPECT_EQ(alloc.combine_bytes_per_token(), 8);               // 2H
  EXPECT_EQ(alloc.capacity_tokens(), 8);
  EXPECT_GT(alloc.allocated_bytes(), 0);
  EXPECT_GT(alloc.flashinfer_workspace_bytes(), 0);
  int64_t region_bytes = 0;
  for (const v1::WorkspaceRegion& r : alloc.regions()) {
    EXPECT_EQ(r.offset_bytes() % 128, 0) << r.name();
    region_bytes = std::max(region_bytes, r.offset_bytes() + r.size_bytes());
  }
  EXPECT_LE(region_bytes, alloc.allocated_bytes());
  EXPECT_EQ(ProbeHealth(worker.address(), ""), kServing);
  EXPECT_EQ(ProbeHealth(worker.address(), rpc::kWorkerServiceName), kServing);

  v1::LoadExpertsResponse loaded;
  ASSERT_TRUE(worker.Load(IdentityExperts(0), &loaded).ok());
  EXPECT_EQ(loaded.first_expert(), 0);
  EXPECT_EQ(loaded.num_local_experts(), 4);
  EXPECT_EQ(loaded.expert_bytes(), 0);

  v1::SyncTokenCountsResponse sync;
  ASSERT_TRUE(worker.Sync(1, 2, &sync).ok());
  EXPECT_THAT(sync.token_counts(), ElementsAre(2));
  EXPECT_EQ(sync.max_tokens(), 2);
  EXPECT_EQ(sync.runtime_max_tokens_per_rank(), 2);
  ASSERT_TRUE(worker.Commit(1, 2, 2).ok());

  v1::ForwardResponse out;
  grpc::Status s = worker.Forward(HandForward(1), &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(out.output().shape(), ElementsAre(2, 4));
  EXPECT_THAT(DecodeOutput(out.output()),
              ElementsAre(0.75f, 1.5f, 2.25f, 3.0f, 0.375f, -0.75f, 1.5f, 6.0f));
  EXPECT_EQ(out.runtime_max_tokens_per_rank(), 2);
  EXPECT_EQ(out.tokens_sent(), 2);  // each token once, to rank 0
  EXPECT_EQ(out.bytes_sent(), 0);   // nothing crosses to another rank

  // fp32 hidden states are accepted and rounded to bf16.
  v1::ForwardRequest fp32 = HandForward(1);
  const float x[8] = {1, 2, 3, 4, 0.5f, -1, 2, 8};
  *fp32.mutable_hidden_states() = EncodeFloat32(x, std::vector<int64_t>{2, 4});
  ASSERT_TRUE(worker.Forward(fp32, &out).ok());
  EXPECT_THAT(DecodeOutput(out.output()),
              ElementsAre(0.75f, 1.5f, 2.25f, 3.0f, 0.375f, -0.75f, 1.5f, 6.0f));

  v1::GetStatusResponse status = worker.Status();
  EXPECT_EQ(status.state(), v1::WORKER_STATE_ALLOCATED);
  EXPECT_EQ(status.counters().forwards(), 2);
  EXPECT_EQ(status.counters().tokens_dispatched(), 4);
  EXPECT_EQ(status.geometry_epoch(), 1);
  EXPECT_EQ(status.runtime_max_tokens_per_rank(), 2);
  EXPECT_EQ(status.capacity_tokens(), 8);
  EXPECT_EQ(status.workspace_bytes(), alloc.allocated_bytes());
  EXPECT_EQ(status.world_size(), 1);
  EXPECT_EQ(status.generation(), 1);
  EXPECT_EQ(status.device_name(), "cpu");

  ASSERT_TRUE(worker.Leave(1).ok());
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_STARTED);
  EXPECT_EQ(ProbeHealth(worker.address(), rpc::kReadinessServiceName), kNotServing);
  EXPECT_EQ(ProbeHealth(worker.address(), rpc::kLivenessServiceName), kServing);
  EXPECT_TRUE(worker.Leave(1).ok());  // idempotent
}

// At debug level each call of the one-rank flow says what it did, with the
// figures of its reply (issue 31 item 5); at info none of these lines is
// written.
TEST(WorkerService, DebugLogSaysWhatEachCallDid) {
  const std::shared_ptr<spdlog::logger> previous = spdlog::default_logger();
  std::ostringstream log;
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log);
  sink->set_pattern("%l %v");
  auto logger = std::make_shared<spdlog::logger>("debug-log-test", sink);
  logger->set_level(spdlog::level::debug);
  spdlog::set_default_logger(logger);
  // Restored however the test ends (an ASSERT returns early): later tests
  // must not log into this test's stream.
  absl::Cleanup restore = [&previous] { spdlog::set_default_logger(previous); };
  {
    InProcessWorker worker;
    SetUpOneRank(worker);
    ASSERT_TRUE(worker.Sync(1, 2).ok());
    ASSERT_TRUE(worker.Commit(1, 2, 2).ok());
    ASSERT_TRUE(worker.Forward(HandForward(1)).ok());
    logger->set_level(spdlog::level::info);
    ASSERT_TRUE(worker.Sync(2, 1).ok());
  }
  std::move(restore).Invoke();
  const std::string text = log.str();
  EXPECT_THAT(text, HasSubstr("debug Join: formed generation 1 as rank 0 of 1 (gloo backend"));
  EXPECT_THAT(text, HasSubstr("debug ConfigureLayers: planned 2 layers (1 sparse) for "
                              "hidden_size 4"));
  EXPECT_THAT(text, HasSubstr("debug AllocateWorkspace: new workspace ("));
  EXPECT_THAT(text, HasSubstr("capacity 8 tokens a rank)"));
  EXPECT_THAT(text, HasSubstr("debug LoadExperts: layer 0, 4 local experts from id 0"));
  EXPECT_THAT(text, HasSubstr("debug SyncTokenCounts: epoch 1, local 2 tokens, ranks [2] -> "
                              "runtime_max_tokens_per_rank 2"));
  EXPECT_THAT(text, HasSubstr("debug CommitGeometry: epoch 1, runtime_max_tokens_per_rank 2"));
  EXPECT_THAT(text, HasSubstr("debug Forward: layer 0, 2 tokens, 2 token-copies dispatched, "
                              "0 bytes to peers"));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("SyncTokenCounts: epoch 2")));
}

TEST(WorkerService, ZeroTokenForwardReturnsEmptyOutput) {
  InProcessWorker worker;
  SetUpOneRank(worker);
  ASSERT_TRUE(worker.Sync(1, 0).ok());
  ASSERT_TRUE(worker.Commit(1, 0, 0).ok());
  v1::ForwardRequest request;
  request.set_layer(0);
  request.set_epoch(1);
  *request.mutable_hidden_states() = EncodeBf16({}, std::vector<int64_t>{0, 4});
  *request.mutable_topk_ids() = EncodeInt32({}, std::vector<int64_t>{0, 2});
  *request.mutable_topk_weights() = EncodeFloat32({}, std::vector<int64_t>{0, 2});
  v1::ForwardResponse out;
  grpc::Status s = worker.Forward(request, &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_THAT(out.output().shape(), ElementsAre(0, 4));
  EXPECT_EQ(out.output().data().size(), 0u);
}

TEST(WorkerService, CallsInTheWrongStateAreFailedPrecondition) {
  InProcessWorker worker;
  const std::string before = StatusSnapshot(worker);
  ExpectError(worker.Configure(ConfigureRequest(1, {true})), grpc::StatusCode::FAILED_PRECONDITION,
              "ConfigureLayers requires state JOINED or later; worker is STARTED");
  ExpectError(worker.Allocate(AllocateRequest()), grpc::StatusCode::FAILED_PRECONDITION,
              "AllocateWorkspace requires state CONFIGURED");
  ExpectError(worker.Load(IdentityExperts(0)), grpc::StatusCode::FAILED_PRECONDITION,
              "LoadExperts requires state ALLOCATED");
  ExpectError(worker.Sync(1, 1), grpc::StatusCode::FAILED_PRECONDITION,
              "SyncTokenCounts requires state ALLOCATED");
  ExpectError(worker.Commit(1, 1, 1), grpc::StatusCode::FAILED_PRECONDITION,
              "CommitGeometry requires state ALLOCATED");
  ExpectError(worker.Forward(HandForward(1)), grpc::StatusCode::FAILED_PRECONDITION,
              "Forward requires state ALLOCATED");
  EXPECT_EQ(StatusSnapshot(worker), before);
  EXPECT_EQ(worker.Status().counters().errors(), 6);

  ASSERT_TRUE(worker.Join(1, 0, 1, "", "gloo").ok());
  const std::string joined = StatusSnapshot(worker);
  ExpectError(worker.Allocate(AllocateRequest()), grpc::StatusCode::FAILED_PRECONDITION,
              "worker is JOINED");
  ExpectError(worker.Forward(HandForward(1)), grpc::StatusCode::FAILED_PRECONDITION,
              "worker is JOINED");
  EXPECT_EQ(StatusSnapshot(worker), joined);
}

TEST(WorkerService, JoinRejectsBadInputWithoutChangingState) {
  InProcessWorker worker;
  const std::string before = StatusSnapshot(worker);
  ExpectError(worker.Join(0, 0, 1, "", "gloo"), grpc::StatusCode::INVALID_ARGUMENT, "world_size");
  ExpectError(worker.Join(2, 2, 1, "127.0.0.1:1", "gloo"), grpc::StatusCode::INVALID_ARGUMENT,
              "rank: expected in [0, 2) (world_size 2), got 2");
  ExpectError(worker.Join(2, -1, 1, "127.0.0.1:1", "gloo"), grpc::StatusCode::INVALID_ARGUMENT,
              "rank");
  ExpectError(worker.Join(1, 0, 0, "", "gloo"), grpc::StatusCode::INVALID_ARGUMENT, "generation");
  ExpectError(worker.Join(1, 0, 1, "", "gloo", -5), grpc::StatusCode::INVALID_ARGUMENT,
              "timeout_ms");
  ExpectError(worker.Join(2, 1, 1, "", "gloo"), grpc::StatusCode::INVALID_ARGUMENT,
              "rendezvous_address");
  ExpectError(worker.Join(1, 0, 1, "", "mpi", 1000), grpc::StatusCode::INVALID_ARGUMENT, "backend");
#ifndef MOE_EP_HAVE_CUDA
  ExpectError(worker.Join(1, 0, 1, "", "nccl", 1000), grpc::StatusCode::FAILED_PRECONDITION,
              "NCCL backend needs a CUDA build");
#endif
  EXPECT_EQ(StatusSnapshot(worker), before);
}

TEST(WorkerService, JoinIsIdempotentAndGenerationsAreFresh) {
  InProcessWorker worker;
  ASSERT_TRUE(worker.Join(1, 0, 1, "", "gloo").ok());
  ASSERT_TRUE(worker.Configure(ConfigureRequest(1, {true})).ok());
  EXPECT_TRUE(worker.Join(1, 0, 1, "", "gloo").ok());  // same arguments: nothing changes
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_CONFIGURED);
  ExpectError(worker.Join(1, 0, 1, "", "gloo", 5000), grpc::StatusCode::FAILED_PRECONDITION,
              "already joined generation 1");
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_CONFIGURED);
  ExpectError(worker.Leave(7), grpc::StatusCode::FAILED_PRECONDITION, "generation 7");
  ASSERT_TRUE(worker.Join(1, 0, 2, "", "gloo").ok());  // a new generation re-forms
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_JOINED);
  EXPECT_EQ(worker.Status().generation(), 2);
  ASSERT_TRUE(worker.Leave(0).ok());
  ExpectError(worker.Join(1, 0, 2, "", "gloo"), grpc::StatusCode::FAILED_PRECONDITION,
              "generation: 2 was already used");
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_STARTED);
}

TEST(WorkerService, ConfigureLayersRejectsBadInput) {
  InProcessWorker worker;
  ASSERT_TRUE(worker.Join(1, 0, 1, "", "gloo").ok());
  const std::string before = StatusSnapshot(worker);
  ExpectError(worker.Configure(ConfigureRequest(2, {true})), grpc::StatusCode::INVALID_ARGUMENT,
              "layout.tp_size: expected 1 (the world size), got 2");
  v1::ConfigureLayersRequest request = ConfigureRequest(1, {true, true});
  request.mutable_model()->set_num_layers(3);
  ExpectError(worker.Configure(request), grpc::StatusCode::INVALID_ARGUMENT,
              "model.sparse_layers: expected 3 entries");
  request = ConfigureRequest(1, {});
  ExpectError(worker.Configure(request), grpc::StatusCode::INVALID_ARGUMENT, "model.num_layers");
  request = ConfigureRequest(1, {true});
  request.mutable_model()->set_hidden_size(-4);
  ExpectError(worker.Configure(request), grpc::StatusCode::INVALID_ARGUMENT, "model.hidden_size");
  request = ConfigureRequest(1, {true});
  request.mutable_model()->set_top_k(5);
  ExpectError(worker.Configure(request), grpc::StatusCode::INVALID_ARGUMENT, "model.top_k");
  request = ConfigureRequest(1, {true});
  request.mutable_layout()->set_attn_dp_size(0);
  ExpectError(worker.Configure(request), grpc::StatusCode::INVALID_ARGUMENT, "layout");
  EXPECT_EQ(StatusSnapshot(worker), before);
}

TEST(WorkerService, AllocateWorkspaceRejectsBadInput) {
  InProcessWorker worker;
  ASSERT_TRUE(worker.Join(1, 0, 1, "", "gloo").ok());
  ASSERT_TRUE(worker.Configure(ConfigureRequest(1, {true})).ok());
  const std::string before = StatusSnapshot(worker);
  struct Case {
    std::function<void(v1::AllocateWorkspaceRequest&)> edit;
    std::string fragment;
  };
  const std::vector<Case> cases = {
      {[](auto& r) { r.set_hidden_size(0); }, "hidden_size: expected in [1, "},
      {[](auto& r) { r.set_hidden_size(-8); }, "hidden_size"},
      {[](auto& r) { r.set_top_k(0); }, "top_k: expected in [1, "},
      {[](auto& r) { r.set_top_k(5); }, "top_k: expected <= num_experts (4), got 5"},
      {[](auto& r) { r.set_num_experts(0); }, "num_experts"},
      {[](auto& r) { r.set_capacity_tokens(-1); }, "capacity_tokens: expected >= 0, got -1"},
      {[](auto& r) { r.set_chunked_prefill_size(-1); }, "chunked_prefill_size"},
      {[](auto& r) { r.set_dispatch_dtype(static_cast<v1::DispatchDType>(9)); }, "dispatch_dtype"},
      // Sized by DESIGN §5 but moved by no data plane: refused by name, before
      // any size formula (issue 15 item 4).
      {[](auto& r) { r.set_dispatch_dtype(v1::DISPATCH_DTYPE_NVFP4); },
       "workspace.dtype (dispatch_dtype): the CPU data plane moves bf16 or fp8_e4m3, got nvfp4"},
      {[](auto& r) { r.set_dispatch_dtype(v1::DISPATCH_DTYPE_MXFP8); },
       "the CPU data plane moves bf16 or fp8_e4m3, got mxfp8"},
      {[](auto& r) { r.set_dispatch_dtype(v1::DISPATCH_DTYPE_FP8_E4M3); },
       "multiple of 128 (the fp8_e4m3 scale block), got 4"},
      {[](auto& r) { r.set_invalid_expert_id(static_cast<v1::InvalidExpertId>(9)); },
       "invalid_expert_id"},
      {[](auto& r) {
         r.add_cuda_graph_buckets(4);
         r.add_cuda_graph_buckets(2);
       },
       "cuda_graph_buckets"},
      {[](auto& r) { r.set_hidden_size(8); }, "hidden_size: expected 4 (the configured model)"},
  };
  for (const Case& c : cases) {
    v1::AllocateWorkspaceRequest request = AllocateRequest();
    c.edit(request);
    ExpectError(worker.Allocate(request), grpc::StatusCode::INVALID_ARGUMENT, c.fragment);
  }
  EXPECT_EQ(StatusSnapshot(worker), before);
  EXPECT_EQ(worker.Status().state(), v1::WORKER_STATE_CONFIGURED);
}

// fp8 e4m3 dispatch through the service (issue 15 item 4): AllocateWorkspace
// reports DESIGN §5's bytes and the dequantized-rows region, and Forward's
// identity output is sum(w) = 0.75 times the e4m3-rounded row. Hand values:
// x_i = (i + 1) / 64 for i < 127 and x_127 = 7, so amax 7, scale 7 / 448 =
// 1/64 exactly and x / scale = i + 1: 17 ties between 16 and 18 -> 16
// (even mantissa), 19 ties between 18 and 20 -> 20, 101 -> 104 (ulp 8).
TEST(WorkerService, Fp8DispatchForwardsTheE4m3RoundedRows) {
  InProcessWorker worker;
  ASSERT_TRUE(worker.Join(1, 0, 1, worker.address(), "gloo").ok());
  v1::ConfigureLayersRequest configure = ConfigureRequest(1, {true});
  configure.mutable_model()->set_hidden_size(128);
  ASSERT_TRUE(worker.Configure(configure).ok());
  v1::AllocateWorkspaceRequest allocate = AllocateRequest();
  allocate.set_hidden_size(128);
  allocate.set_dispatch_dtype(v1::DISPATCH_DTYPE_FP8_E4M3);
  v1::AllocateWorkspaceResponse alloc;
  ASSERT_TRUE(worker.Allocate(allocate, &alloc).ok());
  EXPECT_EQ(alloc.dispatch_bytes_per_token(), 128 + 4 + 16);  // H + H/32 + 8K
  bool dequant_region = false;
  for (const v1::WorkspaceRegion& r : alloc.regions()) {
    if (r.name() == "dispatch_dequant") {
      dequant_region = true;
      EXPECT_EQ(r.size_bytes(), 8 * 128 * 2);  // [E = 1, N = 8, H] bf16
    }
  }
  EXPECT_TRUE(dequant_region);
  ASSERT_TRUE(worker.Load(IdentityExperts(0)).ok());
  ASSERT_TRUE(worker.Commit(1, 1, 1).ok());
  std::vector<core::bf16_t> hidden;
  hidden.reserve(128);
  for (int i = 0; i < 127; ++i) hidden.push_back(core::FloatToBf16((i + 1) / 64.0f));
  hidden.push_back(core::FloatToBf16(7.0f));
  const int32_t ids[2] = {0, 3};
  const float weights[2] = {0.25f, 0.5f};
  v1::ForwardRequest request;
  request.set_layer(0);
  request.set_epoch(1);
  *request.mutable_hidden_states() = EncodeBf16(hidden, std::vector<int64_t>{1, 128});
  *request.mutable_topk_ids() = EncodeInt32(ids, std::vector<int64_t>{1, 2});
  *request.mutable_topk_weights() = EncodeFloat32(weights, std::vector<int64_t>{1, 2});
  v1::ForwardResponse out;
  grpc::Status s = worker.Forward(request, &out);
  ASSERT_TRUE(s.ok()) << s.error_message();
  auto decoded = DecodeBf16(out.output(), "output", 2);
  ASSERT_TRUE(decoded.ok()) << decoded.status();
  std::vector<float> y;
  for (core::bf16_t v : decoded->values) y.push_back(core::Bf16ToFloat(v));
  ASSERT_EQ(y.size(), 128u);
  EXPECT_EQ(y[0], 0.75f * 1 / 64);
  EXPECT_EQ(y[15], 0.75f * 16 / 64);
  EXPECT_EQ(y[16], 0.75f * 16 / 64);  // 17 -> 16
  EXPECT_EQ(y[18], 0.75f * 20 / 64);  // 19 -> 20
  EXPECT_EQ(y[100], 0.75f * 104 / 64);
  EXPECT_EQ(y[127], 0.75f * 7);  // 448, the largest e4m3
  // The bf16 path would have returned 0.75 * 17/64 for the same input.
  EXPECT_NE(y[16], 0.75f * 17 / 64);
}

TEST(WorkerService, AllocateBeyondMemoryCapIsResourceExhaustedWithBothNumbers) {
  WorkerOptions options;
  options.memory_cap_bytes = 1000;
  InProcessWorker worker(options);
  ASSERT_TRUE(worker.Join(1, 0, 1, "", "gloo").ok());
  ASSERT_TRUE(worker.Configure(ConfigureRequest(1, {true})).ok());
  const std::string before = StatusSnapshot(worker);
  grpc::Status s = worker.Allocate(AllocateRequest());
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(s.error_message(), HasSubstr("memory cap of 1000 bytes"));
  EXPECT_THAT(s.error_message(), ::testing::ContainsRegex("needs [0-9]+ bytes"));
  EXPECT_EQ(StatusSnapshot(worker), before);
}

TEST(WorkerService, StepCallsRejectBadInputWithoutChangingState) {
  InProcessWorker worker;
  SetUpOneRank(worker);
  ASSERT_TRUE(worker.Sync(1, 2).ok());
  ASSERT_TRUE(worker.Commit(1, 2, 2).ok());
  const std::string before = StatusSnapshot(worker);

  // LoadExperts.
  v1::LoadExpertsRequest load = IdentityExperts(0);
  load.set_kind(v1::EXPERT_KIND_UNSPECIFIED);
  ExpectError(worker.Load(load), grpc::StatusCode::INVALID_ARGUMENT, "kind");
  ExpectError(worker.Load(IdentityExperts(1)), grpc::StatusCode::INVALID_ARGUMENT,
              "1 is a dense layer");
  ExpectError(worker.Load(IdentityExperts(2)), grpc::StatusCode::INVALID_ARGUMENT,
              "layer: expected in [0, 2)");
  ExpectError(worker.Load(IdentityExperts(-1)), grpc::StatusCode::INVALID_ARGUMENT, "layer");
  load = IdentityExperts(0);
  load.set_kind(v1::EXPERT_KIND_SWIGLU);  // no intermediate size anywhere
  ExpectError(worker.Load(load), grpc::StatusCode::INVALID_ARGUMENT, "intermediate_size");

  // SyncTokenCounts / CommitGeometry.
  ExpectError(worker.Sync(1, -1), grpc::StatusCode::INVALID_ARGUMENT, "local_tokens");
  ExpectError(worker.Sync(-1, 1), grpc::StatusCode::INVALID_ARGUMENT, "epoch");
  ExpectError(worker.Commit(2, 9, 1), grpc::StatusCode::RESOURCE_EXHAUSTED, "8");
  ExpectError(worker.Commit(2, 1, 2), grpc::StatusCode::INVALID_ARGUMENT, "2");
  ExpectError(worker.Commit(2, -1, 0), grpc::StatusCode::INVALID_ARGUMENT,
              "runtime_max_tokens_per_rank");

  // Forward.
  v1::ForwardRequest f = HandForward(1);
  f.mutable_hidden_states()->set_data(std::string(100, '\0'));
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT,
              "hidden_states.data: expected 16 bytes for shape [2, 4] bf16, got 100");
  f = HandForward(1);
  f.mutable_topk_ids()->set_dtype(static_cast<v1::DType>(42));
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT, "topk_ids.dtype");
  f = HandForward(1);
  f.mutable_topk_weights()->set_dtype(v1::DTYPE_INT32);
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT,
              "topk_weights.dtype: expected fp32, got int32");
  f = HandForward(1);
  f.mutable_hidden_states()->set_shape(1, -4);
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT, "hidden_states.shape[1]");
  f = HandForward(1);
  {
    const int32_t ids[3] = {0, 1, 2};
    const float w[3] = {0.5f, 0.25f, 0.25f};
    *f.mutable_topk_ids() = EncodeInt32(ids, std::vector<int64_t>{1, 3});
    *f.mutable_topk_weights() = EncodeFloat32(w, std::vector<int64_t>{1, 3});
  }
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT,
              "topk_ids.shape[0]: expected 2 (hidden_states rows), got 1");
  f = HandForward(1);
  {
    const int32_t ids[6] = {0, 1, 2, 0, 1, 2};
    const float w[6] = {0.5f, 0.25f, 0.25f, 0.5f, 0.25f, 0.25f};
    *f.mutable_topk_ids() = EncodeInt32(ids, std::vector<int64_t>{2, 3});
    *f.mutable_topk_weights() = EncodeFloat32(w, std::vector<int64_t>{2, 3});
  }
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT,
              "topk_ids.shape[1]: expected 2 (the allocated top_k), got 3");
  f = HandForward(1);
  {
    std::vector<core::bf16_t> h(16, core::FloatToBf16(1.0f));
    *f.mutable_hidden_states() = EncodeBf16(h, std::vector<int64_t>{2, 8});
  }
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT,
              "hidden_states.shape[1]: expected 4 (the allocated hidden_size), got 8");
  f = HandForward(1);
  f.mutable_topk_weights()->clear_shape();
  ExpectError(worker.Forward(f), grpc::StatusCode::INVALID_ARGUMENT, "topk_weights.shape");
  f = HandForward(1);
  f.set_layer(1);
  ExpectError(worker.Forward(f), grpc::StatusCode::FAILED_PRECONDITION,
              "layer 1 has no loaded experts");
  ExpectError(worker.Forward(HandForward(5)), grpc::StatusCode::FAILED_PRECONDITION,
              "epoch 5 does not match the committed geometry epoch 1");

  EXPECT_EQ(StatusSnapshot(worker), before);
  // And the worker still works.
  v1::ForwardResponse out;
  ASSERT_TRUE(worker.Forward(HandForward(1), &out).ok());
  EXPECT_THAT(DecodeOutput(out.output()),
              ElementsAre(0.75f, 1.5f, 2.25f, 3.0f, 0.375f, -0.75f, 1.5f, 6.0f));
}

TEST(WorkerService, LoadExpertsCountsSwiGluBytes) {
  InProcessWorker worker;
  SetUpOneRank(worker);
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_SWIGLU);
  load.set_seed(7);
  load.set_intermediate_size(6);
  v1::LoadExpertsResponse response;
  ASSERT_TRUE(worker.Load(load, &response).ok());
  // 4 experts x (gate + up + down) x I*H x 2 bytes = 4 * 3 * 24 * 2.
  EXPECT_EQ(response.expert_bytes(), 4 * 3 * 6 * 4 * 2);
  EXPECT_EQ(worker.Status().expert_bytes(), 4 * 3 * 6 * 4 * 2);
  ASSERT_TRUE(worker.Load(IdentityExperts(0)).ok());  // replaces the layer's experts
  EXPECT_EQ(worker.Status().expert_bytes(), 0);
}

TEST(WorkerService, BenchmarkReportsLatenciesAndLogicalBytes) {
  InProcessWorker worker;
  ASSERT_TRUE(worker.Join(1, 0, 1, "", "gloo").ok());
  v1::BenchmarkRequest request;
  request.set_tokens_per_rank(8);
  request.set_hidden_size(16);
  request.set_top_k(2);
  request.set_num_experts(4);
  request.set_routing("skewed");
  request.set_iterations(3);
  request.set_warmup(1);
  request.set_seed(1);
  v1::BenchmarkResponse response;
  grpc::Status s = worker.Call(&v1::Worker::Stub::Benchmark, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  // One rank: every token goes once to rank 0. Dispatch 2H + 8K = 48 bytes a
  // token, combine 2H = 32.
  EXPECT_EQ(response.dispatch_bytes(), 8 * 48);
  EXPECT_EQ(response.combine_bytes(), 8 * 32);
  EXPECT_GT(response.dispatch_p50_us(), 0.0);
  EXPECT_GE(response.dispatch_p99_us(), response.dispatch_p50_us());
  EXPECT_GE(response.combine_p99_us(), response.combine_p50_us());
  EXPECT_GT(response.dispatch_logical_gbps(), 0.0);

  request.set_routing("zipf");
  ExpectError(worker.Call(&v1::Worker::Stub::Benchmark, request, &response),
              grpc::StatusCode::INVALID_ARGUMENT, "routing");
  request.set_routing("uniform");
  request.set_top_k(5);
  ExpectError(worker.Call(&v1::Worker::Stub::Benchmark, request, &response),
              grpc::StatusCode::INVALID_ARGUMENT, "top_k");
}

// Benchmark's data_plane "" is the group's plane: one rank leaving it empty
// and the other naming "gloo" run the same Benchmark (they were refused as
// different fields); a plane the group is not on still differs.
TEST(WorkerService, BenchmarkReadsTheGroupsOwnPlaneAsTheDefault) {
  InProcessWorker workers[2];
  const std::string rendezvous = workers[0].address();
  grpc::Status status[2];
  OnAllRanks(2, [&](int r) { status[r] = workers[r].Join(2, r, 1, rendezvous, "gloo", 5000); });
  ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0].error_message();
  v1::BenchmarkRequest request;
  request.set_tokens_per_rank(4);
  request.set_hidden_size(16);
  request.set_top_k(2);
  request.set_num_experts(4);
  request.set_iterations(2);
  request.set_seed(1);
  v1::BenchmarkResponse response[2];
  OnAllRanks(2, [&](int r) {
    v1::BenchmarkRequest mine = request;
    mine.set_data_plane(r == 0 ? "" : "gloo");
    status[r] = workers[r].Call(&v1::Worker::Stub::Benchmark, mine, &response[r]);
  });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  // Each rank's own tokens: 4 tokens of 2H + 8K = 48 bytes to 1 or 2 ranks.
  for (int r = 0; r < 2; ++r) {
    EXPECT_GE(response[r].dispatch_bytes(), 4 * 48) << "rank " << r;
    EXPECT_LE(response[r].dispatch_bytes(), 2 * 4 * 48) << "rank " << r;
  }
  OnAllRanks(2, [&](int r) {
    v1::BenchmarkRequest mine = request;
    mine.set_data_plane(r == 0 ? "" : "nccl");
    status[r] = workers[r].Call(&v1::Worker::Stub::Benchmark, mine, &response[r]);
  });
  EXPECT_FALSE(status[0].ok());
  EXPECT_FALSE(status[1].ok());
  EXPECT_THAT(status[0].error_message() + status[1].error_message(), HasSubstr("data_plane"));
}

TEST(WorkerService, TwoRanksFormGroupCheckConfigsAndForward) {
  InProcessWorker rank0;
  InProcessWorker rank1;
  InProcessWorker* workers[2] = {&rank0, &rank1};
  const std::string rendezvous = rank0.address();
  grpc::Status status[2];

  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Join(2, r, 1, rendezvous, "gloo", 5000); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  EXPECT_EQ(rank1.Status().rank(), 1);
  EXPECT_EQ(rank1.Status().world_size(), 2);

  v1::ConfigureLayersResponse plan[2];
  OnAllRanks(2, [&](int r) {
    status[r] = workers[r]->Configure(ConfigureRequest(2, {true, true}), &plan[r]);
  });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  EXPECT_EQ(plan[0].fingerprint(), plan[1].fingerprint());

  // Rank 1 gets a different sparse pattern: both ranks refuse, naming rank 1,
  // and keep the configuration they had.
  const std::string before0 = StatusSnapshot(rank0);
  const std::string before1 = StatusSnapshot(rank1);
  OnAllRanks(2, [&](int r) {
    status[r] = workers[r]->Configure(ConfigureRequest(2, {true, r == 0}));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r].error_code(), grpc::StatusCode::ABORTED) << status[r].error_message();
    EXPECT_THAT(status[r].error_message(), HasSubstr("rank 1"));
  }
  EXPECT_EQ(StatusSnapshot(rank0), before0);
  EXPECT_EQ(StatusSnapshot(rank1), before1);

  // num_experts below the world size on rank 0: it says why, rank 1 (whose
  // request is fine) is ABORTED naming rank 0 and its error (the vote).
  v1::AllocateWorkspaceRequest few = AllocateRequest();
  few.set_num_experts(1);
  few.set_top_k(1);
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Allocate(r == 0 ? few : AllocateRequest()); });
  ExpectError(status[0], grpc::StatusCode::INVALID_ARGUMENT,
              "num_experts: expected >= 2 (the world size");
  ExpectError(status[1], grpc::StatusCode::ABORTED,
              "rank 0 rejected its AllocateWorkspace request: INVALID_ARGUMENT: num_experts");

  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Allocate(AllocateRequest()); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  v1::LoadExpertsResponse loaded[2];
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Load(IdentityExperts(0), &loaded[r]); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  EXPECT_EQ(loaded[0].first_expert(), 0);
  EXPECT_EQ(loaded[1].first_expert(), 2);
  EXPECT_EQ(loaded[1].num_local_experts(), 2);

  // Rank 0 has the two hand tokens, rank 1 none.
  v1::SyncTokenCountsResponse sync[2];
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Sync(1, r == 0 ? 2 : 0, &sync[r]); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  for (int r = 0; r < 2; ++r) {
    EXPECT_THAT(sync[r].token_counts(), ElementsAre(2, 0));
    EXPECT_EQ(sync[r].runtime_max_tokens_per_rank(), 2);
  }
  ASSERT_TRUE(rank0.Commit(1, 2, 2).ok());
  ASSERT_TRUE(rank1.Commit(1, 2, 0).ok());

  v1::ForwardRequest empty;
  empty.set_layer(0);
  empty.set_epoch(1);
  *empty.mutable_hidden_states() = EncodeBf16({}, std::vector<int64_t>{0, 4});
  *empty.mutable_topk_ids() = EncodeInt32({}, std::vector<int64_t>{0, 2});
  *empty.mutable_topk_weights() = EncodeFloat32({}, std::vector<int64_t>{0, 2});
  v1::ForwardResponse out[2];
  OnAllRanks(
      2, [&](int r) { status[r] = workers[r]->Forward(r == 0 ? HandForward(1) : empty, &out[r]); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  EXPECT_THAT(DecodeOutput(out[0].output()),
              ElementsAre(0.75f, 1.5f, 2.25f, 3.0f, 0.375f, -0.75f, 1.5f, 6.0f));
  EXPECT_THAT(out[1].output().shape(), ElementsAre(0, 4));
  // Token 0 goes to ranks {0 (expert 0), 1 (expert 3)}, token 1 to rank 0: 3 sends.
  EXPECT_EQ(out[0].tokens_sent(), 3);
  EXPECT_EQ(out[1].tokens_received(), 1);
  EXPECT_GT(out[0].bytes_sent(), 0);

  // Rank 1 leaves: rank 0's next collective fails and breaks its group; later
  // collectives say to re-join; a new generation recovers.
  ASSERT_TRUE(rank1.Leave(1).ok());
  grpc::Status broken = rank0.Sync(2, 1);
  EXPECT_TRUE(broken.error_code() == grpc::StatusCode::UNAVAILABLE ||
              broken.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED)
      << broken.error_message();
  // Broken: not ready, but alive (a liveness probe must not restart it).
  EXPECT_EQ(ProbeHealth(rank0.address(), rpc::kReadinessServiceName), kNotServing);
  EXPECT_EQ(ProbeHealth(rank0.address(), rpc::kLivenessServiceName), kServing);
  ExpectError(rank0.Sync(2, 1), grpc::StatusCode::FAILED_PRECONDITION,
              "re-join with a new generation");
  ExpectError(rank0.Join(2, 0, 1, rendezvous, "gloo", 5000), grpc::StatusCode::FAILED_PRECONDITION,
              "re-join with a new generation");
  OnAllRanks(2, [&](int r) { status[r] = workers[r]->Join(2, r, 2, rendezvous, "gloo", 5000); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  EXPECT_EQ(rank0.Status().state(), v1::WORKER_STATE_JOINED);
  EXPECT_EQ(rank0.Status().generation(), 2);
}

// Echo (test-only, worker.proto): with --enable-echo it returns the request's
// tensor byte for byte, at any rank and dtype and in any state; bad tensors
// are INVALID_ARGUMENT; without the flag it is UNIMPLEMENTED.
TEST(WorkerService, EchoReturnsTheRequestTensorOnlyWhenEnabled) {
  WorkerOptions options;
  options.enable_echo = true;
  InProcessWorker worker(options);
  const std::string before = StatusSnapshot(worker);
  const float x[6] = {1.5f, -2, 0, 3.25f, 1e30f, -0.0f};
  v1::EchoRequest request;
  *request.mutable_tensor() = EncodeFloat32(x, std::vector<int64_t>{1, 2, 3});
  v1::EchoResponse response;
  grpc::Status s = worker.Call(&v1::Worker::Stub::Echo, request, &response);
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(response.tensor().dtype(), v1::DTYPE_FP32);
  EXPECT_THAT(response.tensor().shape(), ElementsAre(1, 2, 3));
  EXPECT_EQ(response.tensor().data(), std::string(reinterpret_cast<const char*>(x), sizeof(x)));
  EXPECT_EQ(StatusSnapshot(worker), before);  // no state, not even a counter

  // A large bf16 tensor comes back unchanged, and so does an empty one.
  std::vector<core::bf16_t> big(3 * 4099);
  for (size_t i = 0; i < big.size(); ++i) big[i] = static_cast<core::bf16_t>(i * 2654435761u);
  *request.mutable_tensor() = EncodeBf16(big, std::vector<int64_t>{3, 4099});
  ASSERT_TRUE(worker.Call(&v1::Worker::Stub::Echo, request, &response).ok());
  EXPECT_EQ(response.tensor().data(), request.tensor().data());
  EXPECT_THAT(response.tensor().shape(), ElementsAre(3, 4099));
  *request.mutable_tensor() = EncodeInt32({}, std::vector<int64_t>{0, 8});
  ASSERT_TRUE(worker.Call(&v1::Worker::Stub::Echo, request, &response).ok());
  EXPECT_EQ(response.tensor().dtype(), v1::DTYPE_INT32);
  EXPECT_THAT(response.tensor().shape(), ElementsAre(0, 8));
  EXPECT_EQ(response.tensor().data(), "");

  request.mutable_tensor()->set_data("abc");
  ExpectError(worker.Call(&v1::Worker::Stub::Echo, request, &response),
              grpc::StatusCode::INVALID_ARGUMENT,
              "tensor.data: expected 0 bytes for shape [0, 8] int32, got 3");
  request.mutable_tensor()->set_dtype(v1::DTYPE_UNSPECIFIED);
  ExpectError(worker.Call(&v1::Worker::Stub::Echo, request, &response),
              grpc::StatusCode::INVALID_ARGUMENT, "tensor.dtype");

  InProcessWorker off;  // the default: no --enable-echo
  *request.mutable_tensor() = EncodeFloat32(x, std::vector<int64_t>{6});
  ExpectError(off.Call(&v1::Worker::Stub::Echo, request, &response),
              grpc::StatusCode::UNIMPLEMENTED, "started with --enable-echo");
}

}  // namespace
}  // namespace worker_service_test
}  // namespace moe_ep::server
