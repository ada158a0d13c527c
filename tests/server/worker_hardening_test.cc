// Bad and hostile calls against one in-process worker (issue 13 items 2-7,
// 9): each is refused with the code that fits, without crashing the worker,
// and leaves it as it was.

#include <limits>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/request_limits.h"
#include "server/worker_service.h"
#include "tests/server/in_process_worker.h"

namespace moe_ep::server {
namespace worker_hardening_test {
namespace {

using ::testing::HasSubstr;
using testing::InProcessWorker;
using ::testing::Not;

v1::ConfigureLayersRequest OneSparseLayer(int64_t hidden, int64_t intermediate) {
  v1::ConfigureLayersRequest request;
  request.mutable_layout()->set_tp_size(1);
  request.mutable_layout()->set_attn_dp_size(1);
  request.set_a2a_enabled(true);
  v1::ModelDescription* model = request.mutable_model();
  model->set_hidden_size(hidden);
  model->set_num_layers(1);
  model->set_num_experts(4);
  model->set_top_k(2);
  model->set_moe_intermediate_size(intermediate);
  model->add_sparse_layers(true);
  return request;
}

v1::AllocateWorkspaceRequest Allocation(int64_t hidden) {
  v1::AllocateWorkspaceRequest request;
  request.set_hidden_size(hidden);
  request.set_top_k(2);
  request.set_num_experts(4);
  request.set_capacity_tokens(8);
  return request;
}

// World 1, generation 1, hidden 4, ALLOCATED.
void Allocate(InProcessWorker& worker, int64_t hidden = 4) {
  ASSERT_TRUE(worker.Join(1, 0, 1, worker.address(), "gloo").ok());
  ASSERT_TRUE(worker.Configure(OneSparseLayer(hidden, 0)).ok());
  ASSERT_TRUE(worker.Allocate(Allocation(hidden)).ok());
}

std::string Snapshot(InProcessWorker& worker) {
  v1::GetStatusResponse status = worker.Status();
  status.mutable_counters()->set_errors(0);
  return status.SerializeAsString();
}

TEST(WorkerHardening, AnAllocationTheRequestSizedThatFailsIsResourceExhausted) {
  // No memory cap, limits raised so that the request reaches the allocation:
  // 4 experts x 3 x I 16384 x H 2^20 x 2 bytes = 412 GB, more than any host
  // here, so the allocation throws std::bad_alloc (before: the process aborted).
  WorkerOptions options;
  options.limits.max_hidden = int64_t{1} << 20;
  InProcessWorker worker(options);
  Allocate(worker, int64_t{1} << 20);
  const std::string before = Snapshot(worker);
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_SWIGLU);
  load.set_intermediate_size(16384);
  const grpc::Status status = worker.Load(load);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED) << status.error_message();
  EXPECT_EQ(Snapshot(worker), before);
}

TEST(WorkerHardening, AGenerationAboveTheLimitIsRefusedAndDoesNotPoisonLaterJoins) {
  InProcessWorker worker;
  const grpc::Status huge =
      worker.Join(2, 0, std::numeric_limits<int64_t>::max(), "127.0.0.1:1", "gloo", 200);
  EXPECT_EQ(huge.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << huge.error_message();
  EXPECT_THAT(huge.error_message(), HasSubstr("--max-generation"));
  EXPECT_EQ(worker.Status().max_generation_seen(), 0);
  const grpc::Status later = worker.Join(1, 0, 1, worker.address(), "gloo");
  EXPECT_TRUE(later.ok()) << later.error_message();
}

// Issue 13 item 3: a Join at the top of the range (2^53, the default
// --max-generation) leaves the next generation usable, and a Join far above
// it (2^63 - 2, 2^63 - 1) is refused, actionably, without using anything up.
TEST(WorkerHardening, TheTopOfTheGenerationRangeNeverLocksJoinOut) {
  InProcessWorker worker;
  const int64_t top = int64_t{1} << 53;
  const grpc::Status at_top = worker.Join(1, 0, top, worker.address(), "gloo");
  ASSERT_TRUE(at_top.ok()) << at_top.error_message();
  EXPECT_EQ(worker.Status().max_generation_seen(), top);
  // The clients' choice, 1 + the highest generation seen, still forms.
  for (int64_t g = top + 1; g <= top + 3; ++g) {
    const grpc::Status next = worker.Join(1, 0, g, worker.address(), "gloo");
    ASSERT_TRUE(next.ok()) << g << ": " << next.error_message();
    EXPECT_EQ(worker.Status().generation(), g);
  }
  const std::string before = Snapshot(worker);
  for (const int64_t huge :
       {std::numeric_limits<int64_t>::max() - 1, std::numeric_limits<int64_t>::max()}) {
    const grpc::Status refused = worker.Join(1, 0, huge, worker.address(), "gloo");
    EXPECT_EQ(refused.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << refused.error_message();
    EXPECT_THAT(refused.error_message(),
                HasSubstr(absl::StrCat("generation: expected <= ", top + 4, " (--max-generation ",
                                       top, ", or 1 + the highest generation this worker saw, ",
                                       top + 3, "), got ", huge)));
    EXPECT_THAT(refused.error_message(), HasSubstr("max_generation_seen"));
    EXPECT_EQ(Snapshot(worker), before);
  }
  const grpc::Status after = worker.Join(1, 0, top + 4, worker.address(), "gloo");
  EXPECT_TRUE(after.ok()) << after.error_message();
  EXPECT_EQ(worker.Status().generation(), top + 4);
}

TEST(WorkerHardening, AFailedJoinKeepsTheOldGroupAndReportsTheGenerationItSaw) {
  InProcessWorker worker;
  Allocate(worker);
  // Generation 2: rank 0 of 2, its store unreachable -> the join fails.
  const grpc::Status failed = worker.Join(2, 0, 2, "127.0.0.1:1", "gloo", 300);
  EXPECT_FALSE(failed.ok());
  v1::GetStatusResponse status = worker.Status();
  EXPECT_EQ(status.state(), v1::WORKER_STATE_ALLOCATED);
  EXPECT_EQ(status.generation(), 1);
  EXPECT_EQ(status.world_size(), 1);
  EXPECT_EQ(status.max_generation_seen(), 2);
  // The old group still works (a collective on it).
  v1::SyncTokenCountsResponse counts;
  ASSERT_TRUE(worker.Sync(0, 3, &counts).ok());
  EXPECT_EQ(counts.max_tokens(), 3);
  // Generation 2 is used; above it forming works.
  EXPECT_EQ(worker.Join(1, 0, 2, worker.address(), "gloo").error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  const grpc::Status next =
      worker.Join(1, 0, status.max_generation_seen() + 1, worker.address(), "gloo");
  EXPECT_TRUE(next.ok()) << next.error_message();
  EXPECT_EQ(worker.Status().generation(), 3);
}

TEST(WorkerHardening, RequestSizesBeyondTheLimitsAreInvalidArgumentNamingTheFlag) {
  InProcessWorker worker;
  Allocate(worker);
  const std::string before = Snapshot(worker);
  v1::BenchmarkRequest bench;
  bench.set_tokens_per_rank(16);
  bench.set_hidden_size(4);
  bench.set_top_k(1024);
  bench.set_num_experts(65536);
  bench.set_iterations(1);
  v1::BenchmarkResponse ignored;
  grpc::Status status = worker.Benchmark(bench, &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(status.error_message(), HasSubstr("--max-top-k"));
  const grpc::Status world = worker.Join(std::numeric_limits<int32_t>::max(), 0, 5, "x:1", "gloo");
  EXPECT_EQ(world.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(world.error_message(), HasSubstr("--max-world-size"));
  EXPECT_EQ(Snapshot(worker), before);
}

TEST(WorkerHardening, LongErrorMessagesAreCutSoTheyKeepTheirCode) {
  InProcessWorker worker;
  Allocate(worker);
  v1::BenchmarkRequest bench;
  bench.set_tokens_per_rank(4);
  bench.set_hidden_size(4);
  bench.set_top_k(2);
  bench.set_num_experts(4);
  bench.set_iterations(1);
  bench.set_routing(std::string(20000, 'z'));
  v1::BenchmarkResponse ignored;
  const grpc::Status status = worker.Benchmark(bench, &ignored);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << status.error_message();
  EXPECT_LE(status.error_message().size(), kMaxErrorMessageBytes + 40);
  EXPECT_THAT(status.error_message(), HasSubstr("bytes cut"));
}

TEST(WorkerHardening, CheckpointsOutsideTheCheckpointDirectoriesAreRefusedUnread) {
  WorkerOptions options;
  options.checkpoint_dirs = {::testing::TempDir()};
  InProcessWorker worker(options);
  Allocate(worker);
  const std::string before = Snapshot(worker);
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_SWIGLU);
  load.set_intermediate_size(8);
  load.set_name_pattern("{layer}.{expert}.{proj}");
  load.set_safetensors_path("/etc/passwd");
  const grpc::Status status = worker.Load(load);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::PERMISSION_DENIED) << status.error_message();
  EXPECT_THAT(status.error_message(), Not(HasSubstr("root")));
  EXPECT_EQ(Snapshot(worker), before);
}

}  // namespace
}  // namespace worker_hardening_test
}  // namespace moe_ep::server
