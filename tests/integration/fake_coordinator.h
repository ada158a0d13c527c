#pragma once

// The fake coordinator of the integration tests: real moe-ep-worker processes
// on loopback (client::LocalCluster), driven either through the real
// client::Coordinator or through raw per-rank stubs, so a test can misbehave
// (send rank 1 a different config, commit different R, kill a worker).
// Source: DESIGN §8 ("Integration tests drive real worker processes with a
// fake coordinator"), issue 2.

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/coordinator.h"
#include "client/local_cluster.h"
#include "core/bf16.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::testing {

namespace v1 = ::moe_ep::v1;

// A small MoE layer shape every test uses unless it says otherwise.
struct SmallModel {
  int64_t hidden = 64;
  int num_experts = 10;  // 10 % 4 != 0: uneven placement on 4 ranks
  int top_k = 3;
  int64_t intermediate = 32;
  int num_layers = 2;
};

// One rank's inputs of one step, seeded.
struct RankInputs {
  int64_t num_tokens = 0;
  std::vector<core::bf16_t> hidden;  // [T, H]
  std::vector<int32_t> ids;          // [T, K]
  std::vector<float> weights;        // [T, K]
};

// Deterministic inputs: hidden uniform in [-1, 1), K distinct ids per token,
// weights uniform in (0, 1]; `invalid_every` > 0 replaces every n-th id with -1.
RankInputs MakeInputs(uint64_t seed, int64_t num_tokens, const SmallModel& model,
                      int invalid_every = 0);

v1::ForwardRequest MakeForwardRequest(int layer, int64_t epoch, const RankInputs& in,
                                      const SmallModel& model);
std::vector<float> DecodeBf16(const v1::Tensor& tensor);
// An fp32 [rows, cols] tensor of `values`, and the floats of an fp32 tensor
// (ForwardLayers' tokens and output).
v1::Tensor Fp32Tensor(const std::vector<float>& values, int64_t rows, int64_t cols);
std::vector<float> FloatsOf(const v1::Tensor& t);

// A bf16 output `got` against an fp32 reference `want`, both [rows, hidden]:
// every element within one bf16 rounding of the result plus one of each
// per-rank partial sum (<= K terms), 4 * 2^-7 of its row's largest |want|
// (+ 1e-6). Adds a failure naming `what`, the row and the column.
void ExpectClose(const std::vector<float>& got, const std::vector<float>& want, int64_t hidden,
                 const std::string& what);

v1::ConfigureLayersRequest MakeConfigureRequest(int world, const SmallModel& model);
v1::AllocateWorkspaceRequest MakeAllocateRequest(const SmallModel& model, int64_t capacity_tokens);
// A channel to `target` that is READY (within 20 s; UNAVAILABLE naming the
// target otherwise). gRPC 1.51 (Debian's) can fail a fresh channel's first
// connect spuriously under load ("No such file or directory"; grpc/grpc#35064)
// and a fail-fast RPC on it then never reaches the worker: tests that send one
// on a channel of their own connect it here first.
absl::StatusOr<std::shared_ptr<grpc::Channel>> ConnectedChannel(const std::string& target);

// A small Benchmark: 32 tokens a rank, H 128, top-4 of 8 experts, uniform
// routing of seed 3, 1 warm-up and 5 timed iterations.
v1::BenchmarkRequest MakeBenchmarkRequest();

class FakeCoordinator {
 public:
  // Starts `num_workers` workers of `backend` with `extra_args` and
  // connects. `rank_masks`: the coordinator's Join sends every rank's
  // address (client::CoordinatorOptions::rank_masks; DESIGN §15). The worker
  // binary is $MOE_EP_WORKER_BINARY when set (a bundle on the GPU machine),
  // else the build's.
  static absl::StatusOr<std::unique_ptr<FakeCoordinator>> Start(
      int num_workers, std::vector<std::string> extra_args = {}, bool rank_masks = false,
      const std::string& backend = "gloo");

  client::LocalCluster& cluster() { return *cluster_; }
  client::Coordinator& coordinator() { return *coordinator_; }
  v1::Worker::Stub& stub(int rank) { return *stubs_[rank]; }

  // Restarts worker `rank` on its address (client::LocalCluster::Restart)
  // and gives stub(rank) a fresh channel: the old one saw the worker die and
  // may sit in reconnect backoff, where a call fails at once (UNAVAILABLE)
  // without reaching the new process while its peers wait in a collective.
  absl::Status RestartWorker(int rank);
  int world() const { return static_cast<int>(stubs_.size()); }

  // Join, ConfigureLayers, AllocateWorkspace, LoadExperts (every layer) on all ranks.
  absl::Status SetUp(const SmallModel& model, int64_t capacity_tokens,
                     v1::ExpertKind kind = v1::EXPERT_KIND_SWIGLU, uint64_t seed = 7);

  // Calls `fn(rank)` on one thread per rank and returns each rank's status.
  template <typename Fn>
  std::vector<absl::Status> OnEachRank(Fn fn);

  v1::GetStatusResponse StatusOf(int rank);

 private:
  std::unique_ptr<client::LocalCluster> cluster_;
  std::unique_ptr<client::Coordinator> coordinator_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;
};

}  // namespace moe_ep::testing

#include <thread>

template <typename Fn>
std::vector<absl::Status> moe_ep::testing::FakeCoordinator::OnEachRank(Fn fn) {
  std::vector<absl::Status> results(world());
  std::vector<std::thread> threads;
  for (int r = 0; r < world(); ++r) {
    threads.emplace_back([&, r] { results[r] = fn(r); });
  }
  for (auto& t : threads) t.join();
  return results;
}
