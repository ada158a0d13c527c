#include "server/memory_budget.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

TEST(MemoryBudget, HeldAndScratchCap) {
  const MemoryBudget budget{1000, 300, 500};
  EXPECT_EQ(budget.held(), 800);
  EXPECT_EQ(budget.ScratchCap(), 200);
  EXPECT_EQ((MemoryBudget{0, 300, 500}).ScratchCap(), 0);  // no cap: unlimited
}

TEST(MemoryBudget, WorkspaceFitsUpToTheCapExactly) {
  const MemoryBudget budget{1000, 900, 900};  // what is held now is replaced
  EXPECT_TRUE(CheckWorkspaceFits(budget, 600, 400).ok());
  const absl::Status over = CheckWorkspaceFits(budget, 600, 401);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(), HasSubstr("needs 600 bytes (plus 401 of experts)"));
  EXPECT_THAT(over.message(), HasSubstr("memory cap of 1000 bytes (--memory-cap-bytes)"));
  const absl::Status alone = CheckWorkspaceFits(budget, 1001, 0);
  EXPECT_THAT(alone.message(), HasSubstr("needs 1001 bytes, more than"));
  EXPECT_TRUE(CheckWorkspaceFits(MemoryBudget{0, 0, 0}, int64_t{1} << 50, 0).ok());
}

TEST(MemoryBudget, ExpertsReplaceTheLayersOwnBytes) {
  // 300 workspace, 500 experts of which 200 are layer 3's: 300 + 300 + new.
  const MemoryBudget budget{1000, 300, 500};
  absl::StatusOr<int64_t> fits = CheckExpertsFit(budget, 3, 400, 200);
  ASSERT_TRUE(fits.ok()) << fits.status();
  EXPECT_EQ(*fits, 1000);
  absl::StatusOr<int64_t> over = CheckExpertsFit(budget, 3, 450, 200);
  EXPECT_EQ(over.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.status().message(),
              HasSubstr("layer 3 needs 450 bytes of experts; with 300 of workspace and 300 of "
                        "other layers' experts that is 1050 bytes"));
  absl::StatusOr<int64_t> unlimited = CheckExpertsFit(MemoryBudget{0, 300, 500}, 3, 450, 200);
  ASSERT_TRUE(unlimited.ok());
  EXPECT_EQ(*unlimited, 1050);
}

TEST(MemoryBudget, BenchmarkInputsAndFit) {
  // 10 tokens, H 16, K 2: hidden in and out 2 * 16 * 2 bytes, ids + weights 2 * 8.
  EXPECT_EQ(BenchmarkInputBytes(10, 16, 2), 10 * (64 + 16));
  const MemoryBudget budget{1000, 300, 200};  // 500 held
  EXPECT_TRUE(CheckBenchmarkFits(budget, 300, 200).ok());
  const absl::Status over = CheckBenchmarkFits(budget, 300, 201);
  EXPECT_EQ(over.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(over.message(),
              HasSubstr("Benchmark: needs 501 bytes (workspace and inputs) on top of 500 held"));
}

TEST(DeviceScratchCap, WhatTheCapLeavesAfterTheCallsOwnBuffers) {
  // No cap: unlimited (0), whatever the buffers.
  EXPECT_EQ(*DeviceScratchCap(1 << 20, 0), 0);
  // 1 MiB cap, 144 * 1000 bytes of inputs and output: the rest.
  EXPECT_EQ(*DeviceScratchCap(144000, 1 << 20), (1 << 20) - 144000);
  // Exactly the cap: nothing left is an error naming both numbers.
  absl::StatusOr<int64_t> none = DeviceScratchCap(4096, 4096);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(none.status().message(),
            "Benchmark: inputs and output need 4096 device bytes, more than the 4096 bytes the "
            "memory cap leaves (--memory-cap-bytes)");
}

}  // namespace
}  // namespace moe_ep::server
