#include "core/layer_stack_memory.h"

#include "core/workspace.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

LayerStackConfig EstimateConfig(bool a2a) {
  LayerStackConfig c;
  c.layout = ParallelLayout{2, 1, 0};
  c.sparse_layers = {false, true};
  c.a2a_enabled = a2a;
  c.hidden = 32;
  c.dense_intermediate = 64;
  c.moe_intermediate = 32;
  c.num_experts = 8;
  c.top_k = 2;
  c.capacity_tokens = 16;
  return c;
}

TEST(EstimateLayerStackBytes, HandComputedExample) {
  // Per layer: attention 32*32*4 = 4096, norms 2*32*4 = 256 -> 2 * 4352;
  // dense 3*64*32*2 = 12288; rank 0's 4 experts 4 * 3*32*32*2 = 24576.
  auto no_a2a = EstimateLayerStackBytes(EstimateConfig(false), 0);
  ASSERT_TRUE(no_a2a.ok()) << no_a2a.status();
  EXPECT_EQ(*no_a2a, 8704 + 12288 + 24576);
  // With the all-to-all: plus the workspace of E 2, N 16, H 32, K 2, bf16.
  WorkspaceSpec spec;
  spec.ep_size = 2;
  spec.capacity_tokens = 16;
  spec.hidden = 32;
  spec.top_k = 2;
  spec.dtype = DispatchDType::kBF16;
  auto workspace = ComputeAllocatedWorkspace(spec);
  ASSERT_TRUE(workspace.ok());
  auto with_a2a = EstimateLayerStackBytes(EstimateConfig(true), 0);
  ASSERT_TRUE(with_a2a.ok()) << with_a2a.status();
  EXPECT_EQ(*with_a2a, *no_a2a + workspace->total_bytes);
}

TEST(EstimateLayerStackScratchBytes, HandComputedExample) {
  // Widest I: max(expert 32, dense 64 / shards). One shard: 3*64*32*4 = 24576
  // widened; 10 rows * (8*4*32 + 2*4*64 + 8*2) = 10 * 1552 = 15520.
  auto one = EstimateLayerStackScratchBytes(EstimateConfig(true), 10, 1);
  ASSERT_TRUE(one.ok()) << one.status();
  EXPECT_EQ(*one, 24576 + 15520);
  // Two shards: dense I 32 = expert I: 3*32*32*4 = 12288; 10 * (1024 + 256 + 16).
  auto two = EstimateLayerStackScratchBytes(EstimateConfig(true), 10, 2);
  ASSERT_TRUE(two.ok()) << two.status();
  EXPECT_EQ(*two, 12288 + 12960);
  EXPECT_THAT(EstimateLayerStackScratchBytes(EstimateConfig(true), -1, 1).status().message(),
              ::testing::HasSubstr("rows: expected >= 0, got -1"));
  EXPECT_THAT(EstimateLayerStackScratchBytes(EstimateConfig(true), 1, 0).status().message(),
              ::testing::HasSubstr("dense_shards: expected >= 1, got 0"));
}

TEST(EstimateReferenceLayerStackBytes, LargestLayerPlusScratch) {
  // Dense layer 4352 + 12288 = 16640; sparse layer 4352 + 8 * 6144 = 53504.
  auto ref = EstimateReferenceLayerStackBytes(EstimateConfig(true), 10);
  ASSERT_TRUE(ref.ok()) << ref.status();
  EXPECT_EQ(*ref, 53504 + 24576 + 15520);
}

TEST(EstimateReferenceLayerStackBytes, DeepSeekV3SparseLayerHoldsAllExperts) {
  LayerStackConfig c;
  c.layout = ParallelLayout{2, 1, 0};
  c.sparse_layers = {false, false, false, true};
  c.hidden = 7168;
  c.dense_intermediate = 18432;
  c.moe_intermediate = 2048;
  c.num_experts = 256;
  c.top_k = 8;
  auto ref = EstimateReferenceLayerStackBytes(c, 0);
  ASSERT_TRUE(ref.ok()) << ref.status();
  // 256 experts of 3*2048*7168*2 = 88,080,384 bytes, the attention stand-in
  // 7168^2 * 4 = 205,520,896 and norms 57,344; widened dense 3*18432*7168*4.
  EXPECT_EQ(*ref, int64_t{256} * 88080384 + 205520896 + 57344 + int64_t{3} * 18432 * 7168 * 4);
}

}  // namespace
}  // namespace moe_ep::core
