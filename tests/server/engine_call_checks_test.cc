// Tests of server/engine_call_checks.h: the engine calls' argument checks
// every transport runs (issue 34 item 1), each case worked by hand.

#include "server/engine_call_checks.h"

#include <cstdint>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace engine_call_checks_test {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;

// Receive buffers for E = 2 sources, `rows` rows each, H = 4, K = 2, L = 3.
struct Recv {
  explicit Recv(int64_t rows)
      : hidden(2 * rows * 4), ids(2 * rows * 2), weights(2 * rows * 2), sources(2), experts(3) {
    out.rows = rows;
    out.hidden = hidden.data();
    out.topk_ids = ids.data();
    out.topk_weights = weights.data();
    out.source_counts = sources.data();
    out.expert_counts = experts.data();
  }
  std::vector<core::bf16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::vector<int64_t> sources;
  std::vector<int64_t> experts;
  EngineRecvBuffers out;
};

TEST(CheckEngineRecvBuffers, AcceptsRowsAtOrAboveTheCommittedR) {
  Recv recv(5);
  EXPECT_TRUE(CheckEngineRecvBuffers("dispatch", 1, recv.out, 5, 3).ok());
  EXPECT_TRUE(CheckEngineRecvBuffers("dispatch", 1, recv.out, 4, 3).ok());
}

TEST(CheckEngineRecvBuffers, RefusesFewerRowsThanRNamingRankAndBoth) {
  Recv recv(3);
  const absl::Status got = CheckEngineRecvBuffers("dispatch", 1, recv.out, 4, 3);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(),
              AllOf(HasSubstr("dispatch on rank 1"), HasSubstr("recv_rows 3 < the committed R 4")));
}

TEST(CheckEngineRecvBuffers, ExpertCountsMayBeNullOnlyWithoutLocalExperts) {
  Recv recv(4);
  recv.out.expert_counts = nullptr;
  EXPECT_TRUE(CheckEngineRecvBuffers("dispatch", 0, recv.out, 4, 0).ok());
  const absl::Status got = CheckEngineRecvBuffers("dispatch", 0, recv.out, 4, 3);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(), HasSubstr("expert_counts [3 local experts]"));
  recv.out.expert_counts = recv.experts.data();
  recv.out.source_counts = nullptr;
  EXPECT_EQ(CheckEngineRecvBuffers("dispatch", 0, recv.out, 4, 0).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CheckEngineRecvBuffers, RowBuffersMayBeNullOnlyForZeroRows) {
  Recv recv(0);
  recv.out.hidden = nullptr;
  recv.out.topk_ids = nullptr;
  recv.out.topk_weights = nullptr;
  EXPECT_TRUE(CheckEngineRecvBuffers("dispatch", 0, recv.out, 0, 3).ok());
  recv.out.rows = 2;
  const absl::Status got = CheckEngineRecvBuffers("dispatch", 0, recv.out, 2, 3);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(), HasSubstr("must not be null when recv_rows > 0 (got 2)"));
}

TEST(CheckEngineInputs, NullInputsAreAnErrorOnlyWithTokensAndAreNamed) {
  const core::bf16_t hidden[4] = {};
  const int32_t ids[2] = {0, 1};
  const float weights[2] = {0.5f, 0.5f};
  EXPECT_TRUE(CheckEngineInputs("forward", 0, 0, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(CheckEngineInputs("forward", 0, 1, hidden, ids, weights).ok());
  absl::Status got = CheckEngineInputs("forward", 3, 1, nullptr, ids, weights);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(), AllOf(HasSubstr("forward on rank 3: hidden null with 1 tokens")));
  got = CheckEngineInputs("dispatch", 0, 2, hidden, nullptr, nullptr);
  EXPECT_THAT(got.message(), HasSubstr("dispatch on rank 0: topk_ids, topk_weights null"));
  EXPECT_TRUE(CheckEngineOutput("forward", 0, 0, nullptr).ok());
  got = CheckEngineOutput("forward", 1, 3, nullptr);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(), HasSubstr("forward on rank 1: output must not be null"));
}

// What then happens to the step is the plane's (gloo: dispatched on every
// rank, call again, tests/server/worker_service_engine_test.cc; one-sided:
// refused; tests/embedded/engine_embedded.cc step 4c), so the pure check
// names the rows and R only.
TEST(CheckEngineCombineArgs, RowsBelowRNameTheRowsAndR) {
  const core::bf16_t expert_out[8] = {};
  core::bf16_t output[4] = {};
  EXPECT_TRUE(CheckEngineCombineArgs("combine", 0, 4, 4, expert_out, output, 1).ok());
  const absl::Status got = CheckEngineCombineArgs("combine", 2, 3, 4, expert_out, output, 1);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(),
              AllOf(HasSubstr("combine on rank 2"),
                    HasSubstr("rows per source 3 is below the dispatched step's R = 4")));
}

TEST(CheckEngineCombineArgs, OutputMayBeNullOnlyWhenTheStepHadNoTokens) {
  const core::bf16_t expert_out[8] = {};
  EXPECT_TRUE(CheckEngineCombineArgs("combine", 0, 0, 0, nullptr, nullptr, 0).ok());
  absl::Status got = CheckEngineCombineArgs("combine", 0, 4, 4, expert_out, nullptr, 2);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(), HasSubstr("output is null and the dispatched step has 2 tokens"));
  got = CheckEngineCombineArgs("combine", 0, 4, 4, nullptr, nullptr, 0);
  EXPECT_EQ(got.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(got.message(), HasSubstr("expert_out is null with 4 rows per source"));
}

TEST(RefusedDispatchError, IsTheArgumentErrorAndSaysWhenNoRefusalWasEnqueued) {
  const absl::Status args = absl::InvalidArgumentError("dispatch on rank 1: hidden is host memory");
  const absl::Status kept = RefusedDispatchError(args, absl::OkStatus());
  EXPECT_EQ(kept, args);
  const absl::Status lost =
      RefusedDispatchError(args, absl::FailedPreconditionError("Dispatch: a step is in flight"));
  EXPECT_EQ(lost.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lost.message(),
            "dispatch on rank 1: hidden is host memory; no refusal could be enqueued in place of "
            "the step (FAILED_PRECONDITION: Dispatch: a step is in flight), so the peers' "
            "dispatch waits for this rank until the group's timeout");
}

TEST(RefusedCombineError, NamesTheRefusalOrSaysWhyNoneWasEnqueued) {
  const absl::Status args = absl::InvalidArgumentError(
      "combine on rank 3: recv_rows: expected >= 8 (R) rows per source, got 7");
  const absl::Status refused = RefusedCombineError(args, absl::OkStatus());
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(refused.message(),
            "combine on rank 3: recv_rows: expected >= 8 (R) rows per source, got 7 (refused: "
            "the step is over on every rank; the peers' check_step names this rank)");
  const absl::Status lost = RefusedCombineError(args, absl::InternalError("launch failed"));
  EXPECT_EQ(lost.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(lost.message(),
            "combine on rank 3: recv_rows: expected >= 8 (R) rows per source, got 7; no refusal "
            "could be enqueued in place of the combine (INTERNAL: launch failed), so the peers' "
            "combine waits for this rank until the group's timeout");
}

}  // namespace
}  // namespace engine_call_checks_test
}  // namespace moe_ep::server
