#pragma once

// Executes the three communication steps of one decoder layer's plan
// (DESIGN §3) on one rank, over the rank's ParallelGroups, for one forward
// step whose DP token layout is a DpGatherLayout (DESIGN §4). Each step
// checks its inputs, builds the step's program (core/step_program.h) and
// runs it on a core::HostStepExecutor (core/step_executor.h).
//
// Tensors on this path are fp32 [rows, H] host buffers (bf16 appears only at
// the MoE dispatch boundary, core/ep_dispatcher.h). Row counts per mode on a
// rank, for a step with layout `dp` (see ModeRows):
//   SCATTERED     dp.local_rows / attn_tp_size  (attention-TP rank j holds
//                 TP_ATTN_FULL rows [j*s, (j+1)*s))
//   TP_ATTN_FULL  dp.local_rows  (this DP group's tokens, padded per §4; rows
//                 past the group's real token count are padding)
//   FULL          dp.global_rows (every DP group's rows at dp.offsets)
// Because TP_ATTN_FULL is padded to a multiple of attn_tp_size, every
// attention-TP rank holds the same number of SCATTERED rows and the
// attention-TP all-gather / reduce-scatter move equal-sized chunks.
//
// Collective operations and how they are built on core/collective.h:
//   attention-TP all-gather   AllGather of equal chunks in the attn-TP group
//   reduce-scatter            AllToAllV of equal chunks, then each rank sums
//                             the chunks it received in ascending source-rank
//                             order (fp32): a true reduce-scatter (each rank
//                             moves 1/size of the buffer), deterministic
//   TP / attention-TP all-reduce   AllReduceSum (every rank gets the same bits)
//   DP gather (summing)       this rank's rows placed at its DP group's offset
//                             in a zeroed [global_rows, H] buffer, then
//                             AllReduceSum over the world (DESIGN §4)
//   DP scatter                copy of rows [offset, offset + local_rows)
//   DP reduce-scatter         reduce-scatter of the global buffer over the
//                             world (rank r gets rows [r*c, (r+1)*c), c =
//                             global_rows / tp_size, which lie inside its DP
//                             group's slice under MAX_LEN), then an attention-
//                             TP all-gather back to TP_ATTN_FULL
// On CPU the "fused" all-reduce + residual + RMSNorm is the all-reduce followed
// by one fused add-and-norm pass; the all-reduce is never skipped.
//
// Every step is a collective over the groups it uses: all ranks call the same
// steps in the same order, zero-token ranks included (they pass [0, H]
// tensors and still take part). An error on one rank leaves its peers blocked
// until the group's timeout (kDeadlineExceeded).
//
// Not thread-safe (like Collective). Source: DESIGN §3, §4; sglang layer
// communicator (seed 002); sglang issue 23996 (attention-TP all-reduce).

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dp_padding.h"
#include "core/layer_plan.h"
#include "core/parallel_groups.h"
#include "core/rms_norm.h"
#include "core/step_executor.h"
#include "core/step_program.h"

namespace moe_ep::core {

// The same check for the groups of a rank (CPU or GPU groups); see
// CheckDpLayoutFits in core/step_program.h.
template <typename Group>
absl::Status CheckDpLayoutFits(const DpGatherLayout& dp, const BasicParallelGroups<Group>& groups,
                               int layer) {
  return CheckDpLayoutFits(dp, groups.layout(), groups.rank(), layer);
}

class LayerCommunicator {
 public:
  // `groups` is not owned and must outlive the communicator; `plan` comes
  // from PlanLayers / BuildLayerPlan for groups->layout().
  // Errors: kInvalidArgument for a null groups or hidden < 1.
  static absl::StatusOr<LayerCommunicator> Create(const ParallelGroups* groups,
                                                  const LayerPlan& plan, int64_t hidden);

  const LayerPlan& plan() const { return plan_; }

  // Step 1. Input layernorm (fused residual add when act.residual is set;
  // otherwise residual := hidden before the norm), then the before-attention
  // op. In: hidden and residual in plan.input mode. Out: hidden in
  // TP_ATTN_FULL, residual still in plan.input mode.
  // Errors: kInvalidArgument when `dp` does not fit the groups (attn_tp_size,
  // number of DP groups, dp_rank) or a tensor's size is not ModeRows * H
  // (naming the tensor, mode and both numbers); collective errors.
  absl::Status PrepareAttention(const DpGatherLayout& dp, const RmsNorm& input_norm,
                                LayerActivations& act) const;

  // Step 2. In: hidden = attention output in TP_ATTN_FULL (a partial sum over
  // the attention-TP group when attn_tp_size > 1), residual in plan.input
  // mode. Out: hidden (normed) in plan.mlp mode, residual in plan.residual
  // mode. The ops (plan.before_mlp):
  //   norm                  add-residual-and-norm;
  //   dp_gather             [gather residual]; hidden += residual on
  //                         attention-TP rank 0; then either norm and gather
  //                         (attn_tp_size 1) or gather, residual := this
  //                         group's slice of the gathered sum, norm;
  //   all_reduce_add_norm   [gather residual]; TP all-reduce; add-and-norm;
  //   reduce_scatter_norm   attention-TP reduce-scatter; [split residual];
  //                         add-and-norm;
  //   attn_tp_all_reduce_norm  [gather residual]; attention-TP all-reduce;
  //                         add-and-norm (sglang issue 23996 extension).
  // Errors: as PrepareAttention; kFailedPrecondition when act.residual is
  // none (the input norm always creates one).
  absl::Status PrepareMlp(const DpGatherLayout& dp, const RmsNorm& post_attention_norm,
                          LayerActivations& act) const;

  // The after-MLP op for this step: ResolveAfterMlpOp(plan, dp.mode,
  // allow_reduce_scatter). When it returns kReduceScatter the MLP must skip
  // its own all-reduce (its output stays a partial sum over TP).
  AfterMlpOp ResolveAfterMlp(const DpGatherLayout& dp, bool allow_reduce_scatter) const;

  // Step 3 with `op` (plan.after_mlp, or kReduceScatter where the plan says
  // kDpScatter). In: hidden = MLP output in plan.mlp mode, residual in
  // plan.residual mode. Out: hidden in plan.output mode; residual in
  // plan.output mode, or none after add_residual_all_gather.
  // Errors: as PrepareAttention; kInvalidArgument when `op` is not allowed by
  // the plan; kFailedPrecondition for reduce_scatter under SUM_LEN padding,
  // add_residual_all_gather without a residual, take_split with a residual.
  absl::Status PostMlp(const DpGatherLayout& dp, AfterMlpOp op, LayerActivations& act) const;

 private:
  LayerCommunicator(const ParallelGroups* groups, const LayerPlan& plan, int64_t hidden)
      : groups_(groups), plan_(plan), hidden_(hidden) {}

  absl::Status CheckRows(const char* step, const char* tensor, const std::vector<float>& t,
                         const DpGatherLayout& dp, ScatterMode mode) const;

  const ParallelGroups* groups_;
  LayerPlan plan_;
  int64_t hidden_;
};

}  // namespace moe_ep::core
