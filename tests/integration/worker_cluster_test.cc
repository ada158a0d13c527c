// Integration tests: real moe-ep-worker processes on loopback, driven by the
// fake coordinator (tests/integration/fake_coordinator.h). Issue 2 "Tests".

#include <csignal>
#include <numeric>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "client/grpc_status.h"
#include "core/expert_placement.h"
#include "core/experts.h"
#include "core/moe_reference.h"
#include "gmock/gmock.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "tests/integration/fake_coordinator.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

// Single-process reference of one layer for rank inputs: sum_k w_k e_k(x)
// with all experts generated from the same seed as the workers.
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

// Runs one step (sync, commit, forward of `layer`) and returns the outputs.
absl::StatusOr<std::vector<v1::ForwardResponse>> Step(FakeCoordinator& fake, int layer,
                                                      int64_t epoch,
                                                      const std::vector<RankInputs>& inputs,
                                                      const SmallModel& model) {
  std::vector<int64_t> counts;
  counts.reserve(inputs.size());
  for (const auto& in : inputs) counts.push_back(in.num_tokens);
  auto sync = fake.coordinator().SyncTokenCounts(epoch, counts);
  if (!sync.ok()) return sync.status();
  EXPECT_EQ(sync->max_tokens, *std::max_element(counts.begin(), counts.end()));
  EXPECT_EQ(sync->token_counts, counts);
  absl::Status commit =
      fake.coordinator().CommitGeometry(epoch, sync->runtime_max_tokens_per_rank, counts);
  if (!commit.ok()) return commit;
  std::vector<v1::ForwardRequest> requests;
  requests.reserve(inputs.size());
  for (const auto& in : inputs) requests.push_back(MakeForwardRequest(layer, epoch, in, model));
  return fake.coordinator().Forward(requests);
}

TEST(WorkerCluster, TwoRanksIdentityExpertsGiveWeightedSum) {
  auto fake = FakeCoordinator::Start(2);
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;
  ASSERT_TRUE((*fake)->SetUp(model, 64, v1::EXPERT_KIND_IDENTITY).ok());
  std::vector<RankInputs> inputs = {MakeInputs(1, 9, model), MakeInputs(2, 4, model)};
  auto out = Step(**fake, 0, 1, inputs, model);
  ASSERT_TRUE(out.ok()) << out.status();
  for (int r = 0; r < 2; ++r) {
    // Identity experts: output = (sum_k w_k) * x, computed here by hand.
    std::vector<float> want(inputs[r].num_tokens * model.hidden);
    for (int64_t t = 0; t < inputs[r].num_tokens; ++t) {
      float w = 0;
      for (int k = 0; k < model.top_k; ++k) w += inputs[r].weights[t * model.top_k + k];
      for (int64_t h = 0; h < model.hidden; ++h) {
        want[t * model.hidden + h] = w * core::Bf16ToFloat(inputs[r].hidden[t * model.hidden + h]);
      }
    }
    ExpectClose(DecodeBf16((*out)[r].output()), want, model.hidden, "rank " + std::to_string(r));
    EXPECT_EQ((*out)[r].runtime_max_tokens_per_rank(), 9);
  }
}

TEST(WorkerCluster, FourRanksSwiGluWithZeroTokenRankMatchesDenseReference) {
  auto fake = FakeCoordinator::Start(4);
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;  // 10 experts on 4 ranks: 3, 3, 2, 2
  ASSERT_TRUE((*fake)->SetUp(model, 32, v1::EXPERT_KIND_SWIGLU, 11).ok());
  // Rank 1 has no tokens; rank 3 has invalid ids in its rows.
  std::vector<RankInputs> inputs = {MakeInputs(5, 7, model), MakeInputs(6, 0, model),
                                    MakeInputs(7, 3, model), MakeInputs(8, 12, model, 4)};
  for (int layer = 0; layer < model.num_layers; ++layer) {
    auto out = Step(**fake, layer, layer + 1, inputs, model);
    ASSERT_TRUE(out.ok()) << out.status();
    for (int r = 0; r < 4; ++r) {
      const v1::Tensor& t = (*out)[r].output();
      ASSERT_EQ(t.shape_size(), 2);
      EXPECT_EQ(t.shape(0), inputs[r].num_tokens);
      EXPECT_EQ(t.shape(1), model.hidden);
      ExpectClose(DecodeBf16(t), Reference(model, v1::EXPERT_KIND_SWIGLU, 11, layer, inputs[r]),
                  model.hidden, "layer " + std::to_string(layer) + " rank " + std::to_string(r));
    }
  }
  // Each worker holds only its own experts: 3, 3, 2, 2 of 10.
  auto statuses = (*fake)->coordinator().Status();
  ASSERT_TRUE(statuses.ok());
  int64_t per_expert = 3 * model.hidden * model.intermediate * 2 * model.num_layers;
  EXPECT_EQ((*statuses)[0].expert_bytes(), 3 * per_expert);
  EXPECT_EQ((*statuses)[3].expert_bytes(), 2 * per_expert);
}

TEST(WorkerCluster, RuntimeMaxAboveCapacityIsResourceExhaustedAndChangesNothing) {
  auto fake = FakeCoordinator::Start(2);
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;
  ASSERT_TRUE((*fake)->SetUp(model, 16, v1::EXPERT_KIND_IDENTITY).ok());
  // Counts [20, 3] with capacity N = 16: SyncTokenCounts reports R > N.
  auto sync = (*fake)->coordinator().SyncTokenCounts(1, {20, 3});
  ASSERT_FALSE(sync.ok());
  EXPECT_EQ(sync.status().code(), absl::StatusCode::kResourceExhausted) << sync.status();
  EXPECT_THAT(std::string(sync.status().message()), HasSubstr("16"));
  EXPECT_THAT(std::string(sync.status().message()), HasSubstr("20"));
  // CommitGeometry with R = 17 > 16 is refused with both numbers; R stays.
  absl::Status commit = (*fake)->coordinator().CommitGeometry(2, 17, {3, 3});
  EXPECT_EQ(commit.code(), absl::StatusCode::kResourceExhausted) << commit;
  EXPECT_THAT(std::string(commit.message()), HasSubstr("17"));
  EXPECT_EQ((*fake)->StatusOf(0).runtime_max_tokens_per_rank(), 0);
  // The group is still usable at R = N.
  std::vector<RankInputs> inputs = {MakeInputs(1, 16, model), MakeInputs(2, 1, model)};
  EXPECT_TRUE(Step(**fake, 0, 3, inputs, model).ok());
}

TEST(WorkerCluster, ConfigThatDiffersAcrossRanksIsAborted) {
  auto fake = FakeCoordinator::Start(2);
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->coordinator().FormGroup().ok());
  SmallModel model;
  std::vector<absl::Status> results = (*fake)->OnEachRank([&](int rank) {
    v1::ConfigureLayersRequest request = MakeConfigureRequest(2, model);
    if (rank == 1)
      request.mutable_model()->set_num_layers(3), request.mutable_model()->add_sparse_layers(false);
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ConfigureLayersResponse response;
    return client::ToAbslStatus((*fake)->stub(rank).ConfigureLayers(&context, request, &response));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kAborted) << results[r];
    EXPECT_THAT(std::string(results[r].message()), HasSubstr("rank"));
    // Nothing was configured on either rank.
    EXPECT_EQ((*fake)->StatusOf(r).state(), v1::WORKER_STATE_JOINED);
  }
}

TEST(WorkerCluster, RanksCommittingDifferentRuntimeMaxAbortTheForward) {
  auto fake = FakeCoordinator::Start(2);
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;
  ASSERT_TRUE((*fake)->SetUp(model, 64, v1::EXPERT_KIND_IDENTITY).ok());
  std::vector<RankInputs> inputs = {MakeInputs(1, 5, model), MakeInputs(2, 5, model)};
  std::vector<absl::Status> results = (*fake)->OnEachRank([&](int rank) -> absl::Status {
    v1::CommitGeometryRequest commit;
    commit.set_epoch(1);
    commit.set_runtime_max_tokens_per_rank(rank == 0 ? 8 : 12);  // the bug of sglang 30242
    commit.set_local_tokens(5);
    v1::CommitGeometryResponse commit_response;
    grpc::ClientContext commit_context;
    absl::Status s = client::ToAbslStatus(
        (*fake)->stub(rank).CommitGeometry(&commit_context, commit, &commit_response));
    if (!s.ok()) return s;
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::ForwardResponse response;
    return client::ToAbslStatus((*fake)->stub(rank).Forward(
        &context, MakeForwardRequest(0, 1, inputs[rank], model), &response));
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(results[r].code(), absl::StatusCode::kAborted) << results[r];
    EXPECT_THAT(std::string(results[r].message()), HasSubstr("12"));
  }
  // Both ranks agree again on the next epoch and the step goes through.
  EXPECT_TRUE(Step(**fake, 0, 2, inputs, model).ok());
}

TEST(WorkerCluster, KilledWorkerFailsPeersInBoundedTimeAndSurvivorsRejoin) {
  auto fake = FakeCoordinator::Start(3);
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;
  ASSERT_TRUE((*fake)->SetUp(model, 64, v1::EXPERT_KIND_IDENTITY).ok());
  ASSERT_TRUE((*fake)->cluster().Kill(2, SIGKILL).ok());
  // The two survivors try a collective; the group timeout is 5 s.
  absl::Time start = absl::Now();
  std::vector<absl::Status> results = (*fake)->OnEachRank([&](int rank) -> absl::Status {
    if (rank == 2) return absl::OkStatus();
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    v1::SyncTokenCountsRequest request;
    request.set_epoch(1);
    request.set_local_tokens(3);
    v1::SyncTokenCountsResponse response;
    return client::ToAbslStatus((*fake)->stub(rank).SyncTokenCounts(&context, request, &response));
  });
  EXPECT_LT(absl::Now() - start, absl::Seconds(20));
  for (int r = 0; r < 2; ++r) {
    EXPECT_TRUE(results[r].code() == absl::StatusCode::kUnavailable ||
                results[r].code() == absl::StatusCode::kDeadlineExceeded)
        << "rank " << r << ": " << results[r];
  }
  // The survivors form a new group of 2 (new generation) and run a step.
  std::vector<std::string> survivors = {(*fake)->cluster().targets()[0],
                                        (*fake)->cluster().targets()[1]};
  client::CoordinatorOptions options;
  options.group_timeout = absl::Seconds(5);
  options.rpc_timeout = absl::Seconds(30);
  auto coordinator = client::Coordinator::Connect(survivors, options);
  ASSERT_TRUE(coordinator.ok());
  auto joined = (*coordinator)->FormGroup();
  ASSERT_TRUE(joined.ok()) << joined.status();
  ASSERT_TRUE((*coordinator)->ConfigureLayers(MakeConfigureRequest(2, model)).ok());
  ASSERT_TRUE((*coordinator)->AllocateWorkspace(MakeAllocateRequest(model, 64)).ok());
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_IDENTITY);
  ASSERT_TRUE((*coordinator)->LoadExperts(load).ok());
  auto sync = (*coordinator)->SyncTokenCounts(1, {2, 3});
  ASSERT_TRUE(sync.ok()) << sync.status();
  EXPECT_EQ(sync->runtime_max_tokens_per_rank, 3);
}

TEST(WorkerCluster, BadTensorOverTheWireIsInvalidArgumentAndStateUnchanged) {
  auto fake = FakeCoordinator::Start(1);
  ASSERT_TRUE(fake.ok()) << fake.status();
  SmallModel model;
  ASSERT_TRUE((*fake)->SetUp(model, 16, v1::EXPERT_KIND_IDENTITY).ok());
  ASSERT_TRUE((*fake)->coordinator().SyncTokenCounts(1, {2}).ok());
  ASSERT_TRUE((*fake)->coordinator().CommitGeometry(1, 2, {2}).ok());
  v1::GetStatusResponse before = (*fake)->StatusOf(0);
  v1::ForwardRequest request = MakeForwardRequest(0, 1, MakeInputs(1, 2, model), model);
  request.mutable_hidden_states()->mutable_data()->resize(100);
  grpc::ClientContext context;
  v1::ForwardResponse response;
  grpc::Status status = (*fake)->stub(0).Forward(&context, request, &response);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("hidden_states"));
  v1::GetStatusResponse after = (*fake)->StatusOf(0);
  EXPECT_EQ(after.state(), before.state());
  EXPECT_EQ(after.counters().forwards(), before.counters().forwards());
  EXPECT_EQ(after.geometry_epoch(), before.geometry_epoch());
}

TEST(WorkerCluster, HealthIsNotServingUntilJoinedAndAllocated) {
  auto fake = FakeCoordinator::Start(1);
  ASSERT_TRUE(fake.ok()) << fake.status();
  absl::StatusOr<std::shared_ptr<grpc::Channel>> channel =
      ConnectedChannel((*fake)->cluster().targets()[0]);
  ASSERT_TRUE(channel.ok()) << channel.status();
  auto health = grpc::health::v1::Health::NewStub(*channel);
  auto check = [&] {
    grpc::ClientContext context;
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("moe_ep.v1.Worker");
    grpc::health::v1::HealthCheckResponse response;
    EXPECT_TRUE(health->Check(&context, request, &response).ok());
    return response.status();
  };
  EXPECT_EQ(check(), grpc::health::v1::HealthCheckResponse::NOT_SERVING);
  ASSERT_TRUE((*fake)->SetUp(SmallModel(), 16, v1::EXPERT_KIND_IDENTITY).ok());
  EXPECT_EQ(check(), grpc::health::v1::HealthCheckResponse::SERVING);
}

TEST(WorkerCluster, LateRankWithinGroupTimeoutStillCompletesTheCollective) {
  auto fake = FakeCoordinator::Start(2);
  ASSERT_TRUE(fake.ok()) << fake.status();
  ASSERT_TRUE((*fake)->SetUp(SmallModel(), 16, v1::EXPERT_KIND_IDENTITY).ok());
  // Rank 1 arrives 1.5 s after rank 0 (the group timeout is 5 s).
  std::vector<absl::Status> results = (*fake)->OnEachRank([&](int rank) -> absl::Status {
    if (rank == 1) absl::SleepFor(absl::Milliseconds(1500));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
    v1::SyncTokenCountsRequest request;
    request.set_epoch(1);
    request.set_local_tokens(rank == 0 ? 4 : 9);
    v1::SyncTokenCountsResponse response;
    absl::Status s =
        client::ToAbslStatus((*fake)->stub(rank).SyncTokenCounts(&context, request, &response));
    if (s.ok() && response.runtime_max_tokens_per_rank() != 9) {
      return absl::InternalError("R = " + std::to_string(response.runtime_max_tokens_per_rank()));
    }
    return s;
  });
  EXPECT_TRUE(results[0].ok()) << results[0];
  EXPECT_TRUE(results[1].ok()) << results[1];
}

TEST(WorkerCluster, SigtermStopsWorkerCleanly) {
  auto fake = FakeCoordinator::Start(1);
  ASSERT_TRUE(fake.ok()) << fake.status();
  pid_t pid = (*fake)->cluster().pid(0);
  ASSERT_EQ(kill(pid, SIGTERM), 0);
  absl::Time deadline = absl::Now() + absl::Seconds(10);
  while ((*fake)->cluster().IsRunning(0) && absl::Now() < deadline)
    absl::SleepFor(absl::Milliseconds(20));
  EXPECT_FALSE((*fake)->cluster().IsRunning(0));
}

}  // namespace
}  // namespace moe_ep::testing
