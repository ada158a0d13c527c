#include "server/gpu_data_plane.h"

#include <cstdio>
#include <memory>
#include <string>

#include "gloo/rendezvous/hash_store.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include "kernels/expert_compute.h"
#include "kernels/gpu_workspace_layout.h"

namespace moe_ep::server {
namespace {

int Gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// DESIGN §5 check values on the GPU layout: row 2H + 8K = 144 bytes.
TEST(GpuWorkspaceLayout, RegionsOfTheSmallSpec) {
  auto layout = kernels::GpuWorkspaceLayout::For(core::WorkspaceSpec{2, 3, 64, 2});
  ASSERT_TRUE(layout.ok()) << layout.status();
  EXPECT_EQ(layout->dispatch_send.size_bytes, 896);  // A(2 * 3 * 144)
  EXPECT_EQ(layout->combine_recv.size_bytes, 768);   // 2 * 3 * 128
  EXPECT_EQ(layout->header_replicas.size_bytes, 128);
  EXPECT_EQ(layout->total_bytes, 4096);
  const auto regions = layout->Regions();
  ASSERT_EQ(regions.size(), 10u);
  int64_t end = 0;
  for (const core::WorkspaceRegion& r : regions) {
    EXPECT_EQ(r.offset_bytes, end) << r.name;
    end += r.size_bytes;
  }
  EXPECT_EQ(end, layout->total_bytes);
  EXPECT_EQ(regions[9].name, "header_replicas");
}

// AllocateWorkspace's breakdown on one GPU: each region is its owner's own
// figure, and the free device memory drops by the reported total (within the
// driver's 2 MiB allocation granularity).
TEST(GpuDataPlane, BreakdownMatchesOwnersAndFreeMemoryDrop) {
  if (Gpus() < 1) {
    std::printf("[  SKIPPED ] needs 1 CUDA device\n");
    GTEST_SKIP() << "needs 1 CUDA device";
  }
  DataPlaneGroup group;
  group.backend = "nccl";
  auto plane = GpuDataPlane::Form(group, std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(plane.ok()) << plane.status();
  core::EpDispatcherOptions options;
  options.workspace = core::WorkspaceSpec{1, 4096, 7168, 8};
  options.num_experts = 8;
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  size_t free_before = 0;
  size_t total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
  auto allocation = (*plane)->Allocate(options, /*max_intermediate=*/2048, 0);
  ASSERT_TRUE(allocation.ok()) << allocation.status();
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  size_t free_after = 0;
  ASSERT_EQ(cudaMemGetInfo(&free_after, &total), cudaSuccess);
  const int64_t drop = static_cast<int64_t>(free_before) - static_cast<int64_t>(free_after);
  std::printf("reported %lld bytes, free memory dropped by %lld bytes (difference %lld)\n",
              static_cast<long long>(allocation->allocated_bytes), static_cast<long long>(drop),
              static_cast<long long>(drop - allocation->allocated_bytes));
  EXPECT_LE(std::llabs(drop - allocation->allocated_bytes), int64_t{2} << 20);

  auto layout = kernels::GpuWorkspaceLayout::For(options.workspace);
  ASSERT_TRUE(layout.ok());
  int64_t sum = 0;
  int64_t scratch = -1;
  for (const core::WorkspaceRegion& r : allocation->regions) {
    sum += r.size_bytes;
    if (r.name == "expert_scratch") scratch = r.size_bytes;
    if (r.name == "header_replicas") EXPECT_EQ(r.size_bytes, layout->header_replicas.size_bytes);
    if (r.name == "dispatch_recv") EXPECT_EQ(r.size_bytes, layout->dispatch_recv.size_bytes);
  }
  EXPECT_EQ(sum, allocation->allocated_bytes);
  // The expert compute's own figure for the same sizes (E * N rows, 8 local experts).
  auto compute = kernels::ExpertCompute::Create(4096, 8, 7168, 2048, 8);
  ASSERT_TRUE(compute.ok()) << compute.status();
  EXPECT_EQ(scratch, (*compute)->allocated_bytes());
  EXPECT_GT(scratch, 0);
}

}  // namespace
}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
