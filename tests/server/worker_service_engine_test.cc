// The engine's in-process data calls (server/worker_service_engine.cc,
// core/engine_call_round.h; issue 30 item 1) on two in-process Gloo
// workers: the readiness contract (data calls refused until every rank
// waited, the wait holding until every sparse layer is loaded on every
// rank), and the opening round of each call (ranks in different calls,
// a refused call, the call order and out-of-range ids all end with nothing
// moved and the group usable: the next step is exact).

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/tensor_codec.h"
#include "tests/server/in_process_worker.h"

namespace moe_ep::server {
namespace worker_service_engine_test {
namespace {

using ::testing::HasSubstr;
using testing::InProcessWorker;
using testing::OnAllRanks;
using testing::OneLayerOverTwoRanks;

constexpr int64_t kHidden = 4;
constexpr int kTopK = 2;
constexpr int64_t kRows = 4;  // R and the receive rows of every step here

v1::AllocateWorkspaceRequest Allocate() {
  v1::AllocateWorkspaceRequest request;
  request.set_hidden_size(kHidden);
  request.set_top_k(kTopK);
  request.set_num_experts(4);
  request.set_capacity_tokens(8);
  request.set_dispatch_dtype(v1::DISPATCH_DTYPE_BF16);
  return request;
}

// One rank's inputs: token t of rank r is x = (10 r + t + 1) in every
// element, routed to `ids`.
struct Inputs {
  std::vector<core::bf16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  int64_t tokens = 0;
};

Inputs MakeInputs(int rank, std::vector<int32_t> ids) {
  Inputs in;
  in.tokens = static_cast<int64_t>(ids.size()) / kTopK;
  in.ids = std::move(ids);
  for (int64_t t = 0; t < in.tokens; ++t) {
    for (int64_t h = 0; h < kHidden; ++h) {
      in.hidden.push_back(core::FloatToBf16(static_cast<float>(10 * rank + t + 1)));
    }
    in.weights.push_back(0.5f);
    in.weights.push_back(0.25f);
  }
  return in;
}

// The caller's receive buffers of one rank.
struct Received {
  std::vector<core::bf16_t> hidden = std::vector<core::bf16_t>(2 * kRows * kHidden);
  std::vector<int32_t> ids = std::vector<int32_t>(2 * kRows * kTopK);
  std::vector<float> weights = std::vector<float>(2 * kRows * kTopK);
  std::array<int64_t, 2> source_counts{};
  std::array<int64_t, 2> expert_counts{};
  EngineRecvBuffers Buffers() {
    EngineRecvBuffers out;
    out.rows = kRows;
    out.hidden = hidden.data();
    out.topk_ids = ids.data();
    out.topk_weights = weights.data();
    out.source_counts = source_counts.data();
    out.expert_counts = expert_counts.data();
    return out;
  }
};

class EngineCallsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    workers_[0] = std::make_unique<InProcessWorker>();
    workers_[1] = std::make_unique<InProcessWorker>();
    const std::string rendezvous = workers_[0]->address();
    grpc::Status status[2];
    OnAllRanks(2, [&](int r) { status[r] = workers_[r]->Join(2, r, 1, rendezvous, "gloo", 8000); });
    ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0].error_message();
    OnAllRanks(2,
               [&](int r) { status[r] = workers_[r]->Configure(OneLayerOverTwoRanks(kHidden)); });
    ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0].error_message();
    OnAllRanks(2, [&](int r) { status[r] = workers_[r]->Allocate(Allocate()); });
    ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0].error_message();
  }

  WorkerService& Service(int r) { return workers_[r]->service(); }

  absl::Status Load(int r) {
    v1::LoadExpertsRequest load;
    load.set_layer(0);
    load.set_kind(v1::EXPERT_KIND_IDENTITY);
    const grpc::Status s = workers_[r]->Load(load);
    return absl::Status(static_cast<absl::StatusCode>(s.error_code()), s.error_message());
  }

  // Both ranks ready for steps of their own experts, and (epoch, R) committed.
  void ReadyAndCommit(int64_t epoch) {
    absl::Status ready[2];
    OnAllRanks(2, [&](int r) {
      ready[r] = Service(r).WaitReadyForSteps(false, absl::Now() + absl::Seconds(20));
    });
    ASSERT_TRUE(ready[0].ok()) << ready[0];
    ASSERT_TRUE(ready[1].ok()) << ready[1];
    Commit(epoch);
  }

  void Commit(int64_t epoch) {
    for (int r = 0; r < 2; ++r) ASSERT_TRUE(workers_[r]->Commit(epoch, kRows, 0).ok());
  }

  // `slot_timeout`: the engine call's timeout_ms (the wait for the call slot).
  absl::Status Dispatch(int r, const Inputs& in, Received* out,
                        absl::Duration slot_timeout = absl::Seconds(20)) {
    return Service(r).RunOnDataPlane("moe_ep_dispatch", absl::Now() + slot_timeout, true,
                                     [&](DataPlane& plane, const core::EpDispatcherOptions&) {
                                       return plane
                                           .EngineDispatch(in.hidden.data(), in.ids.data(),
                                                           in.weights.data(), in.tokens,
                                                           out->Buffers(), nullptr)
                                           .status();
                                     });
  }

  // Each destination returns the received rows as its expert outputs, so
  // the combine of token t is (number of destination ranks) * x.
  absl::Status Combine(int r, const Received& in, std::vector<core::bf16_t>* output,
                       int64_t tokens) {
    output->assign(tokens * kHidden, core::FloatToBf16(-1.0f));
    return Service(r).RunOnDataPlane(
        "moe_ep_combine", absl::Now() + absl::Seconds(20), true,
        [&](DataPlane& plane, const core::EpDispatcherOptions&) {
          return plane.EngineCombine(in.hidden.data(), kRows, output->data(), nullptr).status();
        });
  }

  // One whole step on both ranks, checked: rank 0's t0 goes to both ranks,
  // the others to one.
  void ExactStep(const char* when) {
    SCOPED_TRACE(when);
    const Inputs in[2] = {MakeInputs(0, {0, 2, 1, -1}), MakeInputs(1, {3, -1, 2, 3})};
    Received received[2];
    absl::Status status[2];
    OnAllRanks(2, [&](int r) { status[r] = Dispatch(r, in[r], &received[r]); });
    ASSERT_TRUE(status[0].ok()) << status[0];
    ASSERT_TRUE(status[1].ok()) << status[1];
    EXPECT_EQ(received[0].source_counts, (std::array<int64_t, 2>{2, 0}));
    EXPECT_EQ(received[1].source_counts, (std::array<int64_t, 2>{1, 2}));
    EXPECT_EQ(received[1].expert_counts, (std::array<int64_t, 2>{2, 2}));  // experts 2, 3
    std::vector<core::bf16_t> output[2];
    OnAllRanks(2, [&](int r) { status[r] = Combine(r, received[r], &output[r], in[r].tokens); });
    ASSERT_TRUE(status[0].ok()) << status[0];
    ASSERT_TRUE(status[1].ok()) << status[1];
    EXPECT_EQ(core::Bf16ToFloat(output[0][0]), 2.0f * 1);  // t0 of rank 0: two destinations
    EXPECT_EQ(core::Bf16ToFloat(output[0][kHidden]), 2.0f);
    EXPECT_EQ(core::Bf16ToFloat(output[1][kHidden]), 12.0f);
  }

  std::unique_ptr<InProcessWorker> workers_[2];
};

TEST_F(EngineCallsTest, DataCallsWaitForEveryRankAndEveryLayer) {
  // Before any wait: refused at once, naming the contract.
  Received received;
  const absl::Status early = Dispatch(0, MakeInputs(0, {0, 1}), &received);
  EXPECT_EQ(early.code(), absl::StatusCode::kFailedPrecondition) << early;
  EXPECT_THAT(std::string(early.message()),
              HasSubstr("moe_ep_dispatch: rank 0 is not ready for steps: no wait for readiness "
                        "has completed in the group of generation 1"));
  // The worker's experts: not loaded, so the wait says which layers.
  const absl::Status missing =
      Service(1).WaitReadyForSteps(true, absl::Now() + absl::Milliseconds(200));
  EXPECT_EQ(missing.code(), absl::StatusCode::kDeadlineExceeded) << missing;
  EXPECT_THAT(std::string(missing.message()),
              HasSubstr("sparse layers [0] of the plan have no experts loaded on rank 1"));

  // Both ranks wait while the orchestrator loads rank 0, then rank 1: they
  // return only after the second load, together.
  absl::Status ready[2];
  absl::Time returned[2];
  std::thread waiters([&] {
    OnAllRanks(2, [&](int r) {
      ready[r] = Service(r).WaitReadyForSteps(true, absl::Now() + absl::Seconds(20));
      returned[r] = absl::Now();
    });
  });
  absl::SleepFor(absl::Milliseconds(300));
  ASSERT_TRUE(Load(0).ok());
  absl::SleepFor(absl::Milliseconds(300));
  const absl::Time second_load = absl::Now();
  ASSERT_TRUE(Load(1).ok());
  waiters.join();
  ASSERT_TRUE(ready[0].ok()) << ready[0];
  ASSERT_TRUE(ready[1].ok()) << ready[1];
  EXPECT_GE(returned[0], second_load);
  EXPECT_GE(returned[1], second_load);
  Commit(1);
  ExactStep("after the wait");

  // A new allocation (another capacity) ends readiness on every rank.
  v1::AllocateWorkspaceRequest bigger = Allocate();
  bigger.set_capacity_tokens(16);
  grpc::Status allocated[2];
  OnAllRanks(2, [&](int r) { allocated[r] = workers_[r]->Allocate(bigger); });
  ASSERT_TRUE(allocated[0].ok() && allocated[1].ok()) << allocated[0].error_message();
  const absl::Status after = Dispatch(1, MakeInputs(1, {0, 1}), &received);
  EXPECT_EQ(after.code(), absl::StatusCode::kFailedPrecondition) << after;
  EXPECT_THAT(std::string(after.message()),
              HasSubstr("the workspace was re-allocated since the last wait"));
}

TEST_F(EngineCallsTest, MismatchedCallsAndRefusalsMoveNothing) {
  ReadyAndCommit(1);
  // Rank 0 dispatches while rank 1 combines (with no dispatch): each
  // returns at once, nothing is exchanged.
  Received received[2];
  std::vector<core::bf16_t> output;
  absl::Status status[2];
  OnAllRanks(2, [&](int r) {
    status[r] = r == 0 ? Dispatch(0, MakeInputs(0, {0, 2}), &received[0])
                       : Combine(1, received[1], &output, 0);
  });
  EXPECT_EQ(status[0].code(), absl::StatusCode::kAborted) << status[0];
  EXPECT_THAT(std::string(status[0].message()),
              HasSubstr("rank 1 is in moe_ep_combine (engine call 0), this rank (0) in "
                        "moe_ep_dispatch (engine call 0)"));
  EXPECT_EQ(status[1].code(), absl::StatusCode::kFailedPrecondition) << status[1];
  EXPECT_THAT(std::string(status[1].message()),
              HasSubstr("moe_ep_combine: combine needs a dispatch first"));
  ExactStep("after ranks in different calls");

  // An id outside [0, 4) that is not the invalid id -1, on rank 1 only.
  const Inputs bad[2] = {MakeInputs(0, {0, 1}), MakeInputs(1, {2, 7})};
  OnAllRanks(2, [&](int r) { status[r] = Dispatch(r, bad[r], &received[r]); });
  EXPECT_EQ(status[1].code(), absl::StatusCode::kInvalidArgument) << status[1];
  EXPECT_THAT(std::string(status[1].message()),
              HasSubstr("topk_ids[row 0, choice 1] = 7: outside [0, 4) and not the invalid "
                        "expert id -1"));
  EXPECT_EQ(status[0].code(), absl::StatusCode::kAborted) << status[0];
  EXPECT_THAT(std::string(status[0].message()), HasSubstr("rank 1 rejected its input"));
  ExactStep("after an out-of-range id");

  // A second dispatch before the combine: refused on both, naming the order.
  const Inputs in[2] = {MakeInputs(0, {0, 1}), MakeInputs(1, {2, 3})};
  OnAllRanks(2, [&](int r) { status[r] = Dispatch(r, in[r], &received[r]); });
  ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0];
  OnAllRanks(2, [&](int r) { status[r] = Dispatch(r, in[r], &received[r]); });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r].code(), absl::StatusCode::kFailedPrecondition) << status[r];
    EXPECT_THAT(
        std::string(status[r].message()),
        HasSubstr("a dispatch is in flight on rank " + std::to_string(r) + ": call combine first"));
  }
  // Combine with too few rows on rank 0: INVALID_ARGUMENT, rank 1 ABORTED,
  // the step stays dispatched on both and the call goes through again.
  OnAllRanks(2, [&](int r) {
    output.clear();
    std::vector<core::bf16_t> out(in[r].tokens * kHidden);
    status[r] = Service(r).RunOnDataPlane("moe_ep_combine", absl::Now() + absl::Seconds(20), true,
                                          [&](DataPlane& plane, const core::EpDispatcherOptions&) {
                                            return plane
                                                .EngineCombine(received[r].hidden.data(),
                                                               r == 0 ? kRows - 1 : kRows,
                                                               out.data(), nullptr)
                                                .status();
                                          });
  });
  EXPECT_EQ(status[0].code(), absl::StatusCode::kInvalidArgument) << status[0];
  EXPECT_THAT(std::string(status[0].message()),
              HasSubstr("the step stays dispatched on every rank: call again"));
  EXPECT_EQ(status[1].code(), absl::StatusCode::kAborted) << status[1];
  EXPECT_THAT(std::string(status[1].message()),
              HasSubstr("rank 0 refused its moe_ep_combine (INVALID_ARGUMENT"));
  std::vector<core::bf16_t> outputs[2];
  OnAllRanks(2, [&](int r) { status[r] = Combine(r, received[r], &outputs[r], in[r].tokens); });
  ASSERT_TRUE(status[0].ok()) << status[0];
  ASSERT_TRUE(status[1].ok()) << status[1];
  EXPECT_EQ(core::Bf16ToFloat(outputs[0][0]), 1.0f);  // one destination each
  ExactStep("after order errors");

  // The host token agreement is one round of the same kind.
  int64_t counts[2][2] = {};
  OnAllRanks(2, [&](int r) {
    const int64_t local = 3 + r;
    status[r] =
        Service(r).RunOnDataPlane("moe_ep_sync_token_counts", absl::Now() + absl::Seconds(20), true,
                                  [&](DataPlane& plane, const core::EpDispatcherOptions&) {
                                    return plane.EngineSyncTokenCounts(&local, counts[r], nullptr);
                                  });
  });
  ASSERT_TRUE(status[0].ok() && status[1].ok()) << status[0];
  EXPECT_EQ(counts[0][0], 3);
  EXPECT_EQ(counts[0][1], 4);
  EXPECT_EQ(counts[1][1], 4);
  EXPECT_FALSE(workers_[0]->Status().group_broken());
  EXPECT_FALSE(workers_[1]->Status().group_broken());
}

// server/moe_ep.h: a data call's timeout_ms bounds only its wait for the
// collective slot; the collective is bounded by the group's timeout (8 s
// here). A peer 3.5 s late to a dispatch whose timeout is 200 ms is a slow
// peer, not a broken group: both ranks get their rows and the group serves
// on. (It broke the group when the call's deadline, plus the 2 s
// kCollectiveGrace, bounded the collective.)
TEST_F(EngineCallsTest, APeerLaterThanTheCallTimeoutIsWaitedFor) {
  ReadyAndCommit(1);
  const Inputs in[2] = {MakeInputs(0, {0, 2, 1, -1}), MakeInputs(1, {3, -1, 2, 3})};
  Received received[2];
  absl::Status status[2];
  const absl::Time start = absl::Now();
  OnAllRanks(2, [&](int r) {
    if (r == 1) absl::SleepFor(absl::Milliseconds(3500));
    status[r] = Dispatch(r, in[r], &received[r], absl::Milliseconds(200));
  });
  ASSERT_TRUE(status[0].ok()) << status[0];
  ASSERT_TRUE(status[1].ok()) << status[1];
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(3500));
  EXPECT_EQ(received[0].source_counts, (std::array<int64_t, 2>{2, 0}));
  EXPECT_EQ(received[1].source_counts, (std::array<int64_t, 2>{1, 2}));
  std::vector<core::bf16_t> output[2];
  OnAllRanks(2, [&](int r) { status[r] = Combine(r, received[r], &output[r], in[r].tokens); });
  ASSERT_TRUE(status[0].ok()) << status[0];
  ASSERT_TRUE(status[1].ok()) << status[1];
  EXPECT_EQ(core::Bf16ToFloat(output[0][0]), 2.0f);
  EXPECT_FALSE(workers_[0]->Status().group_broken());
  EXPECT_FALSE(workers_[1]->Status().group_broken());
  ExactStep("after a late peer");
}

// DESIGN §7 on the Forward RPC: an id outside [0, 4) that is not the
// invalid id -1 is refused before the vote on its rank (INVALID_ARGUMENT
// naming the row and the id), its peer ABORTED naming it, and the next
// Forward runs.
TEST_F(EngineCallsTest, ForwardRpcRefusesAnOutOfRangeId) {
  ASSERT_TRUE(Load(0).ok());
  ASSERT_TRUE(Load(1).ok());
  Commit(1);
  auto request = [](const Inputs& in) {
    v1::ForwardRequest r;
    r.set_layer(0);
    r.set_epoch(1);
    *r.mutable_hidden_states() = EncodeBf16(in.hidden, std::vector<int64_t>{in.tokens, kHidden});
    *r.mutable_topk_ids() = EncodeInt32(in.ids, std::vector<int64_t>{in.tokens, kTopK});
    *r.mutable_topk_weights() = EncodeFloat32(in.weights, std::vector<int64_t>{in.tokens, kTopK});
    return r;
  };
  const Inputs bad[2] = {MakeInputs(0, {0, 1}), MakeInputs(1, {2, 3, 1, -5})};
  grpc::Status status[2];
  v1::ForwardResponse out[2];
  OnAllRanks(2, [&](int r) { status[r] = workers_[r]->Forward(request(bad[r]), &out[r]); });
  EXPECT_EQ(status[1].error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << status[1].error_message();
  EXPECT_THAT(status[1].error_message(),
              HasSubstr("topk_ids[row 1, choice 1] = -5: outside [0, 4) and not the invalid "
                        "expert id -1"));
  EXPECT_EQ(status[0].error_code(), grpc::StatusCode::ABORTED) << status[0].error_message();
  EXPECT_THAT(status[0].error_message(), HasSubstr("rank 1"));
  const Inputs good[2] = {MakeInputs(0, {0, 1}), MakeInputs(1, {2, 3, 1, -1})};
  OnAllRanks(2, [&](int r) { status[r] = workers_[r]->Forward(request(good[r]), &out[r]); });
  ASSERT_TRUE(status[0].ok()) << status[0].error_message();
  ASSERT_TRUE(status[1].ok()) << status[1].error_message();
  EXPECT_FALSE(workers_[0]->Status().group_broken());
}

}  // namespace
}  // namespace worker_service_engine_test
}  // namespace moe_ep::server
