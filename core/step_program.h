#pragma once

// The layer communicator as a step program (DESIGN §3, §4; issue 11 item 1):
// each of a layer's three communication steps, for one rank under one DP
// layout, becomes a validated list of primitives over two token tensors
// (hidden, residual). The list is built by pure functions from the plan, the
// layout and the rank, checked by ValidateStepProgram, and executed by two
// executors that know nothing about plans:
//   - core::HostStepExecutor (core/step_executor.h) over core::ControlCollective;
//   - kernels::DeviceStepExecutor over kernels::StreamCollective.
// The layer stacks (core/layer_stack.h, kernels/staged_step_executor.h)
// build every layer's programs once and hand them to their executor.
//
// Rows a rank holds per mode are ModeRows (below); a program's primitives
// carry resolved row counts, offsets and whether this rank takes part, so an
// executor needs only its groups and the norm. Every rank of a group builds
// the same collective primitives in the same order (counts come from the DP
// layout, the same on every rank), so the collectives stay in step.
//
// Pure and thread-safe. Source: DESIGN §3, §4; sglang layer communicator
// (seed 002, CommunicateWithAllReduceAndLayerNormFn and friends).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dp_padding.h"
#include "core/layer_plan.h"

namespace moe_ep::core {

// Rows a rank holds in `mode` for a step with layout `dp`:
//   SCATTERED     dp.local_rows / attn_tp_size
//   TP_ATTN_FULL  dp.local_rows
//   FULL          dp.global_rows
// Example (DESIGN §4): attn_tp 2, counts [5, 2] -> SCATTERED 3,
// TP_ATTN_FULL 6, FULL 12.
int64_t ModeRows(const DpGatherLayout& dp, ScatterMode mode);

// OK when `dp` was made for `rank` under `layout`: the same attn_tp_size, one
// padded count and one offset per DP group, and this rank's dp_rank.
// Errors: kInvalidArgument naming `layer` and both sides' values ("does not
// fit rank <r>"). Pure.
absl::Status CheckDpLayoutFits(const DpGatherLayout& dp, const ParallelLayout& layout, int rank,
                               int layer);

// The two token tensors a program works on.
enum class StepTensor { kHidden, kResidual };
// The group a collective primitive runs in: all ranks, or this rank's
// attention-TP group (core/parallel_groups.h).
enum class StepGroup { kWorld, kAttnTp };

enum class StepOp {
  // tensor := all-gather of tensor in `group` (rank-major); rows_out =
  // rows_in * group size.
  kAllGather,
  // tensor := this rank's chunk of the element-wise sum over `group`;
  // rows_in a multiple of the group size, rows_out = rows_in / size.
  kReduceScatter,
  // tensor := element-wise sum over `group`, in place.
  kAllReduce,
  // hidden += residual (same rows). Emitted only on the ranks that add: on
  // attention-TP rank 0 before the summing DP gather (the attention output
  // is a partial sum, the residual is whole on every rank), on every rank
  // in add_residual_all_gather. `drop_residual`: the residual becomes none.
  kAddResidual,
  // tensor := rows [first, first + rows_out) of `source` (rows_in rows).
  kSlice,
  // hidden := [rows_out] rows of zeros with hidden's rows_in rows at row
  // `first` (the placement of the summing DP gather, DESIGN §4).
  kPlace,
  // residual := hidden + residual; hidden := RMSNorm(residual).
  kAddAndNorm,
  // residual := hidden; hidden := RMSNorm(hidden) (no residual before).
  kStoreAndNorm,
  // hidden := RMSNorm(hidden).
  kNorm,
};

struct StepPrimitive {
  StepOp op = StepOp::kNorm;
  StepTensor tensor = StepTensor::kHidden;  // the tensor written
  StepTensor source = StepTensor::kHidden;  // kSlice: the tensor read; else == tensor
  StepGroup group = StepGroup::kAttnTp;     // collectives only
  int64_t rows_in = 0;                      // rows of the tensor read
  int64_t rows_out = 0;                     // rows of the tensor written
  int64_t first = 0;                        // kSlice: first row read; kPlace: row written
  bool drop_residual = false;               // kAddResidual only
};

// One step of one layer on one rank. residual_rows_* < 0 = no residual.
struct StepProgram {
  std::string label;  // "layer <l> <step> (<op>)", for messages
  int64_t hidden_rows_in = 0;
  int64_t residual_rows_in = -1;
  std::vector<StepPrimitive> primitives;
  int64_t hidden_rows_out = 0;
  int64_t residual_rows_out = -1;

  // Whether a primitive needs the step's RMSNorm.
  bool UsesNorm() const;
  // The most rows any tensor holds at any point (device buffers need this
  // many rows; 0 for an empty step).
  int64_t MaxRows() const;
};

// ValidateStepProgram()
//
// Walks the program from (hidden_rows_in, residual_rows_in): every
// primitive's rows_in must equal the rows its input tensor holds then;
// all-gather multiplies and reduce-scatter divides by the group size
// (layout.attn_tp_size() or tp_size), which must divide it; slices and
// placements stay inside their buffers; add-residual and add-and-norm need a
// residual of hidden's rows, store-and-norm none; the walk must end at
// (hidden_rows_out, residual_rows_out). Counts must be >= 0.
// Errors: kInvalidArgument naming the label, the primitive's index and
// DescribeStepPrimitive, expected vs got. Pure.
absl::Status ValidateStepProgram(const StepProgram& program, const ParallelLayout& layout);

// BuildBeforeAttentionProgram()
//
// Step 1 of `plan` on `rank`: input RMSNorm (add-and-norm when
// `has_residual`, else store-and-norm), then the attention-TP all-gather of
// hidden for attn_tp_all_gather. In: hidden (and the residual) in plan.input.
// Out: hidden in plan.attention, residual in plan.input.
// Errors: CheckDpLayoutFits and ValidateStepProgram errors. Pure.
// Example: tp 4, attn_dp 2, counts [5, 2], input SCATTERED, with a residual:
//   add_and_norm(3); all_gather(hidden, attn_tp, 3 -> 6).
absl::StatusOr<StepProgram> BuildBeforeAttentionProgram(const LayerPlan& plan,
                                                        const ParallelLayout& layout, int rank,
                                                        const DpGatherLayout& dp,
                                                        bool has_residual);

// BuildBeforeMlpProgram()
//
// Step 2 of `plan` on `rank` (the residual exists: step 1 creates it). In:
// hidden = attention output in plan.attention, residual in plan.input. Out:
// hidden (normed) in plan.mlp, residual in plan.residual. The primitives per
// plan.before_mlp (R local rows, G global rows, o this DP group's offset, s
// SCATTERED rows, j the attention-TP rank, [..] when the plan says so):
//   norm                     add_and_norm(R)
//   dp_gather, norm before   add_and_norm(R); place(R -> G at o);
//                            all_reduce(world, G)
//   dp_gather, norm after    [all_gather(residual)]; add_residual on j == 0;
//                            place(R -> G at o); all_reduce(world, G);
//                            slice(residual := hidden[o, o + R)); norm(G)
//   all_reduce_add_norm      [all_gather(residual)]; all_reduce(world, R);
//                            add_and_norm(R)
//   reduce_scatter_norm      reduce_scatter(attn_tp, R -> s);
//                            [slice(residual := residual[j*s, j*s + s))];
//                            add_and_norm(s)
//   attn_tp_all_reduce_norm  [all_gather(residual)]; all_reduce(attn_tp, R);
//                            add_and_norm(R)
// Errors: CheckDpLayoutFits and ValidateStepProgram errors. Pure.
// Example: the DESIGN §4 worked example (tp 4, attn_dp 2, counts [5, 2]),
// layer 0 (dp_gather, norm after), rank 3: place(6 -> 12 at 6) without
// add_residual (attention-TP rank 1).
absl::StatusOr<StepProgram> BuildBeforeMlpProgram(const LayerPlan& plan,
                                                  const ParallelLayout& layout, int rank,
                                                  const DpGatherLayout& dp);

// OK when `op` may run as `plan`'s after-MLP step: plan.after_mlp itself, or
// reduce_scatter where the plan says dp_scatter (ResolveAfterMlpOp).
// Errors: kInvalidArgument "layer <l>, step after_mlp: op <op> is not allowed
// by the plan's <op>". Pure.
absl::Status CheckAfterMlpOpAllowed(const LayerPlan& plan, AfterMlpOp op);

// BuildAfterMlpProgram()
//
// Step 3 of `plan` with `op` on `rank`. In: hidden = MLP output in plan.mlp,
// residual (when `has_residual`) in plan.residual. Out: hidden in
// plan.output, the residual in plan.output or none. Primitives:
//   none                     (empty)
//   dp_scatter               slice(hidden := hidden[o, o + R))
//   reduce_scatter           reduce_scatter(world, G -> G / tp);
//                            all_gather(hidden, attn_tp, -> R)
//   add_residual_all_gather  add_residual (drops it); all_gather(hidden, attn_tp)
//   take_split               slice(hidden := hidden[j*s, j*s + s))
// Errors: CheckAfterMlpOpAllowed's; kFailedPrecondition for reduce_scatter
// without MAX_LEN padding ("needs MAX_LEN padding"), add_residual_all_gather
// without a residual ("needs a residual"), take_split with one ("requires no
// residual"), naming layer, op and rank; CheckDpLayoutFits and
// ValidateStepProgram errors. Pure.
absl::StatusOr<StepProgram> BuildAfterMlpProgram(const LayerPlan& plan,
                                                 const ParallelLayout& layout, int rank,
                                                 const DpGatherLayout& dp, AfterMlpOp op,
                                                 bool has_residual);

// The three programs of one layer for one forward step.
struct LayerStepPrograms {
  StepProgram before_attention;
  StepProgram before_mlp;
  AfterMlpOp after_mlp_op = AfterMlpOp::kNone;  // ResolveAfterMlpOp's choice
  StepProgram after_mlp;
};

// BuildStackPrograms()
//
// The programs of every layer of `plans` (PlanLayers, in order) for one
// forward step under `dp` on `rank`, built once per step: layer 0 starts
// without a residual, each later layer with the residual the previous one
// left (none after add_residual_all_gather); the after-MLP op is
// ResolveAfterMlpOp(plan, dp.mode, allow_reduce_scatter).
// Errors: those of the three builders, the first failing layer's. Pure.
absl::StatusOr<std::vector<LayerStepPrograms>> BuildStackPrograms(
    const std::vector<LayerPlan>& plans, const ParallelLayout& layout, int rank,
    const DpGatherLayout& dp, bool allow_reduce_scatter);

// "all_gather(hidden, attn_tp, 3 -> 6)", "reduce_scatter(hidden, world, 12 -> 3)",
// "all_reduce(hidden, world, 12)", "add_residual(6)", "add_residual_drop(3)",
// "slice(residual := hidden[6, 12))", "place(hidden, 6 -> 12 at 6)",
// "add_and_norm(6)", "store_and_norm(6)", "norm(12)".
std::string DescribeStepPrimitive(const StepPrimitive& primitive);
// The primitives' descriptions joined by "; " ("" for an empty program).
std::string DescribeStepProgram(const StepProgram& program);

}  // namespace moe_ep::core
