#include "tests/integration/fake_coordinator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>

#include "absl/strings/str_cat.h"
#include "client/grpc_status.h"
#include "core/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"

namespace moe_ep::testing {

RankInputs MakeInputs(uint64_t seed, int64_t num_tokens, const SmallModel& model,
                      int invalid_every) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  RankInputs in;
  in.num_tokens = num_tokens;
  in.hidden.resize(num_tokens * model.hidden);
  for (auto& h : in.hidden) h = core::FloatToBf16(value(rng));
  in.ids.resize(num_tokens * model.top_k);
  in.weights.resize(num_tokens * model.top_k);
  std::vector<int32_t> experts(model.num_experts);
  for (int e = 0; e < model.num_experts; ++e) experts[e] = e;
  int64_t n = 0;
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::shuffle(experts.begin(), experts.end(), rng);
    for (int k = 0; k < model.top_k; ++k, ++n) {
      in.ids[n] = (invalid_every > 0 && n % invalid_every == invalid_every - 1) ? -1 : experts[k];
      in.weights[n] = weight(rng);
    }
  }
  return in;
}

absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectedChannel(const std::string& target) {
  std::shared_ptr<grpc::Channel> channel =
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials());
  if (!channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20))) {
    return absl::UnavailableError(
        absl::StrCat("fake coordinator: the channel to ", target, " was not ready within 20 s"));
  }
  return channel;
}

namespace {

template <typename T>
void SetTensor(v1::Tensor* tensor, v1::DType dtype, const std::vector<int64_t>& shape,
               const std::vector<T>& values) {
  tensor->set_dtype(dtype);
  for (int64_t d : shape) tensor->add_shape(d);
  tensor->set_data(
      std::string(reinterpret_cast<const char*>(values.data()), values.size() * sizeof(T)));
}
}  // namespace

v1::ForwardRequest MakeForwardRequest(int layer, int64_t epoch, const RankInputs& in,
                                      const SmallModel& model) {
  v1::ForwardRequest request;
  request.set_layer(layer);
  request.set_epoch(epoch);
  SetTensor(request.mutable_hidden_states(), v1::DTYPE_BF16, {in.num_tokens, model.hidden},
            in.hidden);
  SetTensor(request.mutable_topk_ids(), v1::DTYPE_INT32, {in.num_tokens, model.top_k}, in.ids);
  SetTensor(request.mutable_topk_weights(), v1::DTYPE_FP32, {in.num_tokens, model.top_k},
            in.weights);
  return request;
}

std::vector<float> DecodeBf16(const v1::Tensor& tensor) {
  std::vector<float> out(tensor.data().size() / 2);
  for (size_t i = 0; i < out.size(); ++i) {
    core::bf16_t v;
    std::memcpy(&v, tensor.data().data() + 2 * i, 2);
    out[i] = core::Bf16ToFloat(v);
  }
  return out;
}

v1::Tensor Fp32Tensor(const std::vector<float>& values, int64_t rows, int64_t cols) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_FP32);
  t.add_shape(rows);
  t.add_shape(cols);
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 4));
  return t;
}

std::vector<float> FloatsOf(const v1::Tensor& t) {
  std::vector<float> out(t.data().size() / 4);
  std::memcpy(out.data(), t.data().data(), out.size() * 4);
  return out;
}

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

v1::ConfigureLayersRequest MakeConfigureRequest(int world, const SmallModel& model) {
  v1::ConfigureLayersRequest request;
  request.mutable_layout()->set_tp_size(world);
  request.mutable_layout()->set_attn_dp_size(world);
  request.set_a2a_enabled(true);
  v1::ModelDescription* m = request.mutable_model();
  m->set_name("integration-small");
  m->set_hidden_size(model.hidden);
  m->set_num_layers(model.num_layers);
  m->set_num_experts(model.num_experts);
  m->set_top_k(model.top_k);
  m->set_moe_intermediate_size(model.intermediate);
  for (int l = 0; l < model.num_layers; ++l) m->add_sparse_layers(true);
  return request;
}

v1::AllocateWorkspaceRequest MakeAllocateRequest(const SmallModel& model, int64_t capacity_tokens) {
  v1::AllocateWorkspaceRequest request;
  request.set_hidden_size(model.hidden);
  request.set_top_k(model.top_k);
  request.set_num_experts(model.num_experts);
  request.set_capacity_tokens(capacity_tokens);
  request.set_dispatch_dtype(v1::DISPATCH_DTYPE_BF16);
  request.set_invalid_expert_id(v1::INVALID_EXPERT_ID_MINUS_ONE);
  return request;
}

v1::BenchmarkRequest MakeBenchmarkRequest() {
  v1::BenchmarkRequest bench;
  bench.set_tokens_per_rank(32);
  bench.set_hidden_size(128);
  bench.set_top_k(4);
  bench.set_num_experts(8);
  bench.set_routing("uniform");
  bench.set_iterations(5);
  bench.set_warmup(1);
  bench.set_seed(3);
  return bench;
}

absl::StatusOr<std::unique_ptr<FakeCoordinator>> FakeCoordinator::Start(
    int num_workers, std::vector<std::string> extra_args, bool rank_masks,
    const std::string& backend) {
  auto fake = std::make_unique<FakeCoordinator>();
  client::LocalClusterOptions options;
  options.num_workers = num_workers;
  options.backend = backend;
  const char* bundled = std::getenv("MOE_EP_WORKER_BINARY");
  options.worker_binary = bundled != nullptr && bundled[0] != '\0'
                              ? std::string(bundled)
                              : std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  options.extra_args = std::move(extra_args);
  options.stop_timeout = absl::Seconds(5);
  ASSIGN_OR_RETURN(fake->cluster_, client::LocalCluster::Start(options));
  client::CoordinatorOptions coordinator_options;
  coordinator_options.backend = backend;
  coordinator_options.rpc_timeout = absl::Seconds(30);
  coordinator_options.group_timeout = absl::Seconds(5);
  coordinator_options.rank_masks = rank_masks;
  ASSIGN_OR_RETURN(fake->coordinator_,
                   client::Coordinator::Connect(fake->cluster_->targets(), coordinator_options));
  RETURN_IF_ERROR(fake->coordinator_->WaitReady(absl::Seconds(20)));
  for (const std::string& target : fake->cluster_->targets()) {
    ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel, ConnectedChannel(target));
    fake->stubs_.push_back(v1::Worker::NewStub(channel));
  }
  return fake;
}

absl::Status FakeCoordinator::RestartWorker(int rank) {
  RETURN_IF_ERROR(cluster_->Restart(rank));
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::Channel> channel,
                   ConnectedChannel(cluster_->targets()[rank]));
  stubs_[rank] = v1::Worker::NewStub(channel);
  return absl::OkStatus();
}

absl::Status FakeCoordinator::SetUp(const SmallModel& model, int64_t capacity_tokens,
                                    v1::ExpertKind kind, uint64_t seed) {
  RETURN_IF_ERROR(coordinator_->FormGroup().status());
  RETURN_IF_ERROR(coordinator_->ConfigureLayers(MakeConfigureRequest(world(), model)).status());
  RETURN_IF_ERROR(
      coordinator_->AllocateWorkspace(MakeAllocateRequest(model, capacity_tokens)).status());
  for (int layer = 0; layer < model.num_layers; ++layer) {
    v1::LoadExpertsRequest load;
    load.set_layer(layer);
    load.set_kind(kind);
    load.set_seed(seed);
    load.set_intermediate_size(model.intermediate);
    RETURN_IF_ERROR(coordinator_->LoadExperts(load).status());
  }
  return absl::OkStatus();
}

v1::GetStatusResponse FakeCoordinator::StatusOf(int rank) {
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::GetStatusResponse response;
  stubs_[rank]->GetStatus(&context, v1::GetStatusRequest(), &response);
  return response;
}

}  // namespace moe_ep::testing
