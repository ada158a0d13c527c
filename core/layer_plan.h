#pragma once

// The scatter-mode planner (DESIGN §2-§3): for every decoder layer, where its
// token tensors live (SCATTERED / TP_ATTN_FULL / FULL) at each point, and
// which communication implements each of the layer's three steps. Plans are
// made once, when the layout is configured; unsupported transitions are
// rejected then, never in the middle of a forward pass.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dp_padding.h"

namespace moe_ep::core {

// Where a token tensor lives. Group sizes: SCATTERED 1, TP_ATTN_FULL
// attn_tp_size, FULL tp_size; two modes are "the same" for a transition when
// their group sizes are equal.
enum class ScatterMode { kScattered, kTpAttnFull, kFull };

// "SCATTERED", "TP_ATTN_FULL", "FULL".
std::string ScatterModeName(ScatterMode mode);

// DESIGN §2. tp_size = world = ep_size; rank r is in DP group r / attn_tp_size
// with attention-TP rank r % attn_tp_size.
struct ParallelLayout {
  int tp_size = 1;
  int attn_dp_size = 1;       // > 1 = DP attention
  int moe_dense_tp_size = 0;  // 0 = unset (= tp_size), 1, or attn_tp_size (extension)

  // tp_size / attn_dp_size (0 when attn_dp_size < 1).
  int attn_tp_size() const;
  // moe_dense_tp_size with 0 resolved to tp_size.
  int effective_moe_dense_tp_size() const;
  // Group size of `mode` (see ScatterMode).
  int GroupSize(ScatterMode mode) const;
};

// Errors (kInvalidArgument naming the field and value): tp_size < 1,
// attn_dp_size < 1 or not dividing tp_size, moe_dense_tp_size not in
// {0, 1, tp_size, attn_tp_size}.
absl::Status ValidateLayout(const ParallelLayout& layout);

// Step 1, input mode -> attention mode. Runs after the input layernorm.
enum class BeforeAttentionOp {
  kNone,             // same group size
  kAttnTpAllGather,  // SCATTERED -> TP_ATTN_FULL: all-gather in the attention-TP group
};

// Step 2, (attention output, residual) -> (MLP input, residual); each ends with
// the post-attention RMSNorm (with residual add).
enum class BeforeMlpOp {
  kNormOnly,  // both pairs keep their group sizes and attn_tp_size == 1
  // -> (FULL, TP_ATTN_FULL) with DP attention: add the residual on attention-TP
  // rank 0, then the summing DP gather (DESIGN §4); the norm runs before the
  // gather when attn_tp_size == 1 (`norm_before_gather`), after it otherwise
  // (the residual then becomes this group's slice of the gathered sum).
  kDpGatherAfterResidual,
  // -> (FULL, TP_ATTN_FULL) without DP attention: all-reduce the partial
  // attention output over TP, then add-residual-and-norm (fused where
  // available). The all-reduce is never skipped.
  kAllReduceAddNorm,
  // -> (SCATTERED, SCATTERED): reduce-scatter in the attention-TP group into
  // this rank's split; a TP_ATTN_FULL residual is split the same way
  // (`split_residual`); then the norm.
  kReduceScatterNorm,
  // -> (TP_ATTN_FULL, TP_ATTN_FULL), the sglang issue 23996 extension
  // (moe_dense_tp_size == attn_tp_size > 1): all-reduce the partial attention
  // output in the attention-TP group, then add-residual-and-norm. The dense
  // MLP all-reduces its own output in the same group.
  kAttnTpAllReduceNorm,
};

// Step 3, (MLP output, residual) -> layer output mode.
enum class AfterMlpOp {
  kNone,       // same group sizes
  kDpScatter,  // (FULL, TP_ATTN_FULL) -> TP_ATTN_FULL: copy this DP group's slice
  // The same transition when the MLP skipped its all-reduce and padding is
  // MAX_LEN: reduce-scatter of the global buffer. Never stored in a plan; see
  // ResolveAfterMlpOp.
  kReduceScatter,
  // (SCATTERED, SCATTERED) -> TP_ATTN_FULL: hidden += residual (residual
  // becomes none), then all-gather in the attention-TP group.
  kAddResidualAllGather,
  // (TP_ATTN_FULL, TP_ATTN_FULL) -> SCATTERED: take this rank's split;
  // requires no residual.
  kTakeSplit,
};

// Short, stable names used in tables and RPC replies, e.g. "attn_tp_all_gather",
// "dp_gather", "reduce_scatter_norm", "dp_scatter".
std::string StepName(BeforeAttentionOp op);
std::string StepName(BeforeMlpOp op);
std::string StepName(AfterMlpOp op);

// The chosen before-MLP implementation with its options.
struct BeforeMlpStep {
  BeforeMlpOp op = BeforeMlpOp::kNormOnly;
  // All-gather a SCATTERED residual in the attention-TP group first
  // (kDpGatherAfterResidual, kAllReduceAddNorm, kAttnTpAllReduceNorm).
  bool gather_residual = false;
  bool norm_before_gather = false;  // kDpGatherAfterResidual only
  bool split_residual = false;      // kReduceScatterNorm only
};

// The modes of one layer (DESIGN §3).
struct LayerModes {
  ScatterMode input = ScatterMode::kTpAttnFull;
  ScatterMode attention = ScatterMode::kTpAttnFull;
  ScatterMode residual = ScatterMode::kTpAttnFull;  // between attention and MLP
  ScatterMode mlp = ScatterMode::kTpAttnFull;
  ScatterMode output = ScatterMode::kTpAttnFull;
};

struct LayerPlan {
  int layer = 0;
  bool sparse = false;
  ScatterMode input = ScatterMode::kTpAttnFull;
  ScatterMode attention = ScatterMode::kTpAttnFull;
  ScatterMode residual = ScatterMode::kTpAttnFull;
  ScatterMode mlp = ScatterMode::kTpAttnFull;
  ScatterMode output = ScatterMode::kTpAttnFull;
  BeforeAttentionOp before_attention = BeforeAttentionOp::kNone;
  BeforeMlpOp before_mlp = BeforeMlpOp::kNormOnly;
  AfterMlpOp after_mlp = AfterMlpOp::kNone;
  // Options of before_mlp (see BeforeMlpStep).
  bool gather_residual = false;
  bool norm_before_gather = false;
  bool split_residual = false;
};

// The step choosers. Each returns the implementation for the transition, or
// kInvalidArgument naming the step and both modes (and the residual modes)
// when the transition is unsupported. `layout` must be valid.
absl::StatusOr<BeforeAttentionOp> ChooseBeforeAttention(const ParallelLayout& layout,
                                                        ScatterMode input, ScatterMode attention);
absl::StatusOr<BeforeMlpStep> ChooseBeforeMlp(const ParallelLayout& layout,
                                              ScatterMode hidden_input, ScatterMode residual_input,
                                              ScatterMode hidden_output,
                                              ScatterMode residual_output);
absl::StatusOr<AfterMlpOp> ChooseAfterMlp(const ParallelLayout& layout, ScatterMode hidden_input,
                                          ScatterMode residual_input, ScatterMode output);

// The plan of one layer with the given modes: before attention input ->
// attention; before MLP (attention, input) -> (mlp, residual); after MLP
// (mlp, residual) -> output.
// Errors: kInvalidArgument "layer <i>, step <name>: <from> -> <to> unsupported"
// when a step has no implementation, or the layout is invalid.
absl::StatusOr<LayerPlan> BuildLayerPlan(const ParallelLayout& layout, int layer, bool sparse,
                                         const LayerModes& modes);

// PlanLayers()
//
// Returns one LayerPlan per entry of `sparse_layers` ([num_layers], true = MoE
// layer). Modes (DESIGN §3): attention TP_ATTN_FULL; MLP of a sparse layer
// SCATTERED with an all-to-all backend (`a2a_enabled`) else FULL; of a dense
// layer SCATTERED when moe_dense_tp_size == 1, FULL when it is unset or
// tp_size, TP_ATTN_FULL when it equals attn_tp_size < tp_size (extension);
// residual and output SCATTERED for a SCATTERED MLP, else TP_ATTN_FULL; the
// last layer's output TP_ATTN_FULL; layer 0's input TP_ATTN_FULL, others the
// previous output.
//
// Errors (kInvalidArgument): ValidateLayout errors; empty sparse_layers; a
// step without an implementation (naming layer, step and both modes).
//
// Pure and thread-safe. Source: DESIGN §3; sglang communicator (seed 002);
// sglang issue 23996 for the TP_ATTN_FULL dense MLP.
// Example: tp 4, attn_dp 2, a2a on, moe_dense unset, DeepSeek (layers 0-2
// dense): layer 0 T,T,T,FULL,T with dp_gather / dp_scatter; layer 3 input T,
// MLP SCATTERED, reduce_scatter_norm (split residual), output SCATTERED; layer
// 4 starts with attn_tp_all_gather.
absl::StatusOr<std::vector<LayerPlan>> PlanLayers(const ParallelLayout& layout,
                                                  const std::vector<bool>& sparse_layers,
                                                  bool a2a_enabled);

// The after-MLP op to run this step: kReduceScatter instead of kDpScatter when
// the padding mode is MAX_LEN and the model lets the MLP skip its all-reduce
// (`allow_reduce_scatter`); the plan's op otherwise. When this returns
// kReduceScatter the MLP must skip its own all-reduce.
AfterMlpOp ResolveAfterMlpOp(const LayerPlan& plan, DpPaddingMode padding_mode,
                             bool allow_reduce_scatter);

// Step names with options: e.g. "dp_gather[gather_residual,norm_after_gather]",
// "reduce_scatter_norm[split_residual]", "dp_scatter|reduce_scatter" (the
// latter chosen at run time, see ResolveAfterMlpOp).
std::string DescribeBeforeMlp(const LayerPlan& plan);
std::string DescribeAfterMlp(const LayerPlan& plan);

// An aligned text table, a header then one row per layer: layer, kind
// (dense/sparse), the five modes and the three steps. Used by `moe-ep plan`.
std::string FormatPlanTable(const std::vector<LayerPlan>& plans);

// A stable 16-hex-digit digest (FNV-1a 64 over a canonical string of the
// layout with moe_dense_tp_size resolved, a2a and the sparse pattern), equal on
// every rank and across processes for the same configuration.
std::string PlanFingerprint(const ParallelLayout& layout, const std::vector<bool>& sparse_layers,
                            bool a2a_enabled);

}  // namespace moe_ep::core
