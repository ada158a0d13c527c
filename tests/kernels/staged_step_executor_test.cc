#include "kernels/staged_step_executor.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/gloo_collective.h"
#include "core/layer_stack.h"
#include "core/parallel_groups.h"
#include "kernels/nccl_collective.h"
#include "kernels/staged_control_collective.h"
#include "tests/core/thread_group.h"
#include "tests/kernels/gpu_test_util.h"

// core::DistributedLayerStack with its communication steps on the device
// executor (kernels::StagedStepExecutor over NCCL groups: what ForwardLayers
// runs on NCCL workers, issue 11) against core::ReferenceLayerStack computed
// on the host. One GPU runs world 1; the (tp, attn_dp) cases (2,1), (2,2),
// (4,2), (4,4) need that many GPUs and skip, printing why, on fewer.
// Tolerance (core/layer_stack.h): sparse stacks |out - ref| <= 2^-7 (1 +
// |ref|), dense-only 1e-4 (1 + |ref|); the device norm's tree sum and NCCL's
// all-reduce order are fp32 reassociations like the host path's.

namespace moe_ep::kernels {
namespace {

constexpr double kSparseTol = 1.0 / 128.0;
constexpr double kDenseTol = 1e-4;

struct StackCase {
  core::ParallelLayout layout;
  std::vector<bool> sparse;
  bool a2a = true;
  std::vector<int64_t> counts;  // [attn_dp] tokens per DP group
  bool allow_reduce_scatter = false;
};

std::string Name(const StackCase& c) {
  std::string pattern;
  for (bool s : c.sparse) pattern += s ? 'S' : 'D';
  return absl::StrCat("tp ", c.layout.tp_size, " attn_dp ", c.layout.attn_dp_size, " moe_dense_tp ",
                      c.layout.moe_dense_tp_size, " layers ", pattern, " a2a ", c.a2a, " counts [",
                      absl::StrJoin(c.counts, ","), "] rs ", c.allow_reduce_scatter);
}

core::LayerStackConfig Config(const StackCase& c) {
  core::LayerStackConfig config;
  config.layout = c.layout;
  config.sparse_layers = c.sparse;
  config.a2a_enabled = c.a2a;
  config.hidden = 64;
  config.dense_intermediate = 128;
  config.moe_intermediate = 32;
  config.num_experts = 8;
  config.top_k = 3;
  config.seed = 11;
  config.capacity_tokens = 64;
  config.allow_reduce_scatter = c.allow_reduce_scatter;
  return config;
}

std::vector<float> GroupTokens(int g, int64_t n, int64_t hidden) {
  std::vector<float> x;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < hidden; ++c) {
      x.push_back(static_cast<float>(std::sin(0.37 * (i + 1) + 0.11 * c + 1.3 * g) +
                                     0.1 * ((c * 7 + i) % 5)));
    }
  }
  return x;
}

// Runs the stack on tp_size GPUs (rank r on GPU r, one thread each) with the
// device executor and checks every rank's output against the reference.
void ExpectDeviceStackMatchesReference(const StackCase& c) {
  SCOPED_TRACE(Name(c));
  const core::LayerStackConfig config = Config(c);
  const int n = c.layout.tp_size;
  const int attn_tp = c.layout.attn_tp_size();
  std::vector<std::vector<float>> dp_tokens;
  dp_tokens.reserve(c.layout.attn_dp_size);
  for (int g = 0; g < c.layout.attn_dp_size; ++g) {
    dp_tokens.push_back(GroupTokens(g, c.counts[g], config.hidden));
  }
  auto ref = core::ReferenceLayerStack(config, dp_tokens);
  ASSERT_TRUE(ref.ok()) << ref.status();
  bool any_sparse = false;
  for (bool s : c.sparse) any_sparse |= s;
  const double tol = any_sparse ? kSparseTol : kDenseTol;
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  core::testing::RunOnRanks(n, [&](int rank) {
    ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
    auto nccl = NcclCollective::Create(*id, rank, n, rank, std::chrono::seconds(60));
    ASSERT_TRUE(nccl.ok()) << nccl.status();
    StagedControlCollective world(nccl->get());
    auto groups = core::ParallelGroups::Create(&world, c.layout, "stack");
    ASSERT_TRUE(groups.ok()) << groups.status();
    auto exec = StagedStepExecutor::Create(**groups, config.hidden);
    ASSERT_TRUE(exec.ok()) << exec.status();
    auto stack = core::DistributedLayerStack::Create(groups->get(), config, std::move(*exec));
    ASSERT_TRUE(stack.ok()) << stack.status();
    EXPECT_EQ((*stack)->executor().name(), "device");
    const int g = rank / attn_tp;
    // Twice: the second step reuses the device buffers and norms.
    for (int step = 0; step < 2; ++step) {
      auto out = (*stack)->Forward(dp_tokens[g], c.counts[g]);
      ASSERT_TRUE(out.ok()) << "rank " << rank << ": " << out.status();
      ASSERT_EQ(static_cast<int64_t>(out->size()), c.counts[g] * config.hidden);
      int64_t offset = 0;
      for (int gg = 0; gg < g; ++gg) offset += c.counts[gg] * config.hidden;
      int bad = 0;
      for (size_t i = 0; i < out->size() && bad < 3; ++i) {
        const double want = (*ref)[offset + i];
        if (!(std::abs((*out)[i] - want) <= tol * (1 + std::abs(want)))) {
          ADD_FAILURE() << "rank " << rank << " step " << step << " element " << i << ": got "
                        << (*out)[i] << ", want " << want;
          ++bad;
        }
      }
    }
  });
}

TEST(StagedStepExecutor, CreateRejectsGlooGroupsNamingTheBackend) {
  auto store = core::testing::NewHashStore();
  auto gloo = core::testing::JoinLoopback(store, 0, 1);
  ASSERT_TRUE(gloo.ok()) << gloo.status();
  auto groups = core::ParallelGroups::Create(gloo->get(), core::ParallelLayout{1, 1, 0});
  ASSERT_TRUE(groups.ok()) << groups.status();
  auto exec = StagedStepExecutor::Create(**groups, 8);
  EXPECT_EQ(exec.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(exec.status().message().find("backend is \"gloo\""), std::string::npos)
      << exec.status();
}

// World 1: dense and sparse layers, a2a on and off, zero tokens.
TEST(StagedStepExecutor, OneGpuLayerStackMatchesReference) {
  MOE_EP_REQUIRE_GPUS(1);
  ExpectDeviceStackMatchesReference({{1, 1, 0}, {false, true, true, false, true}, true, {7}});
  ExpectDeviceStackMatchesReference({{1, 1, 0}, {false, true}, false, {5}});
  ExpectDeviceStackMatchesReference({{1, 1, 1}, {false, false}, true, {3}});
  ExpectDeviceStackMatchesReference({{1, 1, 0}, {false, true}, true, {0}});
}

TEST(StagedStepExecutor, TwoGpusTp2AttnDp1MatchesReference) {
  MOE_EP_REQUIRE_GPUS(2);
  ExpectDeviceStackMatchesReference({{2, 1, 0}, {false, true, true, false, true}, true, {5}});
  ExpectDeviceStackMatchesReference({{2, 1, 0}, {false, true}, false, {3}});
}

TEST(StagedStepExecutor, TwoGpusTp2AttnDp2MatchesReference) {
  MOE_EP_REQUIRE_GPUS(2);
  ExpectDeviceStackMatchesReference({{2, 2, 0}, {false, true, true, false, true}, true, {5, 2}});
  ExpectDeviceStackMatchesReference({{2, 2, 0}, {false, true}, true, {3, 0}});
  ExpectDeviceStackMatchesReference({{2, 2, 0}, {false, false}, true, {4, 4}, true});
}

TEST(StagedStepExecutor, FourGpusTp4AttnDp2MatchesReference) {
  MOE_EP_REQUIRE_GPUS(4);
  ExpectDeviceStackMatchesReference({{4, 2, 0}, {false, true, true, false, true}, true, {5, 2}});
  ExpectDeviceStackMatchesReference({{4, 2, 2}, {false, true, false}, true, {5, 3}});
  ExpectDeviceStackMatchesReference({{4, 2, 1}, {false, true}, true, {3, 4}});
  ExpectDeviceStackMatchesReference({{4, 2, 0}, {false, true, true}, false, {5, 0}});
}

TEST(StagedStepExecutor, FourGpusTp4AttnDp4MatchesReference) {
  MOE_EP_REQUIRE_GPUS(4);
  ExpectDeviceStackMatchesReference(
      {{4, 4, 0}, {false, true, true, false, true}, true, {7, 0, 3, 1}});
}

}  // namespace
}  // namespace moe_ep::kernels
