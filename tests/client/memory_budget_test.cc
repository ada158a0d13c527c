#include "client/memory_budget.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <fstream>
#include <string>

#include "core/workspace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

constexpr int64_t kGiB = int64_t{1} << 30;

// DeepSeek-V3 (H 7168, I 2048, 256 experts, top-8) on 4 local workers, one
// layer, N = 384, 1000 rows per layer, 600 in the largest step.
RunMemoryInput DeepSeekV3() {
  RunMemoryInput in;
  in.num_experts = 256;
  in.hidden = 7168;
  in.intermediate = 2048;
  in.top_k = 8;
  in.world = 4;
  in.num_local_workers = 4;
  in.num_layers = 1;
  in.capacity_tokens = 384;
  in.rows_per_layer = 1000;
  in.max_step_rows = 600;
  return in;
}

// Mixtral-8x7B (H 4096, I 14336, 8 experts, top-2), same run shape.
RunMemoryInput Mixtral8x7B() {
  RunMemoryInput in = DeepSeekV3();
  in.num_experts = 8;
  in.hidden = 4096;
  in.intermediate = 14336;
  in.top_k = 2;
  return in;
}

TEST(ReferenceChunkExperts, AsManyAsFitInOneGiBBetweenOneAndSixteen) {
  EXPECT_EQ(ReferenceChunkExperts(88080384, 256), 12);  // DeepSeek-V3: 1 GiB / 84 MiB
  EXPECT_EQ(ReferenceChunkExperts(352321536, 8), 3);    // Mixtral-8x7B: 1 GiB / 336 MiB
  EXPECT_EQ(ReferenceChunkExperts(9437184, 128), 16);   // Qwen3-30B-A3B: capped at 16
  EXPECT_EQ(ReferenceChunkExperts(9437184, 10), 10);    // never more than the layer has
  EXPECT_EQ(ReferenceChunkExperts(2 * kGiB, 8), 1);     // one expert above the budget
  EXPECT_EQ(ReferenceChunkExperts(0, 384), 16);         // identity
}

TEST(EstimateRunMemory, DeepSeekV3HandNumbers) {
  auto e = EstimateRunMemory(DeepSeekV3());
  ASSERT_TRUE(e.ok()) << e.status();
  // 3 x 7168 x 2048 x 2 bytes per expert; 256 of them per layer.
  EXPECT_EQ(e->expert_bytes, 88080384);
  EXPECT_EQ(e->layer_expert_bytes, 22548578304);
  // 256 / 4 = 64 experts per worker.
  EXPECT_EQ(e->worker_expert_bytes, 5637144576);
  core::WorkspaceSpec spec{4, 384, 7168, 8, core::DispatchDType::kBF16};
  auto ws = core::ComputeAllocatedWorkspace(spec);
  ASSERT_TRUE(ws.ok());
  EXPECT_EQ(e->worker_workspace_bytes, ws->total_bytes);
  // 3 I H 4 = 176,160,768 + 512 rows x (8H + 8I) = 37,748,736
  // + 8 N H = 22,020,096 + 128 MiB = 370,147,328.
  EXPECT_EQ(e->worker_other_bytes, 370147328);
  EXPECT_EQ(e->worker_bytes, 5637144576 + ws->total_bytes + 370147328);
  EXPECT_EQ(e->local_workers_bytes, 4 * e->worker_bytes);
  EXPECT_EQ(e->reference_chunk_experts, 12);
  EXPECT_EQ(e->reference_chunk_bytes, 1056964608);
  // chunk 1,056,964,608 + records 1000 x (4H + 8K) = 28,736,000
  // + verify 1000 x (14H + 8K + 8I) + 3 I H 4 = 292,960,768
  // + messages 8 x 600 x H = 34,406,400 + 256 MiB = 1,681,503,232.
  EXPECT_EQ(e->coordinator_bytes, 1681503232);
  EXPECT_EQ(e->needed_bytes, e->local_workers_bytes + 1681503232);
}

TEST(EstimateRunMemory, Fp8ExpertsInTheirOwnBytes) {
  // issue 35: DeepSeek-V3's experts in fp8 are 44,040,192 bytes + 10,752 of
  // scales; no fp32 widening (the quantized reference decodes tiles).
  RunMemoryInput in = DeepSeekV3();
  in.weight_format = core::quant::ExpertWeightFormat::kFp8Block128;
  auto e = EstimateRunMemory(in);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->expert_bytes, 44050944);
  EXPECT_EQ(e->layer_expert_bytes, int64_t{256} * 44050944);
  EXPECT_EQ(e->worker_expert_bytes, int64_t{64} * 44050944);  // 2,819,260,416
  // The bf16 figure less 3 I H 4 = 176,160,768 of widening.
  EXPECT_EQ(e->worker_other_bytes, 370147328 - 176160768);
  // 1 GiB / 44,050,944 = 24 experts, capped at 16.
  EXPECT_EQ(e->reference_chunk_experts, 16);
  EXPECT_EQ(e->reference_chunk_bytes, 16 * 44050944);
  EXPECT_EQ(e->coordinator_bytes,
            16 * 44050944 + 28736000 + (292960768 - 176160768) + 34406400 + 268435456);
}

TEST(EstimateRunMemory, IdentityExpertsHoldNoWeights) {
  RunMemoryInput in = DeepSeekV3();
  in.identity = true;
  in.num_layers = 3;
  auto e = EstimateRunMemory(in);
  ASSERT_TRUE(e.ok()) << e.status();
  EXPECT_EQ(e->expert_bytes, 88080384);  // still reported, for the footprint table
  EXPECT_EQ(e->worker_expert_bytes, 0);
  EXPECT_EQ(e->reference_chunk_bytes, 0);
  // 512 x (8H + 8I) + 8 N H + 128 MiB.
  EXPECT_EQ(e->worker_other_bytes, 193986560);
  // records 3 x 28,736,000 + verify 1000 x (14H + 8K) + messages + 256 MiB.
  EXPECT_EQ(e->coordinator_bytes, 3 * 28736000 + 100416000 + 34406400 + 268435456);
}

TEST(EstimateRunMemory, TargetsHaveNoLocalWorkers) {
  RunMemoryInput in = DeepSeekV3();
  in.num_local_workers = 0;
  auto e = EstimateRunMemory(in);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->local_workers_bytes, 0);
  EXPECT_EQ(e->needed_bytes, 1681503232);
}

TEST(EstimateRunMemory, UnevenPlacementCountsTheLargestRank) {
  RunMemoryInput in = DeepSeekV3();
  in.num_experts = 10;  // ranks own 3, 3, 2, 2
  auto e = EstimateRunMemory(in);
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->worker_expert_bytes, 3 * 88080384);
}

TEST(EstimateRunMemory, RejectsBadFields) {
  RunMemoryInput zero_layers = DeepSeekV3();
  zero_layers.num_layers = 0;
  auto a = EstimateRunMemory(zero_layers);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(a.status().message(), HasSubstr("num_layers: expected >= 1, got 0"));
  RunMemoryInput negative_rows = DeepSeekV3();
  negative_rows.rows_per_layer = -1;
  auto b = EstimateRunMemory(negative_rows);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(b.status().message(), HasSubstr("rows_per_layer"));
  RunMemoryInput few_experts = DeepSeekV3();
  few_experts.num_experts = 3;  // fewer than the 4 ranks
  EXPECT_EQ(EstimateRunMemory(few_experts).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(MemorySafetyMarginBytes, TenPercentAtLeastOneGiB) {
  EXPECT_EQ(MemorySafetyMarginBytes(4 * kGiB), kGiB);
  EXPECT_EQ(MemorySafetyMarginBytes(23215538176), 2321553817);
}

TEST(CheckRunMemory, DeepSeekV3OneLayerDoesNotFitTwentyThreeGB) {
  // This machine's MemAvailable when measured: 23,215,538,176 bytes.
  const absl::Status s = CheckRunMemory(DeepSeekV3(), 23215538176);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("memory preflight: this run needs about 24.3 GiB"));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("only 19.5 GiB is available (MemAvailable 21.6 GiB minus"));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("4 local worker(s) x 5.68 GiB (experts 5.25 GiB for 1 layer(s)"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("one layer's experts are 21.0 GiB"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("--experts identity"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("fits"));
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("fewer layers do not help: one layer does not fit"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("--targets"));
  EXPECT_THAT(std::string(s.message()), HasSubstr("this process alone needs 1.57 GiB, fits"));
}

TEST(CheckRunMemory, IdentityAndMixtralFit) {
  RunMemoryInput identity = DeepSeekV3();
  identity.identity = true;
  identity.num_layers = 3;
  EXPECT_TRUE(CheckRunMemory(identity, 23215538176).ok());
  // Mixtral-8x7B: 2 experts x 336 MiB per worker for one layer.
  EXPECT_TRUE(CheckRunMemory(Mixtral8x7B(), 23215538176).ok());
}

TEST(CheckRunMemory, ExactlyAtTheMarginFits) {
  RunMemoryInput in = Mixtral8x7B();
  auto e = EstimateRunMemory(in);
  ASSERT_TRUE(e.ok());
  ASSERT_LT(e->needed_bytes + kGiB, 10 * kGiB);  // the margin is the 1 GiB floor
  EXPECT_TRUE(CheckRunMemory(in, e->needed_bytes + kGiB).ok());
  EXPECT_EQ(CheckRunMemory(in, e->needed_bytes + kGiB - 1).code(),
            absl::StatusCode::kResourceExhausted);
}

TEST(CheckRunMemory, SuggestsTheMostLayersThatFit) {
  RunMemoryInput in = Mixtral8x7B();
  in.num_layers = 3;
  RunMemoryInput two = in;
  two.num_layers = 2;
  auto e2 = EstimateRunMemory(two);
  ASSERT_TRUE(e2.ok());
  // Available such that usable = available - max(1 GiB, available / 10) is
  // just above what two layers need.
  const int64_t available = std::max(e2->needed_bytes + kGiB, e2->needed_bytes / 9 * 10 + 16);
  ASSERT_TRUE(CheckRunMemory(two, available).ok());
  const absl::Status s = CheckRunMemory(in, available);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_THAT(std::string(s.message()), HasSubstr("--layers 2 "));
  EXPECT_THAT(std::string(s.message()), HasSubstr("the most MoE layers that fit"));
  EXPECT_THAT(std::string(s.message()), Not(HasSubstr("do not help")));
}

TEST(LocalWorkerMemoryCapBytes, EqualShareOfWhatTheCoordinatorLeaves) {
  auto e = EstimateRunMemory(Mixtral8x7B());
  ASSERT_TRUE(e.ok());
  const int64_t available = 23215538176;
  const int64_t cap = LocalWorkerMemoryCapBytes(*e, 4, available);
  EXPECT_EQ(cap, (available - 2321553817 - e->coordinator_bytes) / 4);
  EXPECT_GE(cap, e->worker_bytes);
  EXPECT_EQ(LocalWorkerMemoryCapBytes(*e, 0, available), 0);
}

}  // namespace
}  // namespace moe_ep::client
