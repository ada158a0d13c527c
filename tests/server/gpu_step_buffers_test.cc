#include "server/gpu_step_buffers.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

#ifdef MOE_EP_HAVE_CUDA

namespace moe_ep::server {
namespace {

core::WorkspaceSpec Bf16Spec(int64_t hidden, int top_k) {
  core::WorkspaceSpec ws;
  ws.dtype = core::DispatchDType::kBF16;
  ws.hidden = hidden;
  ws.top_k = top_k;
  return ws;
}

// The header's worked example: bf16 H 8 K 2 moves 2*8 + 8*2 = 32 bytes a
// token on dispatch and 2*8 = 16 on combine; only member 1 is remote.
TEST(StepCountStats, SumsCountsAndRemoteBytesOfTheHeaderExample) {
  const int32_t counts[4] = {3, 4, 3, 5};
  absl::StatusOr<core::StepStats> stats =
      StepCountStats(counts, /*members=*/2, /*self=*/0, Bf16Spec(8, 2), /*runtime_max=*/6);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->runtime_max_tokens_per_rank, 6);
  EXPECT_EQ(stats->tokens_sent, 7);
  EXPECT_EQ(stats->tokens_received, 8);
  EXPECT_EQ(stats->bytes_sent_remote, 4 * 32 + 5 * 16);
  EXPECT_EQ(stats->dispatch_us, 0);
  EXPECT_TRUE(stats->lost_experts.empty());
}

// Three members, this rank the last: members 0 and 1 are remote.
TEST(StepCountStats, SkipsOnlyTheOwnMember) {
  const int32_t counts[6] = {1, 2, 9, 4, 5, 7};
  absl::StatusOr<core::StepStats> stats =
      StepCountStats(counts, /*members=*/3, /*self=*/2, Bf16Spec(4, 1), /*runtime_max=*/9);
  ASSERT_TRUE(stats.ok()) << stats.status();
  EXPECT_EQ(stats->tokens_sent, 12);
  EXPECT_EQ(stats->tokens_received, 16);
  // dispatch 2*4 + 8 = 16 bytes, combine 8: (1+2)*16 + (4+5)*8.
  EXPECT_EQ(stats->bytes_sent_remote, 3 * 16 + 9 * 8);
}

TEST(StepCountStats, RejectsAZeroTopK) {
  const int32_t counts[2] = {1, 1};
  absl::StatusOr<core::StepStats> stats = StepCountStats(counts, 1, 0, Bf16Spec(8, 0), 1);
  EXPECT_EQ(stats.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(stats.status().message(), ::testing::HasSubstr("top_k must be >= 1, got 0"));
}

// What Benchmark's tokens_sent reads (issue 32 item 2): the device's send
// counts summed after the stream, here counts put there by hand.
}  // namespace
}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
