// The NCCL data plane under a rank mask (DESIGN §15; issue 17 item 3) on one
// GPU: a returning rank's plane (DataPlaneGroup.rejoin) serves world 2 on a
// world-1 communicator with the other rank masked, which is what a survivor
// serves after ncclCommShrink: identity experts make the masked reference
// exact (x times the summed weights of the choices with a live replica; lost
// experts contribute zero and are reported per step). Multi-GPU kill cases:
// tests/kernels/nccl_shrink_test.cc. Without a GPU the tests skip with the
// reason printed.

#include <memory>
#include <string>
#include <vector>

#include "gloo/rendezvous/hash_store.h"
#include "gtest/gtest.h"
#include "server/gpu_data_plane.h"

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>

#include "core/bf16.h"
#include "core/expert_source.h"

namespace moe_ep::server {
namespace gpu_rank_mask_test {
namespace {

int Gpus() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

#define REQUIRE_ONE_GPU()                                                              \
  do {                                                                                 \
    if (Gpus() < 1) {                                                                  \
      std::printf("[  SKIPPED ] needs 1 CUDA device, cudaGetDeviceCount reports 0\n"); \
      GTEST_SKIP() << "needs 1 CUDA device";                                           \
    }                                                                                  \
  } while (0)

DataPlaneGroup RejoinGroup(bool with_addresses) {
  DataPlaneGroup group;
  group.plane = PlaneRequest::kNccl;
  group.world_size = 2;
  group.rank = 1;
  group.rejoin = true;
  if (with_addresses) group.rendezvous_addresses = {"127.0.0.1:1", "127.0.0.1:2"};
  return group;
}

TEST(GpuRankMask, MaskingNeedsEveryRanksAddress) {
  REQUIRE_ONE_GPU();
  auto plane =
      GpuDataPlane::Form(RejoinGroup(false), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(plane.ok()) << plane.status();
  EXPECT_FALSE((*plane)->CanMask());
  EXPECT_EQ((*plane)->FinishMaskRound(absl::ZeroDuration()).status().code(),
            absl::StatusCode::kUnimplemented);
  auto with =
      GpuDataPlane::Form(RejoinGroup(true), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_TRUE((*with)->CanMask());
}

// World 2, 16 experts (0-7 on rank 0, 8-15 on rank 1), rank 0 masked: rank
// 1's Forward is x * (sum of the weights of its choices in [8, 16)), bit
// for bit, twice; the step reports the lost experts its tokens chose.
TEST(GpuRankMask, SurvivorStepsEqualTheMaskedReference) {
  REQUIRE_ONE_GPU();
  constexpr int64_t kT = 41;
  constexpr int64_t kH = 64;
  constexpr int kK = 3;
  constexpr int kE = 16;
  auto plane =
      GpuDataPlane::Form(RejoinGroup(true), std::make_shared<gloo::rendezvous::HashStore>());
  ASSERT_TRUE(plane.ok()) << plane.status();
  EXPECT_EQ((*plane)->mask().live, (std::vector<bool>{false, true}));
  EXPECT_EQ((*plane)->mask().MaskedRanks(), std::vector<int>{0});
  core::EpDispatcherOptions options;
  options.workspace = core::WorkspaceSpec{2, 64, kH, kK};
  options.num_experts = kE;
  ASSERT_TRUE((*plane)->Allocate(options, 0, 0).ok());
  const std::shared_ptr<const core::PlacementTable> table = (*plane)->Placement(0);
  ASSERT_NE(table, nullptr);
  EXPECT_EQ(table->LostExperts(), (std::vector<int>{0, 1, 2, 3, 4, 5, 6, 7}));
  ASSERT_TRUE((*plane)->LoadExperts(0, core::ExpertSource::Identity(0, kE, 8, 8, kH), 0).ok());
  ASSERT_TRUE((*plane)->CommitGeometry(1, kT, kT).ok());
  std::vector<core::bf16_t> x(kT * kH);
  std::vector<int32_t> ids(kT * kK);
  std::vector<float> weights(kT * kK);
  std::vector<core::bf16_t> want(kT * kH);
  std::vector<int> lost_chosen;
  for (int64_t t = 0; t < kT; ++t) {
    float sum = 0;
    for (int k = 0; k < kK; ++k) {
      const int32_t id = static_cast<int32_t>((t * 7 + k * 5) % kE);
      ids[t * kK + k] = id;
      weights[t * kK + k] = static_cast<float>((t + k) % 8 + 1) / 8.0f;
      if (id >= 8) {
        sum += weights[t * kK + k];
      } else if (std::find(lost_chosen.begin(), lost_chosen.end(), id) == lost_chosen.end()) {
        lost_chosen.push_back(id);
      }
    }
    for (int64_t j = 0; j < kH; ++j) {
      const float v = static_cast<float>((t * 3 + j) % 9) - 4.0f;
      x[t * kH + j] = core::FloatToBf16(v);
      want[t * kH + j] = core::FloatToBf16(sum > 0 ? v * sum : 0.0f);
    }
  }
  std::sort(lost_chosen.begin(), lost_chosen.end());
  ASSERT_FALSE(lost_chosen.empty());
  for (int step = 0; step < 2; ++step) {
    std::vector<core::bf16_t> out(kT * kH, core::FloatToBf16(99.0f));
    absl::StatusOr<core::StepStats> stats =
        (*plane)->Forward(0, x, ids, weights, kT, absl::MakeSpan(out));
    ASSERT_TRUE(stats.ok()) << stats.status();
    int64_t bad = 0;
    for (size_t i = 0; i < out.size(); ++i) bad += out[i] != want[i];
    EXPECT_EQ(bad, 0) << "step " << step << ": elements differing from the masked reference";
    EXPECT_EQ(stats->lost_experts, lost_chosen) << "step " << step;
    EXPECT_GT(stats->lost_choices, 0);
  }
}

}  // namespace
}  // namespace gpu_rank_mask_test
}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
