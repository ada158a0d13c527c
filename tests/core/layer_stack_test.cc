#include "core/layer_stack.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <ostream>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_format.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::HasSubstr;

// Tolerances (see core/layer_stack.h): fp32 reassociation only for dense
// stacks; with sparse layers a flipped bf16 rounding at the MoE boundary
// (2^-8 relative) may propagate through later layers; 2^-7 leaves a 2x margin
// over one flip. Measured: at most ~1e-6 relative on every case below.
constexpr double kDenseTol = 1e-4;
constexpr double kSparseTol = 1.0 / 128.0;

std::vector<float> GroupTokens(int g, int64_t n, int64_t h) {
  std::vector<float> x;
  for (int64_t i = 0; i < n; ++i) {
    for (int64_t c = 0; c < h; ++c) {
      x.push_back(static_cast<float>(std::sin(0.37 * (i + 1) + 0.11 * c + 1.3 * g) +
                                     0.1 * ((c * 7 + i) % 5)));
    }
  }
  return x;
}

struct StackCase {
  std::string name;
  int tp;
  int attn_dp;
  std::vector<int64_t> counts;  // per DP group
  std::vector<bool> sparse = {false, true, true, false, true};
  int moe_dense_tp = 0;
  bool a2a = true;
  bool allow_reduce_scatter = false;
  // Expected padding mode, after-MLP ops of the first layer.
  DpPaddingMode mode = DpPaddingMode::kMaxLen;
};

// gtest prints parameters with this (the name, not the bytes).
void PrintTo(const StackCase& c, std::ostream* os) { *os << c.name; }

LayerStackConfig ConfigOf(const StackCase& c) {
  LayerStackConfig config;
  config.layout = ParallelLayout{c.tp, c.attn_dp, c.moe_dense_tp};
  config.sparse_layers = c.sparse;
  config.a2a_enabled = c.a2a;
  config.hidden = 32;
  config.dense_intermediate = 64;
  config.moe_intermediate = 32;
  config.num_experts = 8;
  config.top_k = 3;
  config.seed = 7;
  config.allow_reduce_scatter = c.allow_reduce_scatter;
  config.capacity_tokens = 64;
  return config;
}

// Runs the distributed stack on tp threads; returns each DP group's output
// (from attention-TP rank 0; the other ranks of the group must agree exactly).
std::vector<std::vector<float>> RunDistributed(const StackCase& c, const LayerStackConfig& config,
                                               std::vector<AfterMlpOp>* ops_of_rank0,
                                               DpGatherLayout* layout_of_rank0) {
  const int attn_tp = c.tp / c.attn_dp;
  std::vector<std::vector<float>> per_rank(c.tp);
  auto store = NewHashStore();
  RunOnRanks(c.tp, [&](int rank) {
    auto world = JoinLoopback(store, rank, c.tp);
    ASSERT_TRUE(world.ok()) << world.status();
    auto groups = ParallelGroups::Create(world->get(), config.layout);
    ASSERT_TRUE(groups.ok()) << groups.status();
    auto stack = DistributedLayerStack::Create(groups->get(), config);
    ASSERT_TRUE(stack.ok()) << stack.status();
    const int g = rank / attn_tp;
    std::vector<float> tokens = GroupTokens(g, c.counts[g], config.hidden);
    auto out = (*stack)->Forward(tokens, c.counts[g]);
    ASSERT_TRUE(out.ok()) << "rank " << rank << ": " << out.status();
    per_rank[rank] = *out;
    if (rank == 0) {
      *ops_of_rank0 = (*stack)->last_after_mlp_ops();
      *layout_of_rank0 = (*stack)->last_layout();
    }
  });
  std::vector<std::vector<float>> per_group(c.attn_dp);
  for (int g = 0; g < c.attn_dp; ++g) {
    per_group[g] = per_rank[g * attn_tp];
    for (int j = 1; j < attn_tp; ++j) {
      EXPECT_EQ(per_rank[g * attn_tp + j], per_group[g]) << "rank " << g * attn_tp + j;
    }
  }
  return per_group;
}

class LayerStackMatchesReference : public ::testing::TestWithParam<StackCase> {};

TEST_P(LayerStackMatchesReference, OutputOfAllLayersEqualsSingleProcess) {
  const StackCase& c = GetParam();
  const LayerStackConfig config = ConfigOf(c);
  std::vector<std::vector<float>> inputs;
  inputs.reserve(c.attn_dp);
  for (int g = 0; g < c.attn_dp; ++g) inputs.push_back(GroupTokens(g, c.counts[g], config.hidden));
  auto ref = ReferenceLayerStack(config, inputs);
  ASSERT_TRUE(ref.ok()) << ref.status();

  std::vector<AfterMlpOp> ops;
  DpGatherLayout layout;
  std::vector<std::vector<float>> got = RunDistributed(c, config, &ops, &layout);
  if (::testing::Test::HasFatalFailure()) return;
  EXPECT_EQ(layout.mode, c.mode) << DpPaddingModeName(layout.mode);
  ASSERT_EQ(ops.size(), c.sparse.size());
  if (c.allow_reduce_scatter && c.attn_dp > 1 && c.mode == DpPaddingMode::kMaxLen) {
    EXPECT_NE(std::find(ops.begin(), ops.end(), AfterMlpOp::kReduceScatter), ops.end());
  } else {
    EXPECT_EQ(std::find(ops.begin(), ops.end(), AfterMlpOp::kReduceScatter), ops.end());
  }

  const bool any_sparse = std::find(c.sparse.begin(), c.sparse.end(), true) != c.sparse.end();
  const double tol = any_sparse ? kSparseTol : kDenseTol;
  int64_t offset = 0;
  double max_err = 0;
  for (int g = 0; g < c.attn_dp; ++g) {
    ASSERT_EQ(static_cast<int64_t>(got[g].size()), c.counts[g] * config.hidden) << "group " << g;
    for (size_t i = 0; i < got[g].size(); ++i) {
      const double want = (*ref)[offset + i];
      const double err = std::abs(got[g][i] - want);
      max_err = std::max(max_err, err / (1 + std::abs(want)));
      ASSERT_LE(err, tol * (1 + std::abs(want))) << "group " << g << " element " << i;
      ASSERT_TRUE(std::isfinite(got[g][i]));
    }
    offset += static_cast<int64_t>(got[g].size());
  }
  EXPECT_EQ(offset, static_cast<int64_t>(ref->size()));
  // The output must not be trivially small: the stack did real work.
  double norm = 0;
  for (float v : *ref) norm = std::max(norm, static_cast<double>(std::abs(v)));
  if (!ref->empty()) {
    EXPECT_GT(norm, 0.5);
  }
  RecordProperty("max_rel_err", absl::StrFormat("%.3g", max_err));
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LayerStackMatchesReference,
    ::testing::Values(
        StackCase{"tp2_dp1", 2, 1, {5}}, StackCase{"tp2_dp1_empty_batch", 2, 1, {0}},
        StackCase{"tp2_dp2_zero_group", 2, 2, {3, 0}}, StackCase{"tp4_dp1", 4, 1, {6}},
        StackCase{"tp4_dp2_zero_group", 4, 2, {5, 0}},
        StackCase{
            "tp4_dp2_reduce_scatter", 4, 2, {5, 2}, {false, true, false, true}, 0, true, true},
        StackCase{"tp4_dp4_sum_len_zero_group",
                  4,
                  4,
                  {7, 0, 3, 1},
                  {false, true, true, false, true},
                  0,
                  true,
                  false,
                  DpPaddingMode::kSumLen},
        StackCase{"tp4_dp4_max_len_reduce_scatter",
                  4,
                  4,
                  {3, 0, 2, 3},
                  {false, true, false, true},
                  0,
                  true,
                  true},
        StackCase{"tp4_dp2_dense_dp", 4, 2, {5, 0}, {false, true, false, true}, 1},
        StackCase{"tp4_dp2_dense_attn_tp_23996", 4, 2, {5, 3}, {false, true, false, true}, 2},
        StackCase{"tp4_dp2_sparse_full_no_a2a", 4, 2, {5, 0}, {false, true, true}, 0, false},
        StackCase{"tp2_dp1_sparse_full_no_a2a", 2, 1, {5}, {true, false, true}, 0, false},
        StackCase{"tp4_dp2_dense_only", 4, 2, {6, 1}, {false, false, false}},
        StackCase{"tp4_dp4_dense_only_sum_len",
                  4,
                  4,
                  {9, 1, 0, 0},
                  {false, false},
                  0,
                  true,
                  false,
                  DpPaddingMode::kSumLen}),
    [](const ::testing::TestParamInfo<StackCase>& info) { return info.param.name; });

TEST(RouteToken, DistinctIdsAndNormalizedWeightsDeterministic) {
  std::vector<int32_t> ids(4), ids2(4);
  std::vector<float> w(4), w2(4);
  std::set<int32_t> first_ids;
  for (int64_t t = 0; t < 50; ++t) {
    RouteToken(3, 1, t, 6, 4, ids.data(), w.data());
    RouteToken(3, 1, t, 6, 4, ids2.data(), w2.data());
    EXPECT_EQ(ids, ids2);
    EXPECT_EQ(w, w2);
    EXPECT_EQ(std::set<int32_t>(ids.begin(), ids.end()).size(), 4u);
    for (int32_t e : ids) {
      EXPECT_GE(e, 0);
      EXPECT_LT(e, 6);
    }
    EXPECT_NEAR(std::accumulate(w.begin(), w.end(), 0.0), 1.0, 1e-6);
    first_ids.insert(ids[0]);
  }
  EXPECT_GT(first_ids.size(), 3u);  // routing varies with the token
}

TEST(LayerStackConfig, RejectsEachBadField) {
  StackCase base{"x", 4, 2, {1, 1}};
  struct Bad {
    std::string field;
    std::function<void(LayerStackConfig&)> mutate;
  };
  std::vector<Bad> bads = {
      {"attn_dp_size", [](LayerStackConfig& c) { c.layout.attn_dp_size = 3; }},
      {"sparse_layers", [](LayerStackConfig& c) { c.sparse_layers.clear(); }},
      {"hidden", [](LayerStackConfig& c) { c.hidden = 0; }},
      {"dense_intermediate", [](LayerStackConfig& c) { c.dense_intermediate = 6; }},
      {"moe_intermediate", [](LayerStackConfig& c) { c.moe_intermediate = 0; }},
      {"num_experts", [](LayerStackConfig& c) { c.num_experts = 3; }},
      {"top_k", [](LayerStackConfig& c) { c.top_k = 9; }},
      {"rms_eps", [](LayerStackConfig& c) { c.rms_eps = 0; }},
      {"capacity_tokens", [](LayerStackConfig& c) { c.capacity_tokens = 0; }},
  };
  for (const Bad& bad : bads) {
    LayerStackConfig config = ConfigOf(base);
    bad.mutate(config);
    absl::Status s = ValidateLayerStackConfig(config);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << bad.field;
    EXPECT_THAT(std::string(s.message()), HasSubstr(bad.field));
    EXPECT_EQ(ReferenceLayerStack(config, {{}, {}}).status().code(),
              absl::StatusCode::kInvalidArgument);
  }
  EXPECT_TRUE(ValidateLayerStackConfig(ConfigOf(base)).ok());
}

TEST(ReferenceLayerStack, RejectsWrongGroupCountAndRaggedTokens) {
  LayerStackConfig config = ConfigOf(StackCase{"x", 4, 2, {1, 1}});
  auto s = ReferenceLayerStack(config, {{}});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("attn_dp_size 2"));
  s = ReferenceLayerStack(config, {{}, std::vector<float>(33, 1.0f)});
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.status().message()), HasSubstr("dp_tokens[1]"));
}

TEST(ReferenceLayerStack, ReportsEachLayerInOrderWithoutChangingTheResult) {
  LayerStackConfig config = ConfigOf(StackCase{"x", 2, 2, {3, 2}});  // 5 layers
  const std::vector<std::vector<float>> tokens = {std::vector<float>(3 * 32, 0.25f),
                                                  std::vector<float>(2 * 32, -0.5f)};
  std::vector<int> seen;
  auto with = ReferenceLayerStack(config, tokens, [&](int layer) { seen.push_back(layer); });
  ASSERT_TRUE(with.ok()) << with.status();
  EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4}));
  auto without = ReferenceLayerStack(config, tokens);
  ASSERT_TRUE(without.ok()) << without.status();
  EXPECT_EQ(*with, *without);
}

TEST(DistributedLayerStack, RejectsBadArgumentsAndDisagreeingGroupCounts) {
  StackCase c{"x", 2, 1, {2}, {true, false}};
  LayerStackConfig config = ConfigOf(c);
  EXPECT_EQ(DistributedLayerStack::Create(nullptr, config).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto store = NewHashStore();
  RunOnRanks(2, [&](int rank) {
    auto world = JoinLoopback(store, rank, 2);
    ASSERT_TRUE(world.ok()) << world.status();
    auto groups = ParallelGroups::Create(world->get(), config.layout);
    ASSERT_TRUE(groups.ok()) << groups.status();
    LayerStackConfig other = config;
    other.layout.attn_dp_size = 2;
    auto mismatch = DistributedLayerStack::Create(groups->get(), other);
    EXPECT_EQ(mismatch.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(mismatch.status().message()), HasSubstr("differs from the groups'"));
    auto stack = DistributedLayerStack::Create(groups->get(), config);
    ASSERT_TRUE(stack.ok()) << stack.status();
    // Local argument errors: no communication happens.
    EXPECT_EQ((*stack)->Forward(std::vector<float>(10, 0.0f), 1).status().code(),
              absl::StatusCode::kInvalidArgument);
    EXPECT_EQ((*stack)->Forward({}, -1).status().code(), absl::StatusCode::kInvalidArgument);
    // Ranks 0 and 1 form one DP group but pass 1 and 2 tokens: every rank
    // sees it after the count all-gather.
    const int64_t n = rank + 1;
    auto out = (*stack)->Forward(GroupTokens(0, n, config.hidden), n);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(out.status().message()), HasSubstr("DP group 0: ranks 0 and 1"));
    // The stack stays usable for a correct step.
    auto ok = (*stack)->Forward(GroupTokens(0, 2, config.hidden), 2);
    EXPECT_TRUE(ok.ok()) << ok.status();
  });
}

TEST(DistributedLayerStack, ScatteredRowsBeyondCapacityAreResourceExhausted) {
  StackCase c{"x", 2, 2, {9, 1}, {true}};
  LayerStackConfig config = ConfigOf(c);
  config.capacity_tokens = 4;  // SCATTERED rows: 9 and 1 > 4 on rank 0
  auto store = NewHashStore();
  RunOnRanks(2, [&](int rank) {
    auto world = JoinLoopback(store, rank, 2);
    ASSERT_TRUE(world.ok()) << world.status();
    auto groups = ParallelGroups::Create(world->get(), config.layout);
    ASSERT_TRUE(groups.ok()) << groups.status();
    auto stack = DistributedLayerStack::Create(groups->get(), config);
    ASSERT_TRUE(stack.ok()) << stack.status();
    auto out = (*stack)->Forward(GroupTokens(rank, c.counts[rank], config.hidden), c.counts[rank]);
    EXPECT_EQ(out.status().code(), absl::StatusCode::kResourceExhausted) << out.status();
  });
}

}  // namespace
}  // namespace moe_ep::core
