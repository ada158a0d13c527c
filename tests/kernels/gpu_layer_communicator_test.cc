#include "kernels/gpu_layer_communicator.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/gloo_collective.h"
#include "core/layer_communicator.h"
#include "core/layer_plan.h"
#include "core/parallel_groups.h"
#include "tests/core/thread_group.h"
#include "tests/kernels/gpu_test_util.h"

namespace moe_ep::kernels {
namespace {

using core::AfterMlpOp;
using core::BeforeMlpOp;
using core::DpGatherLayout;
using core::LayerActivations;
using core::LayerPlan;
using core::ParallelLayout;
using core::ScatterMode;

constexpr int64_t kH = 256;
constexpr float kEps = 1e-6f;
// GPU vs CPU: data movement and adds are bitwise equal; the norm's sum of
// squares is a tree on the GPU and ascending on the CPU, so normed values
// agree to fp32 rounding: |gpu - cpu| <= kAbsTol + kRelTol * |cpu|.
constexpr float kAbsTol = 2e-6f;
constexpr float kRelTol = 1e-5f;

std::vector<float> Random(uint64_t seed, int64_t n) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

core::RmsNorm MakeNorm(uint64_t seed) {
  std::vector<float> w = Random(seed, kH);
  for (float& x : w) x = 1.0f + 0.5f * x;
  return *core::RmsNorm::Create(std::move(w), kEps);
}

void ExpectClose(const std::vector<float>& got, const std::vector<float>& want,
                 const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  int bad = 0;
  for (size_t i = 0; i < got.size() && bad < 3; ++i) {
    if (!(std::fabs(got[i] - want[i]) <= kAbsTol + kRelTol * std::fabs(want[i]))) {
      ADD_FAILURE() << what << " element " << i << " (row " << i / kH << "): got " << got[i]
                    << ", want " << want[i];
      ++bad;
    }
  }
}

void ExpectSameActivations(const LayerActivations& gpu, const LayerActivations& cpu,
                           const std::string& what) {
  ExpectClose(gpu.hidden, cpu.hidden, what + " hidden");
  ASSERT_EQ(gpu.residual.has_value(), cpu.residual.has_value()) << what << " residual presence";
  if (cpu.residual.has_value()) ExpectClose(*gpu.residual, *cpu.residual, what + " residual");
}

// ---------------------------------------------------------------------------
// Host-side errors: no GPU needed.

TEST(GpuLayerCommunicator, CreateRejectsNullGroups) {
  const auto c = GpuLayerCommunicator::Create(nullptr, LayerPlan{}, kH);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(c.status().message().find("groups"), std::string::npos) << c.status();
}

TEST(GpuLayerActivations, CreateRejectsBadSizes) {
  const auto a = GpuLayerActivations::Create(0, -1, kH);
  EXPECT_EQ(a.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(a.status().message().find("capacity_rows"), std::string::npos) << a.status();
  const auto b = GpuLayerActivations::Create(0, 4, 0);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(b.status().message().find("hidden"), std::string::npos) << b.status();
}

// ---------------------------------------------------------------------------
// One GPU, tp 1: the documented errors of the steps and the activations.

TEST(GpuLayerCommunicator, StepErrorsOnOneRank) {
  MOE_EP_REQUIRE_GPUS(1);
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  auto world = NcclCollective::Create(*id, 0, 1, 0, std::chrono::seconds(30));
  ASSERT_TRUE(world.ok()) << world.status();
  const ParallelLayout layout{1, 1, 0};
  auto groups = GpuParallelGroups::Create(world->get(), layout);
  ASSERT_TRUE(groups.ok()) << groups.status();
  auto plans = core::PlanLayers(layout, {false}, false);
  ASSERT_TRUE(plans.ok()) << plans.status();
  const LayerPlan& plan = (*plans)[0];
  GpuLayerCommunicatorOptions bad;
  bad.all_reduce_norm = static_cast<AllReduceNormImpl>(9);
  EXPECT_EQ(GpuLayerCommunicator::Create(groups->get(), plan, kH, bad).status().code(),
            absl::StatusCode::kInvalidArgument);
  auto comm = GpuLayerCommunicator::Create(groups->get(), plan, kH);
  ASSERT_TRUE(comm.ok()) << comm.status();
  auto dp = core::ComputeDpGatherLayout({4}, 1, false, 0);
  ASSERT_TRUE(dp.ok());
  auto norm = DeviceRmsNorm::Upload(MakeNorm(1), 0);
  ASSERT_TRUE(norm.ok()) << norm.status();
  auto act = GpuLayerActivations::Create(0, 4, kH);
  ASSERT_TRUE(act.ok()) << act.status();

  // Rows that do not match the mode.
  ASSERT_TRUE((*act)->Upload(LayerActivations{Random(1, 3 * kH), std::nullopt}).ok());
  absl::Status s = (*comm)->PrepareAttention(*dp, **norm, **act);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("hidden in TP_ATTN_FULL must have 4 rows, got 3"), std::string::npos)
      << s;
  // No residual before the MLP step.
  ASSERT_TRUE((*act)->SetRows(4, -1).ok());
  s = (*comm)->PrepareMlp(*dp, **norm, **act);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("no residual"), std::string::npos) << s;
  // A layout of another shape.
  auto dp2 = core::ComputeDpGatherLayout({4, 4}, 1, false, 1);
  ASSERT_TRUE(dp2.ok());
  s = (*comm)->PrepareAttention(*dp2, **norm, **act);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("does not fit"), std::string::npos) << s;
  // A norm of another width.
  auto narrow = core::RmsNorm::Create(std::vector<float>(8, 1.0f), kEps);
  auto dnarrow = DeviceRmsNorm::Upload(*narrow, 0);
  ASSERT_TRUE(dnarrow.ok());
  s = (*comm)->PrepareAttention(*dp, **dnarrow, **act);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("norm has hidden 8"), std::string::npos) << s;
  // Activations too small for the step.
  auto dp_big = core::ComputeDpGatherLayout({6}, 1, false, 0);
  ASSERT_TRUE(dp_big.ok());
  s = (*comm)->PrepareAttention(*dp_big, **norm, **act);
  EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted);
  EXPECT_NE(s.message().find("hold 4 rows, the plan needs 6"), std::string::npos) << s;
  // An after-MLP op the plan does not allow.
  s = (*comm)->PostMlp(*dp, AfterMlpOp::kTakeSplit, **act);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not allowed"), std::string::npos) << s;
  // Activations: rows beyond capacity, uploads of a bad size.
  EXPECT_EQ((*act)->SetRows(5, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*act)->SetRows(-1, -1).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*act)->Upload(LayerActivations{std::vector<float>(kH + 1), std::nullopt}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*act)->Upload(LayerActivations{Random(2, 5 * kH), std::nullopt}).code(),
            absl::StatusCode::kInvalidArgument);
  // Nothing was enqueued by the failed steps; the group is healthy.
  EXPECT_TRUE((*comm)->Synchronize().ok());
}

// ---------------------------------------------------------------------------
// Two (four) GPUs: every step of every plan the planner builds for the layout, on
// NCCL, against core::LayerCommunicator over a Gloo pair on the same inputs.

struct RankEnv {
  int rank = 0;
  core::ParallelGroups* cpu = nullptr;
  GpuParallelGroups* gpu = nullptr;
};

// Runs fn on layout.tp_size threads, rank r on GPU r, each with a Gloo and an
// NCCL world and ParallelGroups over both.
void RunRanks(const ParallelLayout& layout, const std::function<void(RankEnv&)>& fn) {
  const int n = layout.tp_size;
  auto store = core::testing::NewHashStore();
  auto id = NcclCollective::NewUniqueId();
  ASSERT_TRUE(id.ok()) << id.status();
  core::testing::RunOnRanks(n, [&](int rank) {
    ASSERT_EQ(cudaSetDevice(rank), cudaSuccess);
    auto gloo = core::testing::JoinLoopback(store, rank, n);
    ASSERT_TRUE(gloo.ok()) << gloo.status();
    auto nccl = NcclCollective::Create(*id, rank, n, rank, std::chrono::seconds(30));
    ASSERT_TRUE(nccl.ok()) << nccl.status();
    auto cpu = core::ParallelGroups::Create(gloo->get(), layout);
    ASSERT_TRUE(cpu.ok()) << cpu.status();
    auto gpu = GpuParallelGroups::Create(nccl->get(), layout);
    ASSERT_TRUE(gpu.ok()) << gpu.status();
    RankEnv env{rank, cpu->get(), gpu->get()};
    fn(env);
  });
}

// Every plan BuildLayerPlan accepts for the layout (attention TP_ATTN_FULL,
// the other four modes free, moe_dense_tp_size 0, 1 and attn_tp_size),
// deduplicated, in a fixed order (the same on every rank).
std::vector<LayerPlan> AllPlans(const ParallelLayout& base) {
  const ScatterMode modes[] = {ScatterMode::kScattered, ScatterMode::kTpAttnFull,
                               ScatterMode::kFull};
  std::map<std::string, LayerPlan> unique;
  for (int moe_dense : {0, 1, base.attn_tp_size()}) {
    ParallelLayout layout = base;
    layout.moe_dense_tp_size = moe_dense;
    if (!core::ValidateLayout(layout).ok()) continue;
    for (ScatterMode in : modes) {
      for (ScatterMode res : modes) {
        for (ScatterMode mlp : modes) {
          for (ScatterMode out : modes) {
            core::LayerModes m{in, ScatterMode::kTpAttnFull, res, mlp, out};
            auto plan = core::BuildLayerPlan(layout, 0, false, m);
            if (!plan.ok()) continue;
            const std::string key =
                absl::StrCat(core::ScatterModeName(in), "/", core::ScatterModeName(res), "/",
                             core::ScatterModeName(mlp), "/", core::ScatterModeName(out), " ",
                             core::StepName(plan->before_attention), " ",
                             core::DescribeBeforeMlp(*plan), " ", core::DescribeAfterMlp(*plan));
            unique.emplace(key, *plan);
          }
        }
      }
    }
  }
  std::vector<LayerPlan> out;
  out.reserve(unique.size());
  for (auto& [key, plan] : unique) out.push_back(plan);
  return out;
}

// A SUM_LEN layout built by hand for attn_tp 1. With attn_dp 2 the §4 rule
// never picks SUM_LEN (2 * sum >= 2 * max always), so two GPUs reach the
// packed layout only this way; the communicators take any valid layout.
DpGatherLayout SumLenLayout(const std::vector<int64_t>& counts, int dp_rank) {
  DpGatherLayout dp;
  dp.mode = core::DpPaddingMode::kSumLen;
  dp.attn_tp_size = 1;
  dp.dp_rank = dp_rank;
  dp.aligned_counts = counts;
  dp.padded_counts = counts;
  for (int64_t c : counts) {
    dp.offsets.push_back(dp.global_rows);
    dp.global_rows += c;
  }
  dp.local_rows = counts[dp_rank];
  return dp;
}

struct DpCase {
  std::vector<int64_t> counts;
  bool hand_sum_len = false;
};

int64_t Rows(const DpGatherLayout& dp, ScatterMode mode) { return core::ModeRows(dp, mode); }

// Runs one step on the CPU and on the GPU (fused and unfused options) from
// the same input and compares. `run_cpu` / `run_gpu` return the step status.
void CompareStep(
    const std::string& what, const LayerActivations& input, GpuLayerActivations& act,
    const std::vector<GpuLayerCommunicator*>& gpu_comms,
    const std::function<absl::Status(LayerActivations&)>& run_cpu,
    const std::function<absl::Status(GpuLayerCommunicator&, GpuLayerActivations&)>& run_gpu) {
  LayerActivations cpu = input;
  ASSERT_TRUE(run_cpu(cpu).ok()) << what << " (cpu)";
  for (GpuLayerCommunicator* comm : gpu_comms) {
    const std::string label =
        absl::StrCat(what, " [", AllReduceNormImplName(comm->AllReduceNormFor(0)), "]");
    ASSERT_TRUE(act.Upload(input).ok()) << label;
    const absl::Status s = run_gpu(*comm, act);
    ASSERT_TRUE(s.ok()) << label << ": " << s;
    ASSERT_TRUE(comm->Synchronize().ok()) << label;
    auto got = act.Download();
    ASSERT_TRUE(got.ok()) << got.status();
    ExpectSameActivations(*got, cpu, label);
  }
}

// For each plan and DP case: step 1 with and without a residual, step 2,
// step 3 with the plan's op (and the MAX_LEN reduce-scatter where the plan
// says dp_scatter), each from seeded random inputs of the right shapes.
// Adds the op names covered to `covered` (for the coverage check).
void CheckAllSteps(RankEnv& env, const std::vector<DpCase>& cases, std::set<std::string>& covered) {
  const std::vector<LayerPlan> plans = AllPlans(env.cpu->layout());
  EXPECT_FALSE(plans.empty());
  const core::RmsNorm norm = MakeNorm(42);
  auto dnorm = DeviceRmsNorm::Upload(norm, env.rank);
  EXPECT_TRUE(dnorm.ok()) << dnorm.status();
  if (!dnorm.ok()) return;
  uint64_t seed = 1000 * env.rank;
  for (const DpCase& c : cases) {
    DpGatherLayout dp;
    if (c.hand_sum_len) {
      dp = SumLenLayout(c.counts, env.cpu->dp_rank());
    } else {
      auto computed =
          core::ComputeDpGatherLayout(c.counts, env.cpu->attn_tp_size(), false, env.cpu->dp_rank());
      EXPECT_TRUE(computed.ok()) << computed.status();
      if (!computed.ok()) return;
      dp = *computed;
    }
    auto act = GpuLayerActivations::Create(env.rank, dp.global_rows, kH);
    EXPECT_TRUE(act.ok()) << act.status();
    if (!act.ok()) return;
    for (const LayerPlan& plan : plans) {
      const std::string where = absl::StrCat(
          "rank ", env.rank, " counts [", absl::StrJoin(c.counts, ","), "] ",
          core::DpPaddingModeName(dp.mode), " plan ", core::ScatterModeName(plan.input), "/",
          core::ScatterModeName(plan.residual), "/", core::ScatterModeName(plan.mlp), "/",
          core::ScatterModeName(plan.output), " ");
      auto cpu_comm = core::LayerCommunicator::Create(env.cpu, plan, kH);
      EXPECT_TRUE(cpu_comm.ok()) << cpu_comm.status();
      GpuLayerCommunicatorOptions unfused;
      unfused.all_reduce_norm = AllReduceNormImpl::kUnfused;
      auto fused_comm = GpuLayerCommunicator::Create(env.gpu, plan, kH);
      auto unfused_comm = GpuLayerCommunicator::Create(env.gpu, plan, kH, unfused);
      EXPECT_TRUE(fused_comm.ok() && unfused_comm.ok());
      if (!cpu_comm.ok() || !fused_comm.ok() || !unfused_comm.ok()) return;
      const std::vector<GpuLayerCommunicator*> both = {fused_comm->get(), unfused_comm->get()};
      const std::vector<GpuLayerCommunicator*> fused_only = {fused_comm->get()};

      // Step 1.
      for (bool with_residual : {false, true}) {
        LayerActivations in{Random(++seed, Rows(dp, plan.input) * kH), std::nullopt};
        if (with_residual) in.residual = Random(++seed, Rows(dp, plan.input) * kH);
        CompareStep(
            where + "before_attention" + (with_residual ? " +residual" : ""), in, **act, fused_only,
            [&](LayerActivations& a) { return cpu_comm->PrepareAttention(dp, norm, a); },
            [&](GpuLayerCommunicator& g, GpuLayerActivations& a) {
              return g.PrepareAttention(dp, **dnorm, a);
            });
      }
      covered.insert(core::StepName(plan.before_attention));

      // Step 2: fused and unfused where the step has an all-reduce + norm.
      {
        LayerActivations in{Random(++seed, Rows(dp, plan.attention) * kH),
                            Random(++seed, Rows(dp, plan.input) * kH)};
        const bool has_all_reduce_norm = plan.before_mlp == BeforeMlpOp::kAllReduceAddNorm ||
                                         plan.before_mlp == BeforeMlpOp::kAttnTpAllReduceNorm;
        CompareStep(
            where + core::DescribeBeforeMlp(plan), in, **act,
            has_all_reduce_norm ? both : fused_only,
            [&](LayerActivations& a) { return cpu_comm->PrepareMlp(dp, norm, a); },
            [&](GpuLayerCommunicator& g, GpuLayerActivations& a) {
              return g.PrepareMlp(dp, **dnorm, a);
            });
        covered.insert(core::StepName(plan.before_mlp));
      }

      // Step 3.
      std::vector<AfterMlpOp> ops = {plan.after_mlp};
      if (plan.after_mlp == AfterMlpOp::kDpScatter) ops.push_back(AfterMlpOp::kReduceScatter);
      for (AfterMlpOp op : ops) {
        const bool residual = op != AfterMlpOp::kTakeSplit;
        LayerActivations in{Random(++seed, Rows(dp, plan.mlp) * kH), std::nullopt};
        if (residual) in.residual = Random(++seed, Rows(dp, plan.residual) * kH);
        const std::string what = where + core::StepName(op);
        if (op == AfterMlpOp::kReduceScatter && dp.mode != core::DpPaddingMode::kMaxLen) {
          // Both paths refuse before any collective (so no rank waits).
          LayerActivations cpu = in;
          EXPECT_EQ(cpu_comm->PostMlp(dp, op, cpu).code(), absl::StatusCode::kFailedPrecondition);
          ASSERT_TRUE((*act)->Upload(in).ok());
          const absl::Status s = (*fused_comm)->PostMlp(dp, op, **act);
          EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << what << ": " << s;
          EXPECT_NE(s.message().find("needs MAX_LEN"), std::string::npos) << s;
          continue;
        }
        CompareStep(
            what, in, **act, fused_only,
            [&](LayerActivations& a) { return cpu_comm->PostMlp(dp, op, a); },
            [&](GpuLayerCommunicator& g, GpuLayerActivations& a) { return g.PostMlp(dp, op, a); });
        covered.insert(core::StepName(op));
        // The documented preconditions, refused on the host by every rank.
        if (op == AfterMlpOp::kTakeSplit || op == AfterMlpOp::kAddResidualAllGather) {
          LayerActivations wrong = in;
          if (op == AfterMlpOp::kTakeSplit) {
            wrong.residual = Random(++seed, Rows(dp, plan.residual) * kH);
          } else {
            wrong.residual.reset();
          }
          ASSERT_TRUE((*act)->Upload(wrong).ok());
          EXPECT_EQ((*fused_comm)->PostMlp(dp, op, **act).code(),
                    absl::StatusCode::kFailedPrecondition)
              << what;
        }
      }
    }
  }
}

// tp 2, attn_dp 1 (attention TP over both GPUs): all-reduce + add + norm
// (fused and unfused), attention-TP all-gather, reduce-scatter + norm with
// the residual split, add-residual + all-gather, take-split. Token counts 5
// (aligned 6: 3 SCATTERED rows a rank), 1 (one real row, one padding) and 0
// (both ranks hold zero tokens and still take part).
TEST(GpuLayerCommunicator, TwoGpusTp2AttnDp1MatchesCpu) {
  MOE_EP_REQUIRE_GPUS(2);
  RunRanks(ParallelLayout{2, 1, 0}, [](RankEnv& env) {
    std::set<std::string> covered;
    CheckAllSteps(env, {{{5}}, {{1}}, {{0}}}, covered);
    for (const char* op : {"attn_tp_all_gather", "all_reduce_add_norm", "reduce_scatter_norm",
                           "add_residual_all_gather", "take_split"}) {
      EXPECT_TRUE(covered.count(op)) << op << " not covered on rank " << env.rank;
    }
  });
}

// tp 2, attn_dp 2 (attention DP, attn_tp 1): DP gather with the norm before
// the gather, DP scatter, the MAX_LEN reduce-scatter, norm-only steps.
// Counts [5, 2] (the §4 example's counts; its 4-rank shape does not fit two
// GPUs): MAX_LEN, padded [5, 5], global 10. [3, 0]: MAX_LEN with a zero-token
// DP group padded to 3 rows. Hand-built SUM_LEN [5, 2] (global 7, offsets
// [0, 5]) and [4, 0] (rank 1 holds zero rows and still all-reduces), and
// [0, 0] (nothing anywhere).
TEST(GpuLayerCommunicator, TwoGpusTp2AttnDp2MatchesCpu) {
  MOE_EP_REQUIRE_GPUS(2);
  RunRanks(ParallelLayout{2, 2, 0}, [](RankEnv& env) {
    auto dp = core::ComputeDpGatherLayout({5, 2}, 1, false, env.cpu->dp_rank());
    ASSERT_TRUE(dp.ok());
    EXPECT_EQ(dp->mode, core::DpPaddingMode::kMaxLen);
    EXPECT_EQ(dp->global_rows, 10);
    EXPECT_EQ(dp->local_rows, 5);
    std::set<std::string> covered;
    CheckAllSteps(env, {{{5, 2}}, {{3, 0}}, {{5, 2}, true}, {{4, 0}, true}, {{0, 0}}}, covered);
    for (const char* op : {"norm", "dp_gather", "dp_scatter", "reduce_scatter"}) {
      EXPECT_TRUE(covered.count(op)) << op << " not covered on rank " << env.rank;
    }
  });
}

// Four GPUs (skipped on the 2-GPU machine): the DESIGN §4 worked example
// itself. tp 4, attn_dp 2, counts [5, 2] -> aligned [6, 2], MAX_LEN, global 12
// rows, 3 SCATTERED rows a rank; the DP gather with the norm after the gather
// (attn_tp 2). Plus a zero-token DP group [6, 0].
TEST(GpuLayerCommunicator, FourGpusTp4AttnDp2WorkedExampleMatchesCpu) {
  MOE_EP_REQUIRE_GPUS(4);
  RunRanks(ParallelLayout{4, 2, 0}, [](RankEnv& env) {
    auto dp = core::ComputeDpGatherLayout({5, 2}, 2, false, env.cpu->dp_rank());
    ASSERT_TRUE(dp.ok());
    EXPECT_EQ(dp->mode, core::DpPaddingMode::kMaxLen);
    EXPECT_EQ(dp->global_rows, 12);
    EXPECT_EQ(dp->local_rows, 6);
    EXPECT_EQ(core::DpScatteredRowsPerRank(*dp), 3);
    std::set<std::string> covered;
    CheckAllSteps(env, {{{5, 2}}, {{6, 0}}}, covered);
    for (const char* op : {"dp_gather", "dp_scatter", "reduce_scatter", "reduce_scatter_norm",
                           "attn_tp_all_gather", "add_residual_all_gather"}) {
      EXPECT_TRUE(covered.count(op)) << op << " not covered on rank " << env.rank;
    }
  });
}

// Four GPUs: tp 4, attn_dp 4, counts [7, 1, 0, 0] -> SUM_LEN by the §4 rule
// (2 * 8 < 7 * 4), global 8 rows; ranks 2 and 3 hold zero tokens.
TEST(GpuLayerCommunicator, FourGpusTp4AttnDp4SumLenMatchesCpu) {
  MOE_EP_REQUIRE_GPUS(4);
  RunRanks(ParallelLayout{4, 4, 0}, [](RankEnv& env) {
    auto dp = core::ComputeDpGatherLayout({7, 1, 0, 0}, 1, false, env.cpu->dp_rank());
    ASSERT_TRUE(dp.ok());
    EXPECT_EQ(dp->mode, core::DpPaddingMode::kSumLen);
    EXPECT_EQ(dp->global_rows, 8);
    std::set<std::string> covered;
    CheckAllSteps(env, {{{7, 1, 0, 0}}}, covered);
    EXPECT_TRUE(covered.count("dp_gather")) << env.rank;
  });
}

}  // namespace
}  // namespace moe_ep::kernels
