// The worked examples of DESIGN §3 and §4 (DP gather and scatter under
// MAX_LEN and SUM_LEN, zero-token ranks, the scattered path's reduce-scatter
// and all-gather, the attention-TP all-reduce) through what the layer stack
// runs for one layer: each step's program (core/step_program.h) on a
// core::HostStepExecutor over the rank's groups.

#include <cmath>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dp_padding.h"
#include "core/layer_plan.h"
#include "core/parallel_groups.h"
#include "core/rms_norm.h"
#include "core/step_executor.h"
#include "core/step_program.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::moe_ep::core::testing::JoinLoopback;
using ::moe_ep::core::testing::NewHashStore;
using ::moe_ep::core::testing::RunOnRanks;
using ::testing::HasSubstr;

constexpr int64_t kH = 4;
constexpr float kEps = 1e-6f;
constexpr double kTol = 1e-5;

using TokenFn = std::function<double(int64_t token, int64_t col)>;

// Hand-chosen token values: residual X, attention partial P_j of attention-TP
// rank j (their sum over j is the attention output A).
double X(int64_t t, int64_t c) { return 0.5 + 0.1 * t - 0.2 * c; }
double P(int j, int64_t t, int64_t c) { return 0.05 * (j + 1) * (c + 1) - 0.03 * t + 0.01 * j; }
double A(int attn_tp, int64_t t, int64_t c) {
  double sum = 0;
  for (int j = 0; j < attn_tp; ++j) sum += P(j, t, c);
  return sum;
}
double NormWeight(int64_t c) { return 1.0 + 0.25 * c; }

// Naive RMSNorm of one row given by `f`, column `c` (double precision).
double NormOf(const std::function<double(int64_t)>& f, int64_t c) {
  double sum_sq = 0;
  for (int64_t k = 0; k < kH; ++k) sum_sq += f(k) * f(k);
  return f(c) / std::sqrt(sum_sq / kH + kEps) * NormWeight(c);
}

RmsNorm MakeNorm() {
  std::vector<float> w;
  for (int64_t c = 0; c < kH; ++c) w.push_back(static_cast<float>(NormWeight(c)));
  return *RmsNorm::Create(std::move(w), kEps);
}

int64_t Prefix(const std::vector<int64_t>& counts, int g) {
  int64_t p = 0;
  for (int i = 0; i < g; ++i) p += counts[i];
  return p;
}

// Rows [first, first + rows) of DP group g's TP_ATTN_FULL tensor from f;
// padding rows (index >= counts[g]) are zero.
std::vector<float> GroupRows(const std::vector<int64_t>& counts, int g, int64_t first, int64_t rows,
                             const TokenFn& f) {
  std::vector<float> out;
  for (int64_t i = first; i < first + rows; ++i) {
    for (int64_t c = 0; c < kH; ++c) {
      out.push_back(i < counts[g] ? static_cast<float>(f(Prefix(counts, g) + i, c)) : 0.0f);
    }
  }
  return out;
}

// Expected value of row i of DP group g, or 0 for padding.
void ExpectRows(const std::vector<float>& got, const std::vector<int64_t>& counts, int g,
                int64_t first, int64_t rows, const TokenFn& f, const std::string& what) {
  ASSERT_EQ(static_cast<int64_t>(got.size()), rows * kH) << what;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = first + r;
    for (int64_t c = 0; c < kH; ++c) {
      const double want = i < counts[g] ? f(Prefix(counts, g) + i, c) : 0.0;
      EXPECT_NEAR(got[r * kH + c], want, kTol)
          << what << " group " << g << " row " << i << " col " << c;
    }
  }
}

struct RankEnv {
  int rank;
  ParallelGroups* groups;
  DpGatherLayout dp;
};

// Runs fn on tp ranks, each with ParallelGroups for `layout` and the DP layout
// of `counts`.
void RunRanks(const ParallelLayout& layout, const std::vector<int64_t>& counts,
              const std::function<void(RankEnv&)>& fn) {
  auto store = NewHashStore();
  RunOnRanks(layout.tp_size, [&](int rank) {
    auto world = JoinLoopback(store, rank, layout.tp_size);
    ASSERT_TRUE(world.ok()) << world.status();
    auto groups = ParallelGroups::Create(world->get(), layout);
    ASSERT_TRUE(groups.ok()) << groups.status();
    auto dp = ComputeDpGatherLayout(counts, layout.attn_tp_size(), false, (*groups)->dp_rank());
    ASSERT_TRUE(dp.ok()) << dp.status();
    RankEnv env{rank, groups->get(), *dp};
    fn(env);
  });
}

// One layer's three communication steps on one rank, as core/layer_stack.cc
// runs them: build the step's program, run it on a HostStepExecutor.
struct LayerSteps {
  const ParallelGroups* groups = nullptr;
  LayerPlan plan;

  absl::Status PrepareAttention(const DpGatherLayout& dp, const RmsNorm& norm,
                                LayerActivations& act) const {
    absl::StatusOr<StepProgram> program = BuildBeforeAttentionProgram(
        plan, groups->layout(), groups->rank(), dp, act.residual.has_value());
    if (!program.ok()) return program.status();
    return HostStepExecutor(groups, kH).Run(*program, &norm, act);
  }
  absl::Status PrepareMlp(const DpGatherLayout& dp, const RmsNorm& norm,
                          LayerActivations& act) const {
    absl::StatusOr<StepProgram> program =
        BuildBeforeMlpProgram(plan, groups->layout(), groups->rank(), dp);
    if (!program.ok()) return program.status();
    return HostStepExecutor(groups, kH).Run(*program, &norm, act);
  }
  AfterMlpOp ResolveAfterMlp(const DpGatherLayout& dp, bool allow_reduce_scatter) const {
    return ResolveAfterMlpOp(plan, dp.mode, allow_reduce_scatter);
  }
  absl::Status PostMlp(const DpGatherLayout& dp, AfterMlpOp op, LayerActivations& act) const {
    absl::StatusOr<StepProgram> program = BuildAfterMlpProgram(
        plan, groups->layout(), groups->rank(), dp, op, act.residual.has_value());
    if (!program.ok()) return program.status();
    return HostStepExecutor(groups, kH).Run(*program, nullptr, act);
  }
};

LayerSteps MakeComm(const RankEnv& env, const LayerPlan& plan) {
  return LayerSteps{env.groups, plan};
}

TokenFn AplusX(int attn_tp) {
  return [attn_tp](int64_t t, int64_t c) { return A(attn_tp, t, c) + X(t, c); };
}
TokenFn NormOfAplusX(int attn_tp) {
  return [attn_tp](int64_t t, int64_t c) {
    return NormOf([&](int64_t k) { return A(attn_tp, t, k) + X(t, k); }, c);
  };
}
TokenFn PartialFn(int j) {
  return [j](int64_t t, int64_t c) { return P(j, t, c); };
}

// DESIGN §4 worked example through the dense layer of tp 4, attn_dp 2:
// dp_gather[norm_after_gather] then dp_scatter or the MAX_LEN reduce-scatter.
TEST(LayerStepPrograms, WorkedExampleDpGatherAndScatterMaxLen) {
  const ParallelLayout layout{4, 2, 0};
  const std::vector<int64_t> counts = {5, 2};
  auto plans = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(plans.ok());
  const LayerPlan& plan = (*plans)[0];
  ASSERT_EQ(plan.before_mlp, BeforeMlpOp::kDpGatherAfterResidual);
  ASSERT_FALSE(plan.norm_before_gather);
  ASSERT_EQ(plan.after_mlp, AfterMlpOp::kDpScatter);
  RunRanks(layout, counts, [&](RankEnv& env) {
    const int g = env.groups->dp_rank(), j = env.groups->attn_tp_rank();
    EXPECT_EQ(env.dp.mode, DpPaddingMode::kMaxLen);
    EXPECT_EQ(env.dp.global_rows, 12);
    EXPECT_EQ(ModeRows(env.dp, ScatterMode::kTpAttnFull), 6);
    EXPECT_EQ(ModeRows(env.dp, ScatterMode::kScattered), 3);
    EXPECT_EQ(ModeRows(env.dp, ScatterMode::kFull), 12);
    LayerSteps comm = MakeComm(env, plan);
    RmsNorm norm = MakeNorm();

    // Step 1: input norm creates the residual; no communication (T -> T).
    LayerActivations act;
    act.hidden = GroupRows(counts, g, 0, 6, X);
    ASSERT_TRUE(comm.PrepareAttention(env.dp, norm, act).ok());
    ASSERT_TRUE(act.residual.has_value());
    ExpectRows(*act.residual, counts, g, 0, 6, X, "residual");
    ExpectRows(
        act.hidden, counts, g, 0, 6,
        [](int64_t t, int64_t c) { return NormOf([&](int64_t k) { return X(t, k); }, c); },
        "input norm");

    // Step 2: partial attention output; the gather sums the partials.
    act.hidden = GroupRows(counts, g, 0, 6, PartialFn(j));
    ASSERT_TRUE(comm.PrepareMlp(env.dp, norm, act).ok());
    for (int gg = 0; gg < 2; ++gg) {
      std::vector<float> rows(act.hidden.begin() + gg * 6 * kH,
                              act.hidden.begin() + (gg + 1) * 6 * kH);
      ExpectRows(rows, counts, gg, 0, 6, NormOfAplusX(2), "gathered");
    }
    ExpectRows(*act.residual, counts, g, 0, 6, AplusX(2), "residual slice");

    // Step 3a: complete MLP output -> dp_scatter.
    EXPECT_EQ(comm.ResolveAfterMlp(env.dp, false), AfterMlpOp::kDpScatter);
    EXPECT_EQ(comm.ResolveAfterMlp(env.dp, true), AfterMlpOp::kReduceScatter);
    LayerActivations scatter = act;
    for (int64_t i = 0; i < 12 * kH; ++i) scatter.hidden[i] = 0.5f * i;
    ASSERT_TRUE(comm.PostMlp(env.dp, AfterMlpOp::kDpScatter, scatter).ok());
    ASSERT_EQ(scatter.hidden.size(), 6 * kH);
    for (int64_t i = 0; i < 6 * kH; ++i)
      EXPECT_FLOAT_EQ(scatter.hidden[i], 0.5f * (g * 6 * kH + i));
    EXPECT_EQ(scatter.residual, act.residual);

    // Step 3b: partial MLP output (rank r holds (r + 1) * q) -> reduce-scatter
    // = 10 * q of this group's rows on every rank of the group.
    LayerActivations rs = act;
    for (int64_t i = 0; i < 12 * kH; ++i) rs.hidden[i] = (env.rank + 1) * 0.25f * i;
    ASSERT_TRUE(comm.PostMlp(env.dp, AfterMlpOp::kReduceScatter, rs).ok());
    ASSERT_EQ(rs.hidden.size(), 6 * kH);
    for (int64_t i = 0; i < 6 * kH; ++i)
      EXPECT_FLOAT_EQ(rs.hidden[i], 10 * 0.25f * (g * 6 * kH + i));
  });
}

// SUM_LEN: tp 4, attn_dp 4 (attn_tp 1), counts [7, 1, 0, 0]: aligned sum 8,
// 2*8 < 7*4 -> SUM_LEN, global 8 rows, offsets [0, 7, 8, 8]; ranks 2 and 3
// hold zero tokens and still take part. The norm runs before the gather.
TEST(LayerStepPrograms, SumLenGatherWithZeroTokenRanks) {
  const ParallelLayout layout{4, 4, 0};
  const std::vector<int64_t> counts = {7, 1, 0, 0};
  auto plans = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(plans.ok());
  const LayerPlan& plan = (*plans)[0];
  ASSERT_TRUE(plan.norm_before_gather);
  RunRanks(layout, counts, [&](RankEnv& env) {
    const int g = env.groups->dp_rank();
    EXPECT_EQ(env.dp.mode, DpPaddingMode::kSumLen);
    EXPECT_EQ(env.dp.global_rows, 8);
    const int64_t local = counts[g];
    EXPECT_EQ(env.dp.local_rows, local);
    LayerSteps comm = MakeComm(env, plan);
    RmsNorm norm = MakeNorm();
    LayerActivations act;
    act.hidden = GroupRows(counts, g, 0, local, PartialFn(0));
    act.residual = GroupRows(counts, g, 0, local, X);
    ASSERT_TRUE(comm.PrepareMlp(env.dp, norm, act).ok());
    ASSERT_EQ(act.hidden.size(), 8 * kH);
    std::vector<float> g0(act.hidden.begin(), act.hidden.begin() + 7 * kH);
    std::vector<float> g1(act.hidden.begin() + 7 * kH, act.hidden.end());
    ExpectRows(g0, counts, 0, 0, 7, NormOfAplusX(1), "group 0");
    ExpectRows(g1, counts, 1, 0, 1, NormOfAplusX(1), "group 1");
    ExpectRows(*act.residual, counts, g, 0, local, AplusX(1), "residual");

    EXPECT_EQ(comm.ResolveAfterMlp(env.dp, true), AfterMlpOp::kDpScatter);
    LayerActivations rs = act;
    absl::Status s = comm.PostMlp(env.dp, AfterMlpOp::kReduceScatter, rs);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(s.message()), HasSubstr("SUM_LEN"));
    ASSERT_TRUE(comm.PostMlp(env.dp, AfterMlpOp::kDpScatter, act).ok());
    ExpectRows(act.hidden, counts, g, 0, local, NormOfAplusX(1), "scattered back");
  });
}

// The issue text's counts [6, 0] on 2 DP groups of attn_tp 2: 2*6 >= 6*2, so
// the §4 rule gives MAX_LEN (the zero-token group is padded to 6 rows).
TEST(LayerStepPrograms, CountsSixZeroOnTwoGroupsIsMaxLen) {
  auto dp = ComputeDpGatherLayout(std::vector<int64_t>{6, 0}, 2, false, 1);
  ASSERT_TRUE(dp.ok());
  EXPECT_EQ(dp->mode, DpPaddingMode::kMaxLen);
  EXPECT_EQ(ModeRows(*dp, ScatterMode::kTpAttnFull), 6);
  EXPECT_EQ(ModeRows(*dp, ScatterMode::kScattered), 3);
}

// Without DP attention (tp 2, attn_dp 1): all-reduce, then add-and-norm.
TEST(LayerStepPrograms, AllReduceAddNormWithoutDpAttention) {
  const ParallelLayout layout{2, 1, 0};
  const std::vector<int64_t> counts = {3};  // aligned to 4 rows
  auto plans = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(plans.ok());
  const LayerPlan& plan = (*plans)[0];
  ASSERT_EQ(plan.before_mlp, BeforeMlpOp::kAllReduceAddNorm);
  ASSERT_EQ(plan.after_mlp, AfterMlpOp::kNone);
  RunRanks(layout, counts, [&](RankEnv& env) {
    const int j = env.groups->attn_tp_rank();
    LayerSteps comm = MakeComm(env, plan);
    RmsNorm norm = MakeNorm();
    LayerActivations act;
    act.hidden = GroupRows(counts, 0, 0, 4, PartialFn(j));
    act.residual = GroupRows(counts, 0, 0, 4, X);
    ASSERT_TRUE(comm.PrepareMlp(env.dp, norm, act).ok());
    ExpectRows(act.hidden, counts, 0, 0, 4, NormOfAplusX(2), "hidden");
    ExpectRows(*act.residual, counts, 0, 0, 4, AplusX(2), "residual");
    const std::vector<float> before = act.hidden;
    ASSERT_TRUE(comm.PostMlp(env.dp, AfterMlpOp::kNone, act).ok());
    EXPECT_EQ(act.hidden, before);
  });
}

// Two sparse layers (tp 4, attn_dp 2, a2a): reduce_scatter_norm with and
// without split_residual, the before-attention all-gather of SCATTERED input,
// and add_residual_all_gather.
TEST(LayerStepPrograms, ScatteredPathReduceScatterAllGatherAndAddResidual) {
  const ParallelLayout layout{4, 2, 0};
  const std::vector<int64_t> counts = {5, 2};
  auto plans = PlanLayers(layout, {true, true}, true);
  ASSERT_TRUE(plans.ok());
  const LayerPlan& l0 = (*plans)[0];
  const LayerPlan& l1 = (*plans)[1];
  ASSERT_EQ(l0.before_mlp, BeforeMlpOp::kReduceScatterNorm);
  ASSERT_TRUE(l0.split_residual);
  ASSERT_EQ(l1.before_attention, BeforeAttentionOp::kAttnTpAllGather);
  ASSERT_FALSE(l1.split_residual);
  ASSERT_EQ(l1.after_mlp, AfterMlpOp::kAddResidualAllGather);
  // M: MLP output of layer 0 on SCATTERED rows; R = residual after layer 0.
  auto M = [](int64_t t, int64_t c) { return 0.3 - 0.05 * t * (c + 1); };
  RunRanks(layout, counts, [&](RankEnv& env) {
    const int g = env.groups->dp_rank(), j = env.groups->attn_tp_rank();
    LayerSteps c0 = MakeComm(env, l0), c1 = MakeComm(env, l1);
    RmsNorm norm = MakeNorm();
    LayerActivations act;
    act.hidden = GroupRows(counts, g, 0, 6, PartialFn(j));
    act.residual = GroupRows(counts, g, 0, 6, X);
    ASSERT_TRUE(c0.PrepareMlp(env.dp, norm, act).ok());
    ExpectRows(act.hidden, counts, g, 3 * j, 3, NormOfAplusX(2), "l0 hidden split");
    ExpectRows(*act.residual, counts, g, 3 * j, 3, AplusX(2), "l0 residual split");
    ASSERT_TRUE(c0.PostMlp(env.dp, AfterMlpOp::kNone, act).ok());

    // Layer 1 input: SCATTERED hidden M, residual R = A + X.
    act.hidden = GroupRows(counts, g, 3 * j, 3, M);
    ASSERT_TRUE(c1.PrepareAttention(env.dp, norm, act).ok());
    auto MR = [&](int64_t t, int64_t c) { return M(t, c) + AplusX(2)(t, c); };
    ExpectRows(*act.residual, counts, g, 3 * j, 3, MR, "l1 residual");
    ExpectRows(
        act.hidden, counts, g, 0, 6,
        [&](int64_t t, int64_t c) { return NormOf([&](int64_t k) { return MR(t, k); }, c); },
        "l1 gathered norm");

    act.hidden = GroupRows(counts, g, 0, 6, PartialFn(j));
    ASSERT_TRUE(c1.PrepareMlp(env.dp, norm, act).ok());
    auto AMR = [&](int64_t t, int64_t c) { return A(2, t, c) + MR(t, c); };
    ExpectRows(*act.residual, counts, g, 3 * j, 3, AMR, "l1 residual out");
    ExpectRows(
        act.hidden, counts, g, 3 * j, 3,
        [&](int64_t t, int64_t c) { return NormOf([&](int64_t k) { return AMR(t, k); }, c); },
        "l1 hidden out");

    act.hidden = GroupRows(counts, g, 3 * j, 3, M);
    ASSERT_TRUE(c1.PostMlp(env.dp, AfterMlpOp::kAddResidualAllGather, act).ok());
    EXPECT_FALSE(act.residual.has_value());
    ExpectRows(
        act.hidden, counts, g, 0, 6, [&](int64_t t, int64_t c) { return M(t, c) + AMR(t, c); },
        "l1 output");
  });
}

// A SCATTERED residual entering a FULL dense MLP: dp_gather[gather_residual,
// norm_after_gather].
TEST(LayerStepPrograms, DpGatherGathersScatteredResidualFirst) {
  const ParallelLayout layout{4, 2, 0};
  const std::vector<int64_t> counts = {2, 5};
  auto plans = PlanLayers(layout, {true, false}, true);
  ASSERT_TRUE(plans.ok());
  const LayerPlan& plan = (*plans)[1];
  ASSERT_EQ(plan.before_mlp, BeforeMlpOp::kDpGatherAfterResidual);
  ASSERT_TRUE(plan.gather_residual);
  RunRanks(layout, counts, [&](RankEnv& env) {
    const int g = env.groups->dp_rank(), j = env.groups->attn_tp_rank();
    LayerSteps comm = MakeComm(env, plan);
    RmsNorm norm = MakeNorm();
    LayerActivations act;
    act.hidden = GroupRows(counts, g, 0, 6, PartialFn(j));
    act.residual = GroupRows(counts, g, 3 * j, 3, X);
    ASSERT_TRUE(comm.PrepareMlp(env.dp, norm, act).ok());
    for (int gg = 0; gg < 2; ++gg) {
      std::vector<float> rows(act.hidden.begin() + gg * 6 * kH,
                              act.hidden.begin() + (gg + 1) * 6 * kH);
      ExpectRows(rows, counts, gg, 0, 6, NormOfAplusX(2), "gathered");
    }
    ExpectRows(*act.residual, counts, g, 0, 6, AplusX(2), "residual");
  });
}

// sglang issue 23996: moe_dense_tp_size == attn_tp_size: attention-TP
// all-reduce then norm, trivial after-MLP step.
TEST(LayerStepPrograms, AttnTpAllReduceNormExtension) {
  const ParallelLayout layout{4, 2, 2};
  const std::vector<int64_t> counts = {5, 0};
  auto plans = PlanLayers(layout, {true, false}, true);
  ASSERT_TRUE(plans.ok());
  const LayerPlan& plan = (*plans)[1];
  ASSERT_EQ(plan.before_mlp, BeforeMlpOp::kAttnTpAllReduceNorm);
  ASSERT_TRUE(plan.gather_residual);
  ASSERT_EQ(plan.after_mlp, AfterMlpOp::kNone);
  RunRanks(layout, counts, [&](RankEnv& env) {
    const int g = env.groups->dp_rank(), j = env.groups->attn_tp_rank();
    LayerSteps comm = MakeComm(env, plan);
    RmsNorm norm = MakeNorm();
    LayerActivations act;
    act.hidden = GroupRows(counts, g, 0, 6, PartialFn(j));
    act.residual = GroupRows(counts, g, 3 * j, 3, X);
    ASSERT_TRUE(comm.PrepareMlp(env.dp, norm, act).ok());
    ExpectRows(act.hidden, counts, g, 0, 6, NormOfAplusX(2), "hidden");
    ExpectRows(*act.residual, counts, g, 0, 6, AplusX(2), "residual");
  });
}

// (TP_ATTN_FULL, TP_ATTN_FULL) -> SCATTERED: take this rank's split; a
// residual is a precondition error.
TEST(LayerStepPrograms, TakeSplitRequiresNoResidual) {
  const ParallelLayout layout{4, 2, 0};
  const std::vector<int64_t> counts = {5, 2};
  const ScatterMode T = ScatterMode::kTpAttnFull;
  auto plan = BuildLayerPlan(layout, 0, false, LayerModes{T, T, T, T, ScatterMode::kScattered});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->after_mlp, AfterMlpOp::kTakeSplit);
  RunRanks(layout, counts, [&](RankEnv& env) {
    const int g = env.groups->dp_rank(), j = env.groups->attn_tp_rank();
    LayerSteps comm = MakeComm(env, *plan);
    LayerActivations act;
    act.hidden = GroupRows(counts, g, 0, 6, X);
    act.residual = act.hidden;
    absl::Status s = comm.PostMlp(env.dp, AfterMlpOp::kTakeSplit, act);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
    EXPECT_THAT(std::string(s.message()), HasSubstr("requires no residual"));
    EXPECT_EQ(act.hidden.size(), 6 * kH);  // unchanged
    act.residual.reset();
    ASSERT_TRUE(comm.PostMlp(env.dp, AfterMlpOp::kTakeSplit, act).ok());
    ExpectRows(act.hidden, counts, g, 3 * j, 3, X, "split");
  });
}

TEST(LayerStepPrograms, RejectsBadInputBeforeAnyCommunication) {
  const ParallelLayout layout{1, 1, 0};
  const std::vector<int64_t> counts = {2};
  auto plans = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(plans.ok());
  const LayerPlan& plan = (*plans)[0];
  RunRanks(layout, counts, [&](RankEnv& env) {
    LayerSteps comm = MakeComm(env, plan);
    RmsNorm norm = MakeNorm();
    // Wrong row count.
    LayerActivations act;
    act.hidden.assign(3 * kH, 1.0f);
    absl::Status s = comm.PrepareAttention(env.dp, norm, act);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("must have 2 rows"));
    EXPECT_FALSE(act.residual.has_value());
    // No residual before the MLP (the input norm makes one).
    act.hidden.assign(2 * kH, 1.0f);
    s = comm.PrepareMlp(env.dp, norm, act);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("residual must have 2 rows * H 4, got none"));
    // A layout for another DP structure.
    auto other = ComputeDpGatherLayout(std::vector<int64_t>{2, 2}, 1, false, 0);
    ASSERT_TRUE(other.ok());
    s = comm.PrepareAttention(*other, norm, act);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("does not fit rank 0"));
    // An op the plan does not allow.
    act.residual = act.hidden;
    s = comm.PostMlp(env.dp, AfterMlpOp::kReduceScatter, act);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(s.message()), HasSubstr("not allowed"));
    // A norm of another hidden size.
    auto small = RmsNorm::Create({1.0f}, kEps);
    s = comm.PrepareMlp(env.dp, *small, act);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  });
}

}  // namespace
}  // namespace moe_ep::core
