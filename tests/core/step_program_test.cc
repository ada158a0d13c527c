#include "core/step_program.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

// The step programs of core/step_program.h against programs worked out by
// hand from DESIGN §3 / §4 (the expected strings are written from the
// layout arithmetic, not from the builder).

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

// DESIGN §4 worked example: tp 4, attn_dp 2, counts [5, 2] -> aligned [6, 2],
// MAX_LEN, padded [6, 6], offsets [0, 6], global 12, local 6, SCATTERED 3.
const ParallelLayout kTp4Dp2{4, 2, 0};
DpGatherLayout WorkedExample(int rank) {
  return *ComputeDpGatherLayout({5, 2}, 2, false, rank / 2);
}

// DeepSeek-style pattern: three dense layers, then sparse; a2a on.
std::vector<LayerPlan> DeepSeekPlans(const ParallelLayout& layout) {
  return *PlanLayers(layout, {false, false, false, true, true}, true);
}

std::vector<std::string> Describe(const std::vector<LayerStepPrograms>& programs, int layer) {
  const LayerStepPrograms& l = programs[layer];
  return {DescribeStepProgram(l.before_attention), DescribeStepProgram(l.before_mlp),
          DescribeStepProgram(l.after_mlp)};
}

TEST(BuildStackPrograms, WorkedExampleRankZeroAddsTheResidualBeforeTheDpGather) {
  auto programs = BuildStackPrograms(DeepSeekPlans(kTp4Dp2), kTp4Dp2, 0, WorkedExample(0), false);
  ASSERT_TRUE(programs.ok()) << programs.status();
  ASSERT_EQ(programs->size(), 5u);
  // Layer 0: no residual yet; dense FULL MLP through the summing DP gather
  // (attn_tp 2: norm after the gather); DP scatter of this group's rows 0-5.
  EXPECT_THAT(Describe(*programs, 0),
              ::testing::ElementsAre("store_and_norm(6)",
                                     "add_residual(6); place(hidden, 6 -> 12 at 0); "
                                     "all_reduce(hidden, world, 12); "
                                     "slice(residual := hidden[0, 6)); norm(12)",
                                     "slice(hidden := hidden[0, 6))"));
  EXPECT_EQ((*programs)[0].after_mlp_op, AfterMlpOp::kDpScatter);
  // Layer 1 starts with the residual layer 0 kept.
  EXPECT_EQ(DescribeStepProgram((*programs)[1].before_attention), "add_and_norm(6)");
}

TEST(BuildStackPrograms, WorkedExampleRankThree) {
  auto programs = BuildStackPrograms(DeepSeekPlans(kTp4Dp2), kTp4Dp2, 3, WorkedExample(3), false);
  ASSERT_TRUE(programs.ok()) << programs.status();
  // Attention-TP rank 1 of DP group 1: no residual add, rows at offset 6.
  EXPECT_EQ(DescribeStepProgram((*programs)[0].before_mlp),
            "place(hidden, 6 -> 12 at 6); all_reduce(hidden, world, 12); "
            "slice(residual := hidden[6, 12)); norm(12)");
  EXPECT_EQ(DescribeStepProgram((*programs)[0].after_mlp), "slice(hidden := hidden[6, 12))");
  // Layer 3 (first sparse, MLP SCATTERED): reduce-scatter in the attention-TP
  // group, this rank's split of the TP_ATTN_FULL residual (rows 3-5); no
  // after-MLP step (SCATTERED stays).
  EXPECT_THAT(Describe(*programs, 3),
              ::testing::ElementsAre("add_and_norm(6)",
                                     "reduce_scatter(hidden, attn_tp, 6 -> 3); "
                                     "slice(residual := residual[3, 6)); add_and_norm(3)",
                                     ""));
  // Layer 4 (last): SCATTERED input gathered for attention; the residual is
  // already SCATTERED; the last output goes back to TP_ATTN_FULL with the
  // residual folded in.
  EXPECT_THAT(Describe(*programs, 4),
              ::testing::ElementsAre("add_and_norm(3); all_gather(hidden, attn_tp, 3 -> 6)",
                                     "reduce_scatter(hidden, attn_tp, 6 -> 3); add_and_norm(3)",
                                     "add_residual_drop(3); all_gather(hidden, attn_tp, 3 -> 6)"));
  EXPECT_EQ((*programs)[4].after_mlp.residual_rows_out, -1);
  EXPECT_EQ((*programs)[4].after_mlp.hidden_rows_out, 6);
}

TEST(BuildStackPrograms, MaxLenReduceScatterReplacesTheDpScatter) {
  auto programs = BuildStackPrograms(DeepSeekPlans(kTp4Dp2), kTp4Dp2, 3, WorkedExample(3), true);
  ASSERT_TRUE(programs.ok()) << programs.status();
  EXPECT_EQ((*programs)[0].after_mlp_op, AfterMlpOp::kReduceScatter);
  // 12 global rows over 4 ranks: 3 each, gathered back to this group's 6.
  EXPECT_EQ(DescribeStepProgram((*programs)[0].after_mlp),
            "reduce_scatter(hidden, world, 12 -> 3); all_gather(hidden, attn_tp, 3 -> 6)");
}

TEST(BuildBeforeMlpProgram, ScatteredResidualIsGatheredBeforeTheDpGather) {
  // tp 4, attn_dp 2: layer 0 sparse (SCATTERED output), layer 1 dense FULL.
  auto plans = PlanLayers(kTp4Dp2, {true, false}, true);
  ASSERT_TRUE(plans.ok()) << plans.status();
  ASSERT_TRUE((*plans)[1].gather_residual);
  auto p = BuildBeforeMlpProgram((*plans)[1], kTp4Dp2, 2, WorkedExample(2));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(DescribeStepProgram(*p),
            "all_gather(residual, attn_tp, 3 -> 6); add_residual(6); "
            "place(hidden, 6 -> 12 at 6); all_reduce(hidden, world, 12); "
            "slice(residual := hidden[6, 12)); norm(12)");
  EXPECT_EQ(p->MaxRows(), 12);
  EXPECT_TRUE(p->UsesNorm());
}

TEST(BuildBeforeMlpProgram, AttnTpOneNormsBeforeTheGather) {
  // tp 2, attn_dp 2: counts [5, 2] -> MAX_LEN (2 * 7 >= 5 * 2), global 10.
  const ParallelLayout layout{2, 2, 0};
  auto plans = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(plans.ok());
  auto dp = ComputeDpGatherLayout({5, 2}, 1, false, 1);
  ASSERT_TRUE(dp.ok());
  auto p = BuildBeforeMlpProgram((*plans)[0], layout, 1, *dp);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(DescribeStepProgram(*p),
            "add_and_norm(5); place(hidden, 5 -> 10 at 5); all_reduce(hidden, world, 10)");
}

TEST(BuildBeforeMlpProgram, WithoutDpAttentionAllReducesThenAddsAndNorms) {
  // tp 2, attn_dp 1: 5 tokens aligned to 6 rows on both ranks.
  const ParallelLayout layout{2, 1, 0};
  auto plans = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(plans.ok());
  auto dp = ComputeDpGatherLayout({5}, 2, false, 0);
  ASSERT_TRUE(dp.ok());
  auto p = BuildBeforeMlpProgram((*plans)[0], layout, 1, *dp);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(DescribeStepProgram(*p), "all_reduce(hidden, world, 6); add_and_norm(6)");
  // FULL and TP_ATTN_FULL have the same group size here: no after-MLP step.
  auto after = BuildAfterMlpProgram((*plans)[0], layout, 1, *dp, (*plans)[0].after_mlp, true);
  ASSERT_TRUE(after.ok());
  EXPECT_EQ(DescribeStepProgram(*after), "");
  EXPECT_FALSE(after->UsesNorm());
}

TEST(BuildBeforeMlpProgram, DenseMlpInTheAttentionTpGroupAllReducesThere) {
  // sglang issue 23996: moe_dense_tp_size == attn_tp_size 2.
  const ParallelLayout layout{4, 2, 2};
  auto plans = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(plans.ok());
  auto p = BuildBeforeMlpProgram((*plans)[0], layout, 1, WorkedExample(1));
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(DescribeStepProgram(*p), "all_reduce(hidden, attn_tp, 6); add_and_norm(6)");
}

TEST(BuildAfterMlpProgram, TakeSplitSlicesThisRanksRows) {
  // (TP_ATTN_FULL, TP_ATTN_FULL) -> SCATTERED on attention-TP rank 1 of
  // group 0 (rank 1): rows [3, 6).
  auto plan =
      BuildLayerPlan(kTp4Dp2, 0, false,
                     {ScatterMode::kTpAttnFull, ScatterMode::kTpAttnFull, ScatterMode::kTpAttnFull,
                      ScatterMode::kTpAttnFull, ScatterMode::kScattered});
  ASSERT_TRUE(plan.ok()) << plan.status();
  ASSERT_EQ(plan->after_mlp, AfterMlpOp::kTakeSplit);
  auto p = BuildAfterMlpProgram(*plan, kTp4Dp2, 1, WorkedExample(1), AfterMlpOp::kTakeSplit, false);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(DescribeStepProgram(*p), "slice(hidden := hidden[3, 6))");
  // With a residual it is refused.
  auto with =
      BuildAfterMlpProgram(*plan, kTp4Dp2, 1, WorkedExample(1), AfterMlpOp::kTakeSplit, true);
  EXPECT_EQ(with.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(with.status().message()), HasSubstr("requires no residual"));
}

TEST(BuildAfterMlpProgram, RefusesOpsThePlanOrPaddingDoNotAllow) {
  const std::vector<LayerPlan> plans = DeepSeekPlans(kTp4Dp2);
  auto wrong =
      BuildAfterMlpProgram(plans[0], kTp4Dp2, 0, WorkedExample(0), AfterMlpOp::kTakeSplit, false);
  EXPECT_EQ(wrong.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(wrong.status().message()),
              HasSubstr("layer 0, step after_mlp: op take_split is not allowed by the plan's "
                        "dp_scatter"));
  // tp 4, attn_dp 4, counts [7, 1, 0, 0]: SUM_LEN (2 * 8 < 7 * 4).
  const ParallelLayout layout{4, 4, 0};
  auto dense = PlanLayers(layout, {false}, true);
  ASSERT_TRUE(dense.ok());
  auto dp = ComputeDpGatherLayout({7, 1, 0, 0}, 1, false, 2);
  ASSERT_TRUE(dp.ok());
  ASSERT_EQ(dp->mode, DpPaddingMode::kSumLen);
  auto rs = BuildAfterMlpProgram((*dense)[0], layout, 2, *dp, AfterMlpOp::kReduceScatter, true);
  EXPECT_EQ(rs.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(rs.status().message()),
              HasSubstr("rank 2: needs MAX_LEN padding, the step has SUM_LEN"));
  // Rank 2 holds zero tokens and still scatters its (empty) slice at row 8.
  auto ok = BuildAfterMlpProgram((*dense)[0], layout, 2, *dp, AfterMlpOp::kDpScatter, true);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(DescribeStepProgram(*ok), "slice(hidden := hidden[8, 8))");
  // Add-residual + all-gather without a residual.
  auto plans_s = PlanLayers(kTp4Dp2, {true}, true);
  ASSERT_TRUE(plans_s.ok());
  auto none = BuildAfterMlpProgram((*plans_s)[0], kTp4Dp2, 0, WorkedExample(0),
                                   AfterMlpOp::kAddResidualAllGather, false);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(none.status().message()), HasSubstr("needs a residual"));
}

TEST(BuildBeforeAttentionProgram, RejectsALayoutOfAnotherRank) {
  const std::vector<LayerPlan> plans = DeepSeekPlans(kTp4Dp2);
  // Rank 2 is in DP group 1; the layout was made for group 0.
  auto p = BuildBeforeAttentionProgram(plans[0], kTp4Dp2, 2, WorkedExample(0), false);
  EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(p.status().message()), HasSubstr("does not fit rank 2"));
}

// ---------------------------------------------------------------------------
// ValidateStepProgram on hand-made programs.

StepPrimitive ProgramPrim(StepOp op, StepTensor t, int64_t in, int64_t out,
                          StepGroup g = StepGroup::kAttnTp) {
  StepPrimitive p;
  p.op = op;
  p.tensor = t;
  p.source = t;
  p.group = g;
  p.rows_in = in;
  p.rows_out = out;
  return p;
}

StepProgram MakeProgram(int64_t h_in, int64_t r_in, std::vector<StepPrimitive> prims, int64_t h_out,
                        int64_t r_out) {
  StepProgram p;
  p.label = "test";
  p.hidden_rows_in = h_in;
  p.residual_rows_in = r_in;
  p.primitives = std::move(prims);
  p.hidden_rows_out = h_out;
  p.residual_rows_out = r_out;
  return p;
}

TEST(ValidateStepProgram, AcceptsAWellFormedProgram) {
  // attn_tp 2, tp 4: gather 3 -> 6, reduce-scatter 12 -> 3 over the world.
  StepProgram p = MakeProgram(3, 3,
                              {ProgramPrim(StepOp::kAddAndNorm, StepTensor::kHidden, 3, 3),
                               ProgramPrim(StepOp::kAllGather, StepTensor::kHidden, 3, 6)},
                              6, 3);
  EXPECT_TRUE(ValidateStepProgram(p, kTp4Dp2).ok());
  StepProgram rs = MakeProgram(
      12, -1, {ProgramPrim(StepOp::kReduceScatter, StepTensor::kHidden, 12, 3, StepGroup::kWorld)},
      3, -1);
  EXPECT_TRUE(ValidateStepProgram(rs, kTp4Dp2).ok());
}

TEST(ValidateStepProgram, RejectsEachMalformedPrimitive) {
  struct Case {
    StepProgram program;
    std::string fragment;
  };
  StepPrimitive slice = ProgramPrim(StepOp::kSlice, StepTensor::kHidden, 6, 3);
  slice.first = 4;  // [4, 7) of 6 rows
  StepPrimitive place = ProgramPrim(StepOp::kPlace, StepTensor::kHidden, 6, 10);
  place.first = 6;  // [6, 12) of 10 rows
  const std::vector<Case> cases = {
      {MakeProgram(3, -1, {ProgramPrim(StepOp::kNorm, StepTensor::kHidden, 4, 4)}, 4, -1),
       "rows_in must be the 3 rows hidden holds, got 4"},
      {MakeProgram(3, -1, {ProgramPrim(StepOp::kAllGather, StepTensor::kHidden, 3, 12)}, 12, -1),
       "rows_out must be 6, got 12"},
      {MakeProgram(
           6, -1,
           {ProgramPrim(StepOp::kReduceScatter, StepTensor::kHidden, 6, 1, StepGroup::kWorld)}, 1,
           -1),
       "not a multiple of the world group size 4"},
      {MakeProgram(6, -1, {ProgramPrim(StepOp::kAddAndNorm, StepTensor::kHidden, 6, 6)}, 6, -1),
       "needs a residual of hidden's 6 rows, got none"},
      {MakeProgram(6, 6, {ProgramPrim(StepOp::kStoreAndNorm, StepTensor::kHidden, 6, 6)}, 6, 6),
       "needs no residual"},
      {MakeProgram(6, -1, {slice}, 3, -1), "rows [4, 7) are outside the 6 rows read"},
      {MakeProgram(6, -1, {place}, 10, -1), "rows [6, 12) are outside the 10 rows written"},
      {MakeProgram(6, -1, {ProgramPrim(StepOp::kAllReduce, StepTensor::kResidual, 6, 6)}, 6, -1),
       "reads the residual, there is none"},
      {MakeProgram(6, -1, {ProgramPrim(StepOp::kNorm, StepTensor::kHidden, 6, 6)}, 3, -1),
       "ends with hidden 6 rows and residual -1 rows (-1 = none), expected 3 and -1"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateStepProgram(c.program, kTp4Dp2);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.fragment;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.fragment));
  }
}

TEST(ModeRows, WorkedExample) {
  const DpGatherLayout dp = WorkedExample(0);
  EXPECT_EQ(ModeRows(dp, ScatterMode::kScattered), 3);
  EXPECT_EQ(ModeRows(dp, ScatterMode::kTpAttnFull), 6);
  EXPECT_EQ(ModeRows(dp, ScatterMode::kFull), 12);
}

}  // namespace
}  // namespace moe_ep::core
