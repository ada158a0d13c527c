#include "core/workspace.h"

#include <cstdint>
#include <limits>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace workspace_test {
namespace {

using ::testing::HasSubstr;

WorkspaceSpec Spec(int e, int64_t n, int64_t h, int k, DispatchDType dtype = DispatchDType::kBF16) {
  WorkspaceSpec spec;
  spec.ep_size = e;
  spec.capacity_tokens = n;
  spec.hidden = h;
  spec.top_k = k;
  spec.dtype = dtype;
  return spec;
}

void ExpectInvalid(const absl::Status& status, const std::string& fragment) {
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument) << status;
  EXPECT_THAT(status.message(), HasSubstr(fragment)) << status;
}

TEST(DispatchBytesPerToken, TableValues) {
  // bf16: 2H + 8K.
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kBF16, 64, 2), 144);
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kBF16, 7168, 8), 14400);
  // nvfp4: H/2 + H/16 + 8K = 3584 + 448 + 64.
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kNVFP4, 7168, 8), 4096);
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kNVFP4, 64, 2), 32 + 4 + 16);
  // mxfp8: H + H/32 + 8K = 7168 + 224 + 64.
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kMXFP8, 7168, 8), 7456);
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kMXFP8, 64, 2), 64 + 2 + 16);
  // fp8_e4m3: H + 4 * H/128 + 8K = 7168 + 224 + 64 (the same bytes as mxfp8:
  // one 4-byte scale per 128 values is one byte per 32).
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kFP8E4M3, 7168, 8), 7456);
  EXPECT_EQ(*DispatchBytesPerToken(DispatchDType::kFP8E4M3, 128, 2), 128 + 4 + 16);
}

TEST(DispatchBytesPerToken, Errors) {
  ExpectInvalid(DispatchBytesPerToken(DispatchDType::kBF16, 0, 2).status(), "hidden");
  ExpectInvalid(DispatchBytesPerToken(DispatchDType::kBF16, 64, 0).status(), "top_k");
  ExpectInvalid(DispatchBytesPerToken(DispatchDType::kNVFP4, 100, 2).status(), "multiple of 16");
  ExpectInvalid(DispatchBytesPerToken(DispatchDType::kMXFP8, 48, 2).status(), "multiple of 32");
  ExpectInvalid(DispatchBytesPerToken(DispatchDType::kFP8E4M3, 64, 2).status(), "multiple of 128");
  ExpectInvalid(
      DispatchBytesPerToken(DispatchDType::kBF16, std::numeric_limits<int64_t>::max() / 2 + 1, 2)
          .status(),
      "overflows");
}

TEST(CombineBytesPerToken, TwoBytesPerElement) {
  EXPECT_EQ(CombineBytesPerToken(64), 128);
  EXPECT_EQ(CombineBytesPerToken(7168), 14336);
}

TEST(DefaultCapacityTokens, AtLeast4096) {
  EXPECT_EQ(DefaultCapacityTokens(8192), 8192);
  EXPECT_EQ(DefaultCapacityTokens(2048), 4096);
  EXPECT_EQ(DefaultCapacityTokens(0), 4096);
  EXPECT_EQ(DefaultCapacityTokens(-1), 4096);
}

TEST(DispatchDType, NamesRoundTrip) {
  for (DispatchDType d : {DispatchDType::kBF16, DispatchDType::kNVFP4, DispatchDType::kMXFP8,
                          DispatchDType::kFP8E4M3}) {
    absl::StatusOr<DispatchDType> parsed = ParseDispatchDType(DispatchDTypeName(d));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, d);
  }
  EXPECT_EQ(DispatchDTypeName(DispatchDType::kNVFP4), "nvfp4");
  EXPECT_EQ(*ParseDispatchDType("BF16"), DispatchDType::kBF16);
  ExpectInvalid(ParseDispatchDType("fp16").status(), "'fp16'");
}

// DESIGN §5 check values.
TEST(ComputeFlashInferWorkspace, DesignCheckValueSmall) {
  absl::StatusOr<FlashInferWorkspace> ws = ComputeFlashInferWorkspace(Spec(2, 3, 64, 2));
  ASSERT_TRUE(ws.ok()) << ws.status();
  EXPECT_EQ(ws->aux_bytes, 1152);
  EXPECT_EQ(ws->dispatch_region_bytes, 896);  // A(2*3*144 = 864)
  EXPECT_EQ(ws->combine_region_bytes, 768);   // 2*3*128
  EXPECT_EQ(ws->total_bytes, 2816);
}

TEST(FlashInferAuxBytes, DesignCheckValues) {
  EXPECT_EQ(FlashInferAuxBytes(2, 3), 1152);
  EXPECT_EQ(FlashInferAuxBytes(8, 4096), 721280);
  EXPECT_EQ(FlashInferAuxBytes(16, 4096), 721408);
  EXPECT_EQ(FlashInferAuxBytes(0, 4096), -1);
  EXPECT_EQ(FlashInferAuxBytes(8, 0), -1);
  EXPECT_EQ(FlashInferAuxBytes(8, std::numeric_limits<int64_t>::max() / 8), -1);
}

TEST(ComputeFlashInferWorkspace, DesignCheckValueDeepSeek) {
  absl::StatusOr<FlashInferWorkspace> ws = ComputeFlashInferWorkspace(Spec(8, 16384, 7168, 8));
  ASSERT_TRUE(ws.ok()) << ws.status();
  EXPECT_EQ(ws->aux_bytes, 2883968);
  EXPECT_EQ(ws->dispatch_region_bytes, 1887436800);  // 8 * 16384 * 14400
  EXPECT_EQ(ws->combine_region_bytes, 1879048192);   // 8 * 16384 * 14336
  EXPECT_EQ(ws->total_bytes, 3769368960);
}

TEST(ComputeFlashInferWorkspace, Nvfp4AndMxfp8) {
  // E=8, N=4096, H=7168, K=8: aux 721280; nvfp4 8*4096*4096, mxfp8 8*4096*7456.
  absl::StatusOr<FlashInferWorkspace> fp4 =
      ComputeFlashInferWorkspace(Spec(8, 4096, 7168, 8, DispatchDType::kNVFP4));
  ASSERT_TRUE(fp4.ok()) << fp4.status();
  EXPECT_EQ(fp4->dispatch_region_bytes, 134217728);
  EXPECT_EQ(fp4->combine_region_bytes, 469762048);
  EXPECT_EQ(fp4->total_bytes, 721280 + 134217728 + 469762048);
  absl::StatusOr<FlashInferWorkspace> fp8 =
      ComputeFlashInferWorkspace(Spec(8, 4096, 7168, 8, DispatchDType::kMXFP8));
  ASSERT_TRUE(fp8.ok()) << fp8.status();
  EXPECT_EQ(fp8->dispatch_region_bytes, 244318208);
  EXPECT_EQ(fp8->total_bytes, 721280 + 244318208 + 469762048);
  // fp8_e4m3 (one fp32 scale per 128): 8*4096*7456 as well; and DESIGN §5's
  // small check geometry E=2, N=3, K=2 at H=128: dispatch 2*3*148 = 888 -> A 896,
  // combine 2*3*256 = 1536, aux 1152.
  absl::StatusOr<FlashInferWorkspace> e4m3 =
      ComputeFlashInferWorkspace(Spec(8, 4096, 7168, 8, DispatchDType::kFP8E4M3));
  ASSERT_TRUE(e4m3.ok()) << e4m3.status();
  EXPECT_EQ(e4m3->aux_bytes, 721280);
  EXPECT_EQ(e4m3->dispatch_region_bytes, 244318208);
  EXPECT_EQ(e4m3->total_bytes, 721280 + 244318208 + 469762048);
  absl::StatusOr<FlashInferWorkspace> small =
      ComputeFlashInferWorkspace(Spec(2, 3, 128, 2, DispatchDType::kFP8E4M3));
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->aux_bytes, 1152);
  EXPECT_EQ(small->dispatch_region_bytes, 896);
  EXPECT_EQ(small->combine_region_bytes, 1536);
  EXPECT_EQ(small->total_bytes, 1152 + 896 + 1536);
}

TEST(ComputeFlashInferWorkspace, Errors) {
  ExpectInvalid(ComputeFlashInferWorkspace(Spec(0, 3, 64, 2)).status(), "ep_size");
  ExpectInvalid(ComputeFlashInferWorkspace(Spec(2, 0, 64, 2)).status(), "capacity_tokens");
  ExpectInvalid(ComputeFlashInferWorkspace(Spec(2, 3, 0, 2)).status(), "hidden");
  ExpectInvalid(ComputeFlashInferWorkspace(Spec(2, 3, 64, 0)).status(), "top_k");
  ExpectInvalid(ComputeFlashInferWorkspace(Spec(2, 3, 72, 2, DispatchDType::kNVFP4)).status(),
                "multiple of 16");
  ExpectInvalid(ComputeFlashInferWorkspace(Spec(8, int64_t{1} << 50, 7168, 8)).status(),
                "overflows");
}

// E=2, N=3, H=64, K=2 bf16, worked by hand:
//   dispatch_send [0, 864)   dispatch_recv [896, 1760)
//   combine_send  [1792, 2560)   combine_recv [2560, 3328)
//   metadata at 3328: send_counts 16 @0, recv_counts 16 @128,
//     agreement 2*(3+2)*8 = 80 @256, dest_slots 3*2*8 = 48 @384 -> 432 bytes
//   total 3760.
TEST(ComputeAllocatedWorkspace, SmallLayout) {
  absl::StatusOr<AllocatedWorkspace> ws = ComputeAllocatedWorkspace(Spec(2, 3, 64, 2));
  ASSERT_TRUE(ws.ok()) << ws.status();
  ASSERT_EQ(ws->regions.size(), 5u);
  const struct {
    const char* name;
    int64_t offset;
    int64_t size;
  } want[] = {{"dispatch_send", 0, 864},
              {"dispatch_recv", 896, 864},
              {"combine_send", 1792, 768},
              {"combine_recv", 2560, 768},
              {"metadata", 3328, 432}};
  for (int i = 0; i < 5; ++i) {
    EXPECT_EQ(ws->regions[i].name, want[i].name);
    EXPECT_EQ(ws->regions[i].offset_bytes, want[i].offset) << want[i].name;
    EXPECT_EQ(ws->regions[i].size_bytes, want[i].size) << want[i].name;
  }
  EXPECT_EQ(ws->total_bytes, 3760);
}

TEST(ComputeAllocatedWorkspace, AlignedNonOverlappingDeepSeekScale) {
  absl::StatusOr<AllocatedWorkspace> ws = ComputeAllocatedWorkspace(Spec(8, 4096, 7168, 8));
  ASSERT_TRUE(ws.ok()) << ws.status();
  const int64_t offsets[] = {0, 471859200, 943718400, 1413480448, 1883242496};
  ASSERT_EQ(ws->regions.size(), 5u);
  int64_t previous_end = 0;
  for (int i = 0; i < 5; ++i) {
    const WorkspaceRegion& r = ws->regions[i];
    EXPECT_EQ(r.offset_bytes, offsets[i]) << r.name;
    EXPECT_EQ(r.offset_bytes % 128, 0) << r.name;
    EXPECT_GE(r.offset_bytes, previous_end) << r.name;
    previous_end = r.offset_bytes + r.size_bytes;
  }
  EXPECT_EQ(ws->regions[0].size_bytes, int64_t{8} * 4096 * 14400);
  EXPECT_EQ(ws->regions[2].size_bytes, int64_t{8} * 4096 * 14336);
  // metadata: 64 @0, 64 @128, 8*11*8 = 704 @256, 4096*8*8 = 262144 @1024.
  EXPECT_EQ(ws->regions[4].size_bytes, 263168);
  EXPECT_EQ(ws->total_bytes, previous_end);
  EXPECT_EQ(ws->total_bytes, 1883505664);
}

TEST(ComputeAllocatedWorkspace, Errors) {
  ExpectInvalid(ComputeAllocatedWorkspace(Spec(0, 3, 64, 2)).status(), "ep_size");
  ExpectInvalid(ComputeAllocatedWorkspace(Spec(2, -1, 64, 2)).status(), "capacity_tokens");
  ExpectInvalid(ComputeAllocatedWorkspace(Spec(2, 3, 48, 2, DispatchDType::kMXFP8)).status(),
                "multiple of 32");
  ExpectInvalid(ComputeAllocatedWorkspace(Spec(1024, int64_t{1} << 44, 7168, 8)).status(),
                "overflows");
}

}  // namespace
}  // namespace workspace_test
}  // namespace moe_ep::core

namespace moe_ep::core {
namespace workspace_test {
namespace {

// The typed layout is the named breakdown: same regions, same figures, each
// region its own size (DESIGN §5 check values E=2, N=3, H=64, K=2).
TEST(CpuWorkspaceLayout, FieldsAreTheNamedRegions) {
  absl::StatusOr<CpuWorkspaceLayout> layout = CpuWorkspaceLayout::For(Spec(2, 3, 64, 2));
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->dispatch_send.offset_bytes, 0);
  EXPECT_EQ(layout->dispatch_send.size_bytes, 2 * 3 * 144);
  EXPECT_EQ(layout->combine_recv.size_bytes, 2 * 3 * 128);
  absl::StatusOr<AllocatedWorkspace> named = ComputeAllocatedWorkspace(Spec(2, 3, 64, 2));
  ASSERT_TRUE(named.ok());
  ASSERT_EQ(named->regions.size(), 5u);
  const std::vector<WorkspaceRegion> regions = layout->Regions();
  for (size_t i = 0; i < regions.size(); ++i) {
    EXPECT_EQ(regions[i].name, named->regions[i].name);
    EXPECT_EQ(regions[i].offset_bytes, named->regions[i].offset_bytes);
    EXPECT_EQ(regions[i].size_bytes, named->regions[i].size_bytes);
    EXPECT_EQ(regions[i].offset_bytes % 128, 0);
  }
  EXPECT_EQ(layout->total_bytes, named->total_bytes);
  char base[8] = {};
  EXPECT_EQ(layout->combine_send.At<char>(base), base + layout->combine_send.offset_bytes);
}

}  // namespace
}  // namespace workspace_test
}  // namespace moe_ep::core
