#include "core/layer_plan.h"

#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

constexpr ScatterMode kS = ScatterMode::kScattered;
constexpr ScatterMode kT = ScatterMode::kTpAttnFull;
constexpr ScatterMode kF = ScatterMode::kFull;

// ---------------------------------------------------------------------------
// Expected plans, worked out by hand from DESIGN §3.
//
// A row is "<in><attn><res><mlp><out> <before_attention> <before_mlp> <after_mlp>"
// with modes S / T / F and step codes
//   before_attention: -  none, AG  attention-TP all-gather
//   before_mlp:       N   norm only
//                     DG  DP gather, norm after the gather; DGn: norm before
//                     AR  all-reduce + add-residual-norm (no DP attention)
//                     RS  reduce-scatter + norm; RSs: also splits the residual
//                     TAR attention-TP all-reduce + norm (issue 23996)
//                     suffix +g: all-gather the SCATTERED residual first
//   after_mlp:        -  none, DS  DP scatter, AAG add residual + all-gather,
//                     TS take split
//
// Layout categories (group sizes S / T / F):
//   a: tp 1                         1 / 1 / 1
//   b: attn_dp 1, tp > 1            1 / tp / tp    (attn_tp = tp > 1, no DP attention)
//   c: attn_dp = tp > 1             1 / 1 / tp     (attn_tp = 1, DP attention)
//   d: 1 < attn_dp < tp             1 / attn_tp / tp
//
// MLP mode sequences for the two test patterns, P1 = [D, S, S, S] (dense
// first, DeepSeek-like) and P2 = [S, D, S, D] (interleaved):
//   a2a on,  moe_dense unset: P1 F S S S   P2 S F S F
//   a2a on,  moe_dense 1:     P1 S S S S   P2 S S S S
//   a2a off, moe_dense unset: P1 F F F F   P2 F F F F
//   a2a off, moe_dense 1:     P1 S F F F   P2 F S F S
// Residual = S for an S MLP else T; output = residual except the last layer
// (T); input = T for layer 0, else the previous output.
// ---------------------------------------------------------------------------

using Table = std::vector<std::string>;

const std::map<std::string, Table>& ExpectedTables() {
  static const auto* tables = new std::map<std::string, Table>{
      // --- sequence F S S S ---
      {"a/FSSS", {"TTTFT - N -", "TTSSS - N -", "STSSS - N -", "STSST - N -"}},
      {"b/FSSS", {"TTTFT - AR -", "TTSSS - RSs -", "STSSS AG RS -", "STSST AG RS AAG"}},
      {"c/FSSS", {"TTTFT - DGn DS", "TTSSS - N -", "STSSS - N -", "STSST - N -"}},
      {"d/FSSS", {"TTTFT - DG DS", "TTSSS - RSs -", "STSSS AG RS -", "STSST AG RS AAG"}},
      // --- sequence S S S S ---
      {"a/SSSS", {"TTSSS - N -", "STSSS - N -", "STSSS - N -", "STSST - N -"}},
      {"b/SSSS", {"TTSSS - RSs -", "STSSS AG RS -", "STSSS AG RS -", "STSST AG RS AAG"}},
      {"c/SSSS", {"TTSSS - N -", "STSSS - N -", "STSSS - N -", "STSST - N -"}},
      {"d/SSSS", {"TTSSS - RSs -", "STSSS AG RS -", "STSSS AG RS -", "STSST AG RS AAG"}},
      // --- sequence F F F F ---
      {"a/FFFF", {"TTTFT - N -", "TTTFT - N -", "TTTFT - N -", "TTTFT - N -"}},
      {"b/FFFF", {"TTTFT - AR -", "TTTFT - AR -", "TTTFT - AR -", "TTTFT - AR -"}},
      {"c/FFFF", {"TTTFT - DGn DS", "TTTFT - DGn DS", "TTTFT - DGn DS", "TTTFT - DGn DS"}},
      {"d/FFFF", {"TTTFT - DG DS", "TTTFT - DG DS", "TTTFT - DG DS", "TTTFT - DG DS"}},
      // --- sequence S F F F ---
      {"a/SFFF", {"TTSSS - N -", "STTFT - N -", "TTTFT - N -", "TTTFT - N -"}},
      {"b/SFFF", {"TTSSS - RSs -", "STTFT AG AR+g -", "TTTFT - AR -", "TTTFT - AR -"}},
      {"c/SFFF", {"TTSSS - N -", "STTFT - DGn DS", "TTTFT - DGn DS", "TTTFT - DGn DS"}},
      {"d/SFFF", {"TTSSS - RSs -", "STTFT AG DG+g DS", "TTTFT - DG DS", "TTTFT - DG DS"}},
      // --- sequence S F S F ---
      {"a/SFSF", {"TTSSS - N -", "STTFT - N -", "TTSSS - N -", "STTFT - N -"}},
      {"b/SFSF", {"TTSSS - RSs -", "STTFT AG AR+g -", "TTSSS - RSs -", "STTFT AG AR+g -"}},
      {"c/SFSF", {"TTSSS - N -", "STTFT - DGn DS", "TTSSS - N -", "STTFT - DGn DS"}},
      {"d/SFSF", {"TTSSS - RSs -", "STTFT AG DG+g DS", "TTSSS - RSs -", "STTFT AG DG+g DS"}},
      // --- sequence F S F S ---
      {"a/FSFS", {"TTTFT - N -", "TTSSS - N -", "STTFT - N -", "TTSST - N -"}},
      {"b/FSFS", {"TTTFT - AR -", "TTSSS - RSs -", "STTFT AG AR+g -", "TTSST - RSs AAG"}},
      {"c/FSFS", {"TTTFT - DGn DS", "TTSSS - N -", "STTFT - DGn DS", "TTSST - N -"}},
      {"d/FSFS", {"TTTFT - DG DS", "TTSSS - RSs -", "STTFT AG DG+g DS", "TTSST - RSs AAG"}},
  };
  return *tables;
}

ScatterMode ModeOf(char c) {
  switch (c) {
    case 'S':
      return kS;
    case 'T':
      return kT;
    default:
      return kF;
  }
}

struct ExpectedRow {
  LayerModes modes;
  BeforeAttentionOp before_attention;
  BeforeMlpOp before_mlp;
  bool gather_residual = false;
  bool norm_before_gather = false;
  bool split_residual = false;
  AfterMlpOp after_mlp;
};

ExpectedRow ParseRow(const std::string& row) {
  std::vector<std::string> f = absl::StrSplit(row, ' ');
  EXPECT_EQ(f.size(), 4u) << row;
  ExpectedRow e;
  e.modes = {ModeOf(f[0][0]), ModeOf(f[0][1]), ModeOf(f[0][2]), ModeOf(f[0][3]), ModeOf(f[0][4])};
  e.before_attention =
      f[1] == "AG" ? BeforeAttentionOp::kAttnTpAllGather : BeforeAttentionOp::kNone;
  std::string bm = f[2];
  if (absl::EndsWith(bm, "+g")) {
    e.gather_residual = true;
    bm = bm.substr(0, bm.size() - 2);
  }
  if (bm == "N") {
    e.before_mlp = BeforeMlpOp::kNormOnly;
  } else if (bm == "DG" || bm == "DGn") {
    e.before_mlp = BeforeMlpOp::kDpGatherAfterResidual;
    e.norm_before_gather = bm == "DGn";
  } else if (bm == "AR") {
    e.before_mlp = BeforeMlpOp::kAllReduceAddNorm;
  } else if (bm == "RS" || bm == "RSs") {
    e.before_mlp = BeforeMlpOp::kReduceScatterNorm;
    e.split_residual = bm == "RSs";
  } else if (bm == "TAR") {
    e.before_mlp = BeforeMlpOp::kAttnTpAllReduceNorm;
  } else {
    ADD_FAILURE() << "bad before_mlp code " << bm;
  }
  if (f[3] == "-") {
    e.after_mlp = AfterMlpOp::kNone;
  } else if (f[3] == "DS") {
    e.after_mlp = AfterMlpOp::kDpScatter;
  } else if (f[3] == "AAG") {
    e.after_mlp = AfterMlpOp::kAddResidualAllGather;
  } else if (f[3] == "TS") {
    e.after_mlp = AfterMlpOp::kTakeSplit;
  } else {
    ADD_FAILURE() << "bad after_mlp code " << f[3];
  }
  return e;
}

void ExpectPlanMatches(const std::vector<LayerPlan>& plans, const std::vector<bool>& pattern,
                       const Table& table, const std::string& context) {
  ASSERT_EQ(plans.size(), table.size()) << context;
  for (size_t i = 0; i < table.size(); ++i) {
    const ExpectedRow e = ParseRow(table[i]);
    const LayerPlan& p = plans[i];
    const std::string where = context + " layer " + std::to_string(i) + " expected " + table[i];
    EXPECT_EQ(p.layer, static_cast<int>(i)) << where;
    EXPECT_EQ(p.sparse, pattern[i]) << where;
    EXPECT_EQ(p.input, e.modes.input) << where;
    EXPECT_EQ(p.attention, e.modes.attention) << where;
    EXPECT_EQ(p.residual, e.modes.residual) << where;
    EXPECT_EQ(p.mlp, e.modes.mlp) << where;
    EXPECT_EQ(p.output, e.modes.output) << where;
    EXPECT_EQ(p.before_attention, e.before_attention) << where;
    EXPECT_EQ(p.before_mlp, e.before_mlp) << where;
    EXPECT_EQ(p.gather_residual, e.gather_residual) << where;
    EXPECT_EQ(p.norm_before_gather, e.norm_before_gather) << where;
    EXPECT_EQ(p.split_residual, e.split_residual) << where;
    EXPECT_EQ(p.after_mlp, e.after_mlp) << where;
  }
}

struct LayoutCase {
  int tp;
  int attn_dp;
  char category;
};

// Every tp in {1, 2, 4, 8} with every attn_dp dividing it.
const std::vector<LayoutCase>& AllLayouts() {
  static const auto* layouts = new std::vector<LayoutCase>{
      {1, 1, 'a'}, {2, 1, 'b'}, {4, 1, 'b'}, {8, 1, 'b'}, {2, 2, 'c'},
      {4, 4, 'c'}, {8, 8, 'c'}, {4, 2, 'd'}, {8, 2, 'd'}, {8, 4, 'd'},
  };
  return *layouts;
}

TEST(PlanLayers, WholeTable) {
  const std::vector<bool> p1 = {false, true, true, true};   // dense first
  const std::vector<bool> p2 = {true, false, true, false};  // interleaved
  // (a2a, moe_dense_tp) -> MLP sequence of P1 and P2 (see the header comment).
  struct Combo {
    bool a2a;
    int moe_dense_tp;
    const char* seq_p1;
    const char* seq_p2;
  };
  const std::vector<Combo> combos = {
      {true, 0, "FSSS", "SFSF"},
      {true, 1, "SSSS", "SSSS"},
      {false, 0, "FFFF", "FFFF"},
      {false, 1, "SFFF", "FSFS"},
  };
  int checked = 0;
  for (const LayoutCase& lc : AllLayouts()) {
    for (const Combo& combo : combos) {
      ParallelLayout layout{lc.tp, lc.attn_dp, combo.moe_dense_tp};
      for (int which = 0; which < 2; ++which) {
        const std::vector<bool>& pattern = which == 0 ? p1 : p2;
        const std::string key =
            std::string(1, lc.category) + "/" + (which == 0 ? combo.seq_p1 : combo.seq_p2);
        const std::string context = "tp=" + std::to_string(lc.tp) +
                                    " attn_dp=" + std::to_string(lc.attn_dp) +
                                    " moe_dense_tp=" + std::to_string(combo.moe_dense_tp) +
                                    " a2a=" + std::to_string(combo.a2a) + " P" +
                                    std::to_string(which + 1) + " (" + key + ")";
        absl::StatusOr<std::vector<LayerPlan>> plans = PlanLayers(layout, pattern, combo.a2a);
        ASSERT_TRUE(plans.ok()) << context << ": " << plans.status();
        ExpectPlanMatches(*plans, pattern, ExpectedTables().at(key), context);
        ++checked;
      }
    }
  }
  EXPECT_EQ(checked, 10 * 4 * 2);
}

// moe_dense_tp_size == tp_size behaves as unset.
TEST(PlanLayers, ExplicitDenseTpEqualsUnset) {
  const std::vector<bool> p1 = {false, true, true, true};
  absl::StatusOr<std::vector<LayerPlan>> plans = PlanLayers({8, 2, 8}, p1, true);
  ASSERT_TRUE(plans.ok()) << plans.status();
  ExpectPlanMatches(*plans, p1, ExpectedTables().at("d/FSSS"), "tp=8 attn_dp=2 moe_dense_tp=8");
}

// sglang issue 23996: moe_dense_tp_size == attn_tp_size > 1 runs a dense MLP
// tensor-parallel inside its attention-TP group (mode TP_ATTN_FULL).
TEST(PlanLayers, DenseTpEqualsAttnTpExtension) {
  const std::vector<bool> pattern = {false, true, false, true};
  for (auto [tp, attn_dp] : std::vector<std::pair<int, int>>{{4, 2}, {8, 2}, {8, 4}}) {
    const int attn_tp = tp / attn_dp;
    const std::string context = "tp=" + std::to_string(tp) + " attn_dp=" + std::to_string(attn_dp);
    absl::StatusOr<std::vector<LayerPlan>> a2a = PlanLayers({tp, attn_dp, attn_tp}, pattern, true);
    ASSERT_TRUE(a2a.ok()) << a2a.status();
    ExpectPlanMatches(*a2a, pattern,
                      {"TTTTT - TAR -", "TTSSS - RSs -", "STTTT AG TAR+g -", "TTSST - RSs AAG"},
                      context + " a2a on");
    // Without a2a the sparse MLP is FULL.
    absl::StatusOr<std::vector<LayerPlan>> no_a2a =
        PlanLayers({tp, attn_dp, attn_tp}, pattern, false);
    ASSERT_TRUE(no_a2a.ok()) << no_a2a.status();
    ExpectPlanMatches(*no_a2a, pattern,
                      {"TTTTT - TAR -", "TTTFT - DG DS", "TTTTT - TAR -", "TTTFT - DG DS"},
                      context + " a2a off");
  }
}

// DeepSeek-V3's pattern (61 layers, 0..2 dense) at tp 8, attn_dp 8, a2a on.
TEST(PlanLayers, DeepSeekV3PatternFirstAndLastLayers) {
  std::vector<bool> pattern(61, true);
  pattern[0] = pattern[1] = pattern[2] = false;
  absl::StatusOr<std::vector<LayerPlan>> plans = PlanLayers({8, 8, 0}, pattern, true);
  ASSERT_TRUE(plans.ok()) << plans.status();
  ASSERT_EQ(plans->size(), 61u);
  // attn_tp 1 (category c): dense layers gather with the norm first.
  for (int i = 0; i < 3; ++i) {
    LayerPlan dense = (*plans)[i];
    EXPECT_EQ(dense.layer, i);
    dense.layer = 0;  // ExpectPlanMatches numbers rows from 0
    ExpectPlanMatches({dense}, {false}, {"TTTFT - DGn DS"}, "dense layer " + std::to_string(i));
  }
  const LayerPlan& first_sparse = (*plans)[3];
  EXPECT_EQ(first_sparse.input, kT);
  EXPECT_EQ(first_sparse.mlp, kS);
  EXPECT_EQ(first_sparse.output, kS);
  EXPECT_EQ(first_sparse.before_mlp, BeforeMlpOp::kNormOnly);
  const LayerPlan& last = (*plans)[60];
  EXPECT_EQ(last.input, kS);
  EXPECT_EQ(last.output, kT);
  EXPECT_EQ(last.after_mlp, AfterMlpOp::kNone);  // group sizes 1 == 1
}

TEST(PlanLayers, SingleLayerModel) {
  absl::StatusOr<std::vector<LayerPlan>> plans = PlanLayers({4, 2, 0}, {true}, true);
  ASSERT_TRUE(plans.ok()) << plans.status();
  // Layer 0 is also the last: input T, output T.
  ExpectPlanMatches(*plans, {true}, {"TTSST - RSs AAG"}, "single layer");
}

TEST(PlanLayers, RejectsInvalidLayoutAndEmptyModel) {
  auto expect = [](const absl::StatusOr<std::vector<LayerPlan>>& r, const char* fragment) {
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << r.status();
    EXPECT_THAT(r.status().message(), HasSubstr(fragment)) << r.status();
  };
  expect(PlanLayers({0, 1, 0}, {true}, true), "tp_size");
  expect(PlanLayers({4, 3, 0}, {true}, true), "attn_dp_size");
  expect(PlanLayers({4, 2, 3}, {true}, true), "moe_dense_tp_size");
  expect(PlanLayers({4, 2, 0}, {}, true), "sparse_layers");
}

TEST(ValidateLayout, AcceptsAndRejects) {
  EXPECT_TRUE(ValidateLayout({1, 1, 0}).ok());
  EXPECT_TRUE(ValidateLayout({8, 2, 4}).ok());  // attn_tp
  EXPECT_TRUE(ValidateLayout({8, 2, 8}).ok());  // tp
  EXPECT_TRUE(ValidateLayout({8, 2, 1}).ok());
  struct Bad {
    ParallelLayout layout;
    const char* fragment;
  };
  for (const Bad& bad : std::vector<Bad>{{{0, 1, 0}, "tp_size must be >= 1, got 0"},
                                         {{-2, 1, 0}, "tp_size"},
                                         {{4, 0, 0}, "attn_dp_size"},
                                         {{4, 3, 0}, "got 3"},
                                         {{4, 8, 0}, "attn_dp_size"},
                                         {{8, 2, 2}, "moe_dense_tp_size"},
                                         {{4, 1, 2}, "moe_dense_tp_size"},
                                         {{4, 2, -1}, "got -1"}}) {
    absl::Status s = ValidateLayout(bad.layout);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument)
        << bad.layout.tp_size << "/" << bad.layout.attn_dp_size;
    EXPECT_THAT(s.message(), HasSubstr(bad.fragment)) << s;
  }
}

TEST(ParallelLayout, SizesAndGroups) {
  ParallelLayout layout{8, 2, 0};
  EXPECT_EQ(layout.attn_tp_size(), 4);
  EXPECT_EQ(layout.effective_moe_dense_tp_size(), 8);
  EXPECT_EQ(layout.GroupSize(kS), 1);
  EXPECT_EQ(layout.GroupSize(kT), 4);
  EXPECT_EQ(layout.GroupSize(kF), 8);
  EXPECT_EQ((ParallelLayout{4, 0, 0}).attn_tp_size(), 0);
}

// Step choosers on transitions the planner never produces.
TEST(ChooseSteps, TakeSplitAndUnsupportedTransitions) {
  const ParallelLayout d{4, 2, 0};  // S 1, T 2, F 4
  absl::StatusOr<AfterMlpOp> split = ChooseAfterMlp(d, kT, kT, kS);
  ASSERT_TRUE(split.ok());
  EXPECT_EQ(*split, AfterMlpOp::kTakeSplit);

  absl::StatusOr<BeforeAttentionOp> ba = ChooseBeforeAttention(d, kF, kT);
  EXPECT_EQ(ba.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(ba.status().message(), HasSubstr("before_attention"));
  EXPECT_THAT(ba.status().message(), HasSubstr("FULL -> TP_ATTN_FULL"));

  absl::StatusOr<BeforeMlpStep> bm = ChooseBeforeMlp(d, kS, kS, kF, kT);
  EXPECT_EQ(bm.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bm.status().message(), HasSubstr("before_mlp"));
  EXPECT_THAT(bm.status().message(), HasSubstr("hidden SCATTERED"));
  EXPECT_THAT(bm.status().message(), HasSubstr("hidden FULL"));

  absl::StatusOr<AfterMlpOp> am = ChooseAfterMlp(d, kF, kT, kS);
  EXPECT_EQ(am.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(am.status().message(), HasSubstr("after_mlp"));
  EXPECT_THAT(am.status().message(), HasSubstr("-> SCATTERED"));

  // The TP_ATTN_FULL MLP extension needs attn_tp > 1.
  const ParallelLayout c{4, 4, 0};
  absl::StatusOr<BeforeMlpStep> ext = ChooseBeforeMlp(c, kT, kT, kT, kF);
  EXPECT_EQ(ext.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(BuildLayerPlan, ErrorNamesLayerStepAndModes) {
  LayerModes modes;
  modes.input = kF;  // no FULL -> TP_ATTN_FULL step exists
  absl::StatusOr<LayerPlan> plan = BuildLayerPlan({4, 2, 0}, 7, true, modes);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan.status().message(), HasSubstr("layer 7"));
  EXPECT_THAT(plan.status().message(), HasSubstr("before_attention"));
  EXPECT_THAT(plan.status().message(), HasSubstr("FULL -> TP_ATTN_FULL"));

  LayerModes after;
  after.mlp = kS;
  after.residual = kS;
  after.output = kF;  // (S, S) -> FULL
  absl::StatusOr<LayerPlan> plan2 = BuildLayerPlan({4, 2, 0}, 3, true, after);
  EXPECT_EQ(plan2.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(plan2.status().message(), HasSubstr("layer 3, step after_mlp"));
}

TEST(ResolveAfterMlpOp, ReduceScatterOnlyForMaxLenWhenAllowed) {
  LayerPlan plan;
  plan.after_mlp = AfterMlpOp::kDpScatter;
  EXPECT_EQ(ResolveAfterMlpOp(plan, DpPaddingMode::kMaxLen, true), AfterMlpOp::kReduceScatter);
  EXPECT_EQ(ResolveAfterMlpOp(plan, DpPaddingMode::kSumLen, true), AfterMlpOp::kDpScatter);
  EXPECT_EQ(ResolveAfterMlpOp(plan, DpPaddingMode::kMaxLen, false), AfterMlpOp::kDpScatter);
  plan.after_mlp = AfterMlpOp::kAddResidualAllGather;
  EXPECT_EQ(ResolveAfterMlpOp(plan, DpPaddingMode::kMaxLen, true),
            AfterMlpOp::kAddResidualAllGather);
}

TEST(StepName, AllNames) {
  EXPECT_EQ(ScatterModeName(kS), "SCATTERED");
  EXPECT_EQ(ScatterModeName(kT), "TP_ATTN_FULL");
  EXPECT_EQ(ScatterModeName(kF), "FULL");
  EXPECT_EQ(StepName(BeforeAttentionOp::kNone), "none");
  EXPECT_EQ(StepName(BeforeAttentionOp::kAttnTpAllGather), "attn_tp_all_gather");
  EXPECT_EQ(StepName(BeforeMlpOp::kNormOnly), "norm");
  EXPECT_EQ(StepName(BeforeMlpOp::kDpGatherAfterResidual), "dp_gather");
  EXPECT_EQ(StepName(BeforeMlpOp::kAllReduceAddNorm), "all_reduce_add_norm");
  EXPECT_EQ(StepName(BeforeMlpOp::kReduceScatterNorm), "reduce_scatter_norm");
  EXPECT_EQ(StepName(BeforeMlpOp::kAttnTpAllReduceNorm), "attn_tp_all_reduce_norm");
  EXPECT_EQ(StepName(AfterMlpOp::kNone), "none");
  EXPECT_EQ(StepName(AfterMlpOp::kDpScatter), "dp_scatter");
  EXPECT_EQ(StepName(AfterMlpOp::kReduceScatter), "reduce_scatter");
  EXPECT_EQ(StepName(AfterMlpOp::kAddResidualAllGather), "add_residual_all_gather");
  EXPECT_EQ(StepName(AfterMlpOp::kTakeSplit), "take_split");
}

TEST(FormatPlanTable, AlignedRowsPerLayer) {
  absl::StatusOr<std::vector<LayerPlan>> plans =
      PlanLayers({4, 2, 0}, {false, true, true, true}, true);
  ASSERT_TRUE(plans.ok());
  const std::string table = FormatPlanTable(*plans);
  std::vector<std::string> lines = absl::StrSplit(table, '\n', absl::SkipEmpty());
  ASSERT_EQ(lines.size(), 5u);
  EXPECT_THAT(lines[0], HasSubstr("layer"));
  EXPECT_THAT(lines[0], HasSubstr("before_mlp"));
  // Columns line up: "before_mlp" starts at the same offset as each row's value.
  const size_t col = lines[0].find("before_mlp");
  EXPECT_EQ(lines[1].substr(col, std::string("dp_gather[norm_after_gather]").size()),
            "dp_gather[norm_after_gather]");
  EXPECT_EQ(lines[2].substr(col, std::string("reduce_scatter_norm[split_residual]").size()),
            "reduce_scatter_norm[split_residual]");
  EXPECT_THAT(lines[1], HasSubstr("dense"));
  EXPECT_THAT(lines[1], HasSubstr("dp_scatter|reduce_scatter"));
  EXPECT_THAT(lines[3], HasSubstr("attn_tp_all_gather"));
  EXPECT_THAT(lines[4], HasSubstr("add_residual_all_gather"));
  const size_t mode_col = lines[0].find("attention");
  EXPECT_EQ(lines[3].substr(mode_col, 12), "TP_ATTN_FULL");
}

TEST(DescribeBeforeMlp, Options) {
  LayerPlan p;
  p.before_mlp = BeforeMlpOp::kDpGatherAfterResidual;
  p.gather_residual = true;
  EXPECT_EQ(DescribeBeforeMlp(p), "dp_gather[gather_residual,norm_after_gather]");
  p.gather_residual = false;
  p.norm_before_gather = true;
  EXPECT_EQ(DescribeBeforeMlp(p), "dp_gather[norm_before_gather]");
  LayerPlan n;
  EXPECT_EQ(DescribeBeforeMlp(n), "norm");
  EXPECT_EQ(DescribeAfterMlp(n), "none");
}

TEST(PlanFingerprint, StableDigest) {
  const std::vector<bool> pattern = {false, true, true, true};
  // FNV-1a 64 of "moe-ep-plan/v1;tp=4;attn_dp=2;moe_dense_tp=4;a2a=1;layers=DSSS",
  // computed independently.
  EXPECT_EQ(PlanFingerprint({4, 2, 0}, pattern, true), "1c70eb810d64f698");
  // Unset and explicit tp_size are the same configuration.
  EXPECT_EQ(PlanFingerprint({4, 2, 4}, pattern, true), "1c70eb810d64f698");
  EXPECT_NE(PlanFingerprint({4, 2, 1}, pattern, true), "1c70eb810d64f698");
  EXPECT_NE(PlanFingerprint({4, 2, 0}, pattern, false), "1c70eb810d64f698");
  EXPECT_NE(PlanFingerprint({4, 4, 0}, pattern, true), "1c70eb810d64f698");
  EXPECT_NE(PlanFingerprint({4, 2, 0}, {true, true, true, true}, true), "1c70eb810d64f698");
  EXPECT_EQ(PlanFingerprint({4, 2, 0}, pattern, true).size(), 16u);
}

}  // namespace
}  // namespace moe_ep::core
