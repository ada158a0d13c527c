#include "core/layer_plan.h"

#include <algorithm>
#include <array>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/fingerprint.h"
#include "core/status_macros.h"

namespace moe_ep::core {

std::string ScatterModeName(ScatterMode mode) {
  switch (mode) {
    case ScatterMode::kScattered:
      return "SCATTERED";
    case ScatterMode::kTpAttnFull:
      return "TP_ATTN_FULL";
    case ScatterMode::kFull:
      return "FULL";
  }
  return "UNKNOWN";
}

int ParallelLayout::attn_tp_size() const { return attn_dp_size >= 1 ? tp_size / attn_dp_size : 0; }

int ParallelLayout::effective_moe_dense_tp_size() const {
  return moe_dense_tp_size == 0 ? tp_size : moe_dense_tp_size;
}

int ParallelLayout::GroupSize(ScatterMode mode) const {
  switch (mode) {
    case ScatterMode::kScattered:
      return 1;
    case ScatterMode::kTpAttnFull:
      return attn_tp_size();
    case ScatterMode::kFull:
      return tp_size;
  }
  return 0;
}

absl::Status ValidateLayout(const ParallelLayout& layout) {
  if (layout.tp_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("tp_size must be >= 1, got ", layout.tp_size));
  }
  if (layout.attn_dp_size < 1 || layout.tp_size % layout.attn_dp_size != 0) {
    return absl::InvalidArgumentError(absl::StrCat("attn_dp_size must be >= 1 and divide tp_size ",
                                                   layout.tp_size, ", got ", layout.attn_dp_size));
  }
  const int d = layout.moe_dense_tp_size;
  if (d != 0 && d != 1 && d != layout.tp_size && d != layout.attn_tp_size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("moe_dense_tp_size must be 0 (unset), 1, tp_size ", layout.tp_size,
                     " or attn_tp_size ", layout.attn_tp_size(), ", got ", d));
  }
  return absl::OkStatus();
}

std::string StepName(BeforeAttentionOp op) {
  switch (op) {
    case BeforeAttentionOp::kNone:
      return "none";
    case BeforeAttentionOp::kAttnTpAllGather:
      return "attn_tp_all_gather";
  }
  return "unknown";
}

std::string StepName(BeforeMlpOp op) {
  switch (op) {
    case BeforeMlpOp::kNormOnly:
      return "norm";
    case BeforeMlpOp::kDpGatherAfterResidual:
      return "dp_gather";
    case BeforeMlpOp::kAllReduceAddNorm:
      return "all_reduce_add_norm";
    case BeforeMlpOp::kReduceScatterNorm:
      return "reduce_scatter_norm";
    case BeforeMlpOp::kAttnTpAllReduceNorm:
      return "attn_tp_all_reduce_norm";
  }
  return "unknown";
}

std::string StepName(AfterMlpOp op) {
  switch (op) {
    case AfterMlpOp::kNone:
      return "none";
    case AfterMlpOp::kDpScatter:
      return "dp_scatter";
    case AfterMlpOp::kReduceScatter:
      return "reduce_scatter";
    case AfterMlpOp::kAddResidualAllGather:
      return "add_residual_all_gather";
    case AfterMlpOp::kTakeSplit:
      return "take_split";
  }
  return "unknown";
}

namespace {

constexpr ScatterMode kS = ScatterMode::kScattered;
constexpr ScatterMode kT = ScatterMode::kTpAttnFull;
constexpr ScatterMode kF = ScatterMode::kFull;

absl::Status Unsupported(const std::string& step, const std::string& from, const std::string& to) {
  return absl::InvalidArgumentError(
      absl::StrCat("step ", step, ": ", from, " -> ", to, " is unsupported"));
}

std::string Pair(ScatterMode hidden, ScatterMode residual) {
  return absl::StrCat("(hidden ", ScatterModeName(hidden), ", residual ", ScatterModeName(residual),
                      ")");
}

}  // namespace

absl::StatusOr<BeforeAttentionOp> ChooseBeforeAttention(const ParallelLayout& layout,
                                                        ScatterMode input, ScatterMode attention) {
  if (layout.GroupSize(input) == layout.GroupSize(attention)) return BeforeAttentionOp::kNone;
  if (input == kS && attention == kT) return BeforeAttentionOp::kAttnTpAllGather;
  return Unsupported("before_attention", ScatterModeName(input), ScatterModeName(attention));
}

absl::StatusOr<BeforeMlpStep> ChooseBeforeMlp(const ParallelLayout& layout,
                                              ScatterMode hidden_input, ScatterMode residual_input,
                                              ScatterMode hidden_output,
                                              ScatterMode residual_output) {
  const int attn_tp = layout.attn_tp_size();
  BeforeMlpStep step;
  if (layout.GroupSize(hidden_input) == layout.GroupSize(hidden_output) &&
      layout.GroupSize(residual_input) == layout.GroupSize(residual_output) && attn_tp == 1) {
    step.op = BeforeMlpOp::kNormOnly;
    return step;
  }
  const bool residual_in_ok = residual_input == kS || residual_input == kT;
  if (hidden_input == kT && residual_in_ok) {
    if (hidden_output == kF && residual_output == kT) {
      step.gather_residual = residual_input == kS && attn_tp > 1;
      if (layout.attn_dp_size > 1) {
        step.op = BeforeMlpOp::kDpGatherAfterResidual;
        step.norm_before_gather = attn_tp == 1;
      } else {
        step.op = BeforeMlpOp::kAllReduceAddNorm;
      }
      return step;
    }
    if (hidden_output == kS && residual_output == kS) {
      step.op = BeforeMlpOp::kReduceScatterNorm;
      step.split_residual = residual_input == kT;
      return step;
    }
    if (hidden_output == kT && residual_output == kT && attn_tp > 1) {
      step.op = BeforeMlpOp::kAttnTpAllReduceNorm;
      step.gather_residual = residual_input == kS;
      return step;
    }
  }
  return Unsupported("before_mlp", Pair(hidden_input, residual_input),
                     Pair(hidden_output, residual_output));
}

absl::StatusOr<AfterMlpOp> ChooseAfterMlp(const ParallelLayout& layout, ScatterMode hidden_input,
                                          ScatterMode residual_input, ScatterMode output) {
  if (layout.GroupSize(hidden_input) == layout.GroupSize(output) &&
      layout.GroupSize(residual_input) == layout.GroupSize(output)) {
    return AfterMlpOp::kNone;
  }
  if (hidden_input == kF && residual_input == kT && output == kT) return AfterMlpOp::kDpScatter;
  if (hidden_input == kS && residual_input == kS && output == kT) {
    return AfterMlpOp::kAddResidualAllGather;
  }
  if (hidden_input == kT && residual_input == kT && output == kS) return AfterMlpOp::kTakeSplit;
  return Unsupported("after_mlp", Pair(hidden_input, residual_input), ScatterModeName(output));
}

absl::StatusOr<LayerPlan> BuildLayerPlan(const ParallelLayout& layout, int layer, bool sparse,
                                         const LayerModes& modes) {
  RETURN_IF_ERROR(ValidateLayout(layout));
  auto at_layer = [layer](const absl::Status& s) {
    return absl::Status(s.code(), absl::StrCat("layer ", layer, ", ", s.message()));
  };
  LayerPlan plan;
  plan.layer = layer;
  plan.sparse = sparse;
  plan.input = modes.input;
  plan.attention = modes.attention;
  plan.residual = modes.residual;
  plan.mlp = modes.mlp;
  plan.output = modes.output;

  absl::StatusOr<BeforeAttentionOp> before_attention =
      ChooseBeforeAttention(layout, modes.input, modes.attention);
  if (!before_attention.ok()) return at_layer(before_attention.status());
  plan.before_attention = *before_attention;

  // The residual enters the before-MLP step in the layer input's mode.
  absl::StatusOr<BeforeMlpStep> before_mlp =
      ChooseBeforeMlp(layout, modes.attention, modes.input, modes.mlp, modes.residual);
  if (!before_mlp.ok()) return at_layer(before_mlp.status());
  plan.before_mlp = before_mlp->op;
  plan.gather_residual = before_mlp->gather_residual;
  plan.norm_before_gather = before_mlp->norm_before_gather;
  plan.split_residual = before_mlp->split_residual;

  absl::StatusOr<AfterMlpOp> after_mlp =
      ChooseAfterMlp(layout, modes.mlp, modes.residual, modes.output);
  if (!after_mlp.ok()) return at_layer(after_mlp.status());
  plan.after_mlp = *after_mlp;
  return plan;
}

absl::StatusOr<std::vector<LayerPlan>> PlanLayers(const ParallelLayout& layout,
                                                  const std::vector<bool>& sparse_layers,
                                                  bool a2a_enabled) {
  RETURN_IF_ERROR(ValidateLayout(layout));
  if (sparse_layers.empty()) {
    return absl::InvalidArgumentError("sparse_layers is empty: the model has no layers");
  }
  const int num_layers = static_cast<int>(sparse_layers.size());
  // An explicit 1 means fully data-parallel dense MLPs; unset means tp_size
  // (FULL), even when tp_size is 1, as in the reference.
  ScatterMode dense_mlp = kF;
  if (layout.moe_dense_tp_size == 1) {
    dense_mlp = kS;
  } else if (layout.effective_moe_dense_tp_size() != layout.tp_size) {
    dense_mlp = kT;  // == attn_tp_size < tp_size (ValidateLayout)
  }
  const ScatterMode sparse_mlp = a2a_enabled ? kS : kF;

  std::vector<LayerPlan> plans;
  plans.reserve(num_layers);
  ScatterMode previous_output = kT;  // model input
  for (int i = 0; i < num_layers; ++i) {
    LayerModes modes;
    modes.input = previous_output;
    modes.attention = kT;
    modes.mlp = sparse_layers[i] ? sparse_mlp : dense_mlp;
    modes.residual = modes.mlp == kS ? kS : kT;
    modes.output = (i == num_layers - 1) ? kT : modes.residual;
    ASSIGN_OR_RETURN(LayerPlan plan, BuildLayerPlan(layout, i, sparse_layers[i], modes));
    previous_output = modes.output;
    plans.push_back(plan);
  }
  return plans;
}

AfterMlpOp ResolveAfterMlpOp(const LayerPlan& plan, DpPaddingMode padding_mode,
                             bool allow_reduce_scatter) {
  if (plan.after_mlp == AfterMlpOp::kDpScatter && allow_reduce_scatter &&
      padding_mode == DpPaddingMode::kMaxLen) {
    return AfterMlpOp::kReduceScatter;
  }
  return plan.after_mlp;
}

std::string DescribeBeforeMlp(const LayerPlan& plan) {
  std::vector<std::string> options;
  if (plan.gather_residual) options.push_back("gather_residual");
  if (plan.before_mlp == BeforeMlpOp::kDpGatherAfterResidual) {
    options.push_back(plan.norm_before_gather ? "norm_before_gather" : "norm_after_gather");
  }
  if (plan.split_residual) options.push_back("split_residual");
  std::string name = StepName(plan.before_mlp);
  if (!options.empty()) absl::StrAppend(&name, "[", absl::StrJoin(options, ","), "]");
  return name;
}

std::string DescribeAfterMlp(const LayerPlan& plan) {
  if (plan.after_mlp == AfterMlpOp::kDpScatter) {
    return absl::StrCat(StepName(AfterMlpOp::kDpScatter), "|",
                        StepName(AfterMlpOp::kReduceScatter));
  }
  return StepName(plan.after_mlp);
}

std::string FormatPlanTable(const std::vector<LayerPlan>& plans) {
  constexpr size_t kColumns = 10;
  using Row = std::array<std::string, kColumns>;
  std::vector<Row> rows;
  rows.push_back({"layer", "kind", "input", "attention", "residual", "mlp", "output",
                  "before_attention", "before_mlp", "after_mlp"});
  for (const LayerPlan& p : plans) {
    rows.push_back({absl::StrCat(p.layer), p.sparse ? "sparse" : "dense", ScatterModeName(p.input),
                    ScatterModeName(p.attention), ScatterModeName(p.residual),
                    ScatterModeName(p.mlp), ScatterModeName(p.output), StepName(p.before_attention),
                    DescribeBeforeMlp(p), DescribeAfterMlp(p)});
  }
  std::array<size_t, kColumns> widths{};
  for (const Row& row : rows) {
    for (size_t c = 0; c < kColumns; ++c) widths[c] = std::max(widths[c], row[c].size());
  }
  std::string out;
  for (const Row& row : rows) {
    std::string line;
    for (size_t c = 0; c < kColumns; ++c) {
      if (c > 0) line += "  ";
      line += row[c];
      if (c + 1 < kColumns) line.append(widths[c] - row[c].size(), ' ');
    }
    out += line;
    out += '\n';
  }
  return out;
}

std::string PlanFingerprint(const ParallelLayout& layout, const std::vector<bool>& sparse_layers,
                            bool a2a_enabled) {
  std::string pattern;
  pattern.reserve(sparse_layers.size());
  for (bool sparse : sparse_layers) pattern += sparse ? 'S' : 'D';
  const std::string canonical =
      absl::StrCat("moe-ep-plan/v1;tp=", layout.tp_size, ";attn_dp=", layout.attn_dp_size,
                   ";moe_dense_tp=", layout.effective_moe_dense_tp_size(),
                   ";a2a=", a2a_enabled ? 1 : 0, ";layers=", pattern);
  return Hex64(Fingerprint64(canonical));
}

}  // namespace moe_ep::core
