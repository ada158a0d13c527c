#include "core/ep_contract.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <string>

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

EpDispatcherOptions ContractOptions(int ep, int64_t n, int64_t h, int k, int experts) {
  EpDispatcherOptions o;
  o.workspace = WorkspaceSpec{ep, n, h, k, DispatchDType::kBF16};
  o.num_experts = experts;
  return o;
}

constexpr BackendLimits kTest = {"test data plane", 8, 4, 4};

void ExpectInvalid(const absl::Status& s, const std::string& fragment) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_THAT(std::string(s.message()), HasSubstr(fragment));
}

// Each rule has one message, used by the service and by both backends.
TEST(ValidateEpOptions, PinsEachMessageOnce) {
  EXPECT_TRUE(ValidateEpOptions(ContractOptions(2, 8, 64, 2, 4), 2, kTest).ok());
  ExpectInvalid(ValidateEpOptions(ContractOptions(2, 8, 64, 2, 4), 3, kTest),
                "workspace.ep_size: expected the group size 3, got 2");
  ExpectInvalid(ValidateEpOptions(ContractOptions(9, 8, 64, 2, 16), 9, kTest),
                "workspace.ep_size: expected in [1, 8] on the test data plane, got 9");
  ExpectInvalid(ValidateEpOptions(ContractOptions(2, 0, 64, 2, 4), 2, kTest),
                "workspace.capacity_tokens: expected >= 1, got 0");
  ExpectInvalid(ValidateEpOptions(ContractOptions(2, 8, 64, 5, 4), 2, kTest),
                "top_k: expected <= num_experts (4), got 5");
  ExpectInvalid(ValidateEpOptions(ContractOptions(2, 8, 64, 5, 8), 2, kTest),
                "top_k: expected in [1, 4] on the test data plane, got 5");
  ExpectInvalid(ValidateEpOptions(ContractOptions(2, 8, 66, 2, 4), 2, kTest),
                "hidden_size: the test data plane needs a multiple of 4");
  ExpectInvalid(ValidateEpOptions(ContractOptions(4, 8, 64, 1, 3), 4, BackendLimits{}),
                "num_experts: expected >= 4 (the world size: every rank owns an expert), got 3");
  EpDispatcherOptions fp4 = ContractOptions(2, 8, 64, 2, 4);
  fp4.workspace.dtype = DispatchDType::kNVFP4;
  ExpectInvalid(ValidateEpOptions(fp4, 2, kTest),
                "workspace.dtype (dispatch_dtype): the test data plane moves bf16, got nvfp4");
  EpDispatcherOptions invalid = ContractOptions(2, 8, 64, 2, 4);
  invalid.invalid_expert_id = 3;
  ExpectInvalid(ValidateEpOptions(invalid, 2, kTest),
                "invalid_expert_id: expected -1 or num_experts (4), got 3");
  invalid.invalid_expert_id = 4;
  EXPECT_TRUE(ValidateEpOptions(invalid, 2, kTest).ok());
  EpDispatcherOptions buckets = ContractOptions(2, 8, 64, 2, 4);
  buckets.cuda_graph_buckets = {2, 9};
  ExpectInvalid(ValidateEpOptions(buckets, 2, kTest),
                "cuda_graph_buckets: expected strictly ascending values in [1, capacity_tokens = "
                "8], got [2, 9]");
}

// A dtype is accepted only where the backend moves it (issue 15 item 4): the
// message names the field, what the backend moves and the value.
TEST(ValidateDispatchDType, RefusesWhatTheBackendCannotMove) {
  constexpr BackendLimits kFp8 = {
      "fp8 plane", 8, 4, 4,
      DispatchDTypeBit(DispatchDType::kBF16) | DispatchDTypeBit(DispatchDType::kFP8E4M3)};
  EXPECT_TRUE(ValidateDispatchDType(DispatchDType::kBF16, kFp8).ok());
  EXPECT_TRUE(ValidateDispatchDType(DispatchDType::kFP8E4M3, kFp8).ok());
  ExpectInvalid(
      ValidateDispatchDType(DispatchDType::kNVFP4, kFp8),
      "workspace.dtype (dispatch_dtype): the fp8 plane moves bf16 or fp8_e4m3, got nvfp4");
  ExpectInvalid(ValidateDispatchDType(DispatchDType::kMXFP8, kFp8),
                "the fp8 plane moves bf16 or fp8_e4m3, got mxfp8");
  ExpectInvalid(ValidateDispatchDType(DispatchDType::kFP8E4M3, kTest),
                "the test data plane moves bf16, got fp8_e4m3");
  // fp8_e4m3 also needs H a multiple of its 128-value scale block.
  EpDispatcherOptions fp8 = ContractOptions(2, 8, 64, 2, 4);
  fp8.workspace.dtype = DispatchDType::kFP8E4M3;
  ExpectInvalid(ValidateEpOptions(fp8, 2, kFp8),
                "hidden_size: fp8_e4m3 dispatch needs a multiple of 128 (one fp32 scale per "
                "128 values), got 64");
  fp8.workspace.hidden = 256;
  EXPECT_TRUE(ValidateEpOptions(fp8, 2, kFp8).ok());
}

TEST(ValidatePlacement, AgainstTheSlotBudget) {
  EpDispatcherOptions o = ContractOptions(2, 8, 64, 2, 6);
  o.redundant_slots_per_rank = 1;
  EXPECT_EQ(SlotBudgetPerRank(o), 4);  // ceil(6 / 2) + 1
  auto fits = PlacementTable::FromSlotExperts(6, {{5, 2, 0, 3}, {1, 4, 5, 2}});
  EXPECT_TRUE(ValidatePlacement(*fits, o).ok());
  auto big = PlacementTable::FromSlotExperts(6, {{5, 2, 0, 3, 1}, {1, 4, 5, 2, 0}});
  ExpectInvalid(ValidatePlacement(*big, o),
                "placement: rank 0 has 5 slots, the workspace's budget is 4");
  ExpectInvalid(ValidatePlacement(*PlacementTable::Contiguous(6, 3), o),
                "placement: ep_size expected 2 (the workspace's), got 3");
  ExpectInvalid(ValidatePlacement(*PlacementTable::Contiguous(8, 2), o),
                "placement: num_experts expected 6 (the workspace's), got 8");
  o.redundant_slots_per_rank = 7;
  ExpectInvalid(ValidateEpOptions(o, 2, kTest),
                "redundant_slots_per_rank: expected in [0, num_experts = 6], got 7");
}

// The device data planes' per-call checks, one wording for both (D1).
TEST(DevicePlaneChecks, PinEachMessageOnce) {
  int x = 0;
  EXPECT_TRUE(ValidateMaxIntermediate(0).ok());
  ExpectInvalid(ValidateMaxIntermediate(-1), "max_intermediate: expected >= 0, got -1");
  EXPECT_TRUE(ValidateStepPointers("Forward", 1, 0, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(ValidateStepPointers("Forward", 1, 3, &x, &x, &x).ok());
  ExpectInvalid(ValidateStepPointers("Dispatch", 1, 3, &x, nullptr, &x),
                "Dispatch on rank 1: null device pointer with 3 tokens");
  EXPECT_TRUE(ValidateStepOutput("Forward", 0, 0, nullptr).ok());
  ExpectInvalid(ValidateStepOutput("Forward", 0, 3, nullptr),
                "Forward on rank 0: null output with 3 tokens");
  EXPECT_TRUE(ValidateExpertSlice(0, {64, {0, 1, 2, 3}}, {64, {0, 1, 2, 3}}).ok());
  ExpectInvalid(ValidateExpertSlice(0, {64, {0, 1, 2, 3}}, {64, {0, 1}}),
                "experts on rank 0: expected hidden 64 and experts [0, 4), got hidden 64 and "
                "[0, 2)");
  ExpectInvalid(ValidateExpertSlice(2, {64, {8, 9, 10, 11}}, {32, {8, 9, 10, 11}}),
                "got hidden 32 and [8, 12)");
  // Any set of ids (a placement table's slots, DESIGN §17): equal sets pass,
  // the message names both.
  EXPECT_TRUE(ValidateExpertSlice(1, {64, {2, 5, 9}}, {64, {2, 5, 9}}).ok());
  ExpectInvalid(ValidateExpertSlice(1, {64, {2, 5, 9}}, {64, {2, 3, 4}}),
                "expected hidden 64 and experts {2,5,9}, got hidden 64 and [2, 5)");
  EXPECT_TRUE(ValidateCaptureArgs(0, 16, 16, &x, &x, &x, &x).ok());
  ExpectInvalid(ValidateCaptureArgs(0, 17, 16, &x, &x, &x, &x),
                "CaptureForward on rank 0: bucket expected in [1, 16], got 17");
  ExpectInvalid(ValidateCaptureArgs(0, 0, 16, &x, &x, &x, &x), "got 0");
  ExpectInvalid(ValidateCaptureArgs(3, 4, 16, &x, &x, &x, nullptr),
                "CaptureForward on rank 3: null device pointer");
  EXPECT_TRUE(ValidateReplayTokens(0, 8, 8).ok());
  EXPECT_TRUE(ValidateReplayTokens(0, 8, 0).ok());
  ExpectInvalid(ValidateReplayTokens(0, 8, 9),
                "ReplayForward on rank 0: num_tokens expected in [0, bucket=8], got 9");
  ExpectInvalid(ValidateReplayTokens(0, 8, -1), "got -1");
}

TEST(ValidateMoeSizes, RangesAndTopKBound) {
  ExpectInvalid(ValidateMoeSizes(0, 4, 2), "hidden_size: expected in [1, 1048576], got 0");
  ExpectInvalid(ValidateMoeSizes(64, 0, 2), "num_experts: expected in [1, 65536], got 0");
  ExpectInvalid(ValidateMoeSizes(64, 4, 0), "top_k: expected in [1, 65536], got 0");
  ExpectInvalid(ValidateMoeSizes(64, 4, 5), "top_k: expected <= num_experts (4), got 5");
  EXPECT_TRUE(ValidateMoeSizes(64, 4, 4).ok());
}

TEST(GeometryState, CommitChecksAndKeepsPreviousOnError) {
  GeometryState g(/*rank=*/1, /*capacity_tokens=*/8);
  EXPECT_FALSE(g.committed());
  const absl::Status none = g.CheckStep("Forward", 0);
  EXPECT_EQ(none.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(none.message()),
              HasSubstr("Forward: no geometry committed on rank 1; call CommitGeometry first"));
  ASSERT_TRUE(g.Commit(3, 6, 4).ok());
  const absl::Status over = g.Commit(4, 9, 1);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(over.message()),
              HasSubstr("runtime_max_tokens_per_rank 9 exceeds capacity_tokens 8 (rank 1)"));
  const absl::Status under = g.Commit(4, 2, 5);
  EXPECT_EQ(under.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(under.message()), HasSubstr("below this rank's local_tokens 5"));
  EXPECT_EQ(g.epoch(), 3);
  EXPECT_EQ(g.runtime_max_tokens_per_rank(), 6);
  EXPECT_TRUE(g.CheckStep("Dispatch", 6).ok());
  const absl::Status big = g.CheckStep("Dispatch", 7);
  EXPECT_EQ(big.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(big.message()),
              HasSubstr("num_tokens 7 exceeds runtime_max_tokens_per_rank 6 (rank 1)"));
  ExpectInvalid(g.CheckStep("Dispatch", -1), "num_tokens: expected >= 0, got -1 (rank 1)");
}

// The in-step guard: the GPU copy used to allow a commit mid-step.
TEST(GeometryState, RefusesCommitAndSecondDispatchMidStep) {
  GeometryState g(0, 8);
  ASSERT_TRUE(g.Commit(1, 4, 4).ok());
  ASSERT_TRUE(g.BeginDispatch("Dispatch").ok());
  g.MarkDispatched();
  const absl::Status commit = g.Commit(2, 4, 4);
  EXPECT_EQ(commit.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(commit.message()),
              HasSubstr("CommitGeometry: a dispatched step is in flight on rank 0"));
  EXPECT_EQ(g.epoch(), 1);
  const absl::Status again = g.BeginDispatch("Dispatch");
  EXPECT_EQ(again.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(again.message()), HasSubstr("a dispatch is in flight on rank 0: call "
                                                      "combine first"));
  const absl::Status combine = g.RequireComputed("Combine");
  EXPECT_THAT(std::string(combine.message()), HasSubstr("call ComputeExperts first"));
  g.MarkComputed();
  EXPECT_TRUE(g.RequireComputed("Combine").ok());
  g.MarkIdle();
  const absl::Status idle = g.RequireDispatched("Combine");
  EXPECT_EQ(idle.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(idle.message()),
              HasSubstr("Combine needs a dispatch first: no dispatched step on rank 0"));
  EXPECT_TRUE(g.Commit(2, 4, 4).ok());
}

TEST(ValidateLocalTokens, NamesTheRank) {
  ExpectInvalid(ValidateLocalTokens(-2, 3), "local_tokens: expected >= 0, got -2 (rank 3)");
  EXPECT_TRUE(ValidateLocalTokens(0, 3).ok());
}

}  // namespace
}  // namespace moe_ep::core
