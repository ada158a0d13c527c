#pragma once

// The GPU half of core::LayerCommunicator (DESIGN §3, §4; issue 4): the three
// communication steps of one decoder layer's plan on device buffers, over
// stream collectives (kernels/stream_collective.h) formed by GpuParallelGroups.
// Each step checks its inputs, builds the step's program (core/
// step_program.h, the same list the CPU path builds) and enqueues it on a
// kernels::DeviceStepExecutor (issue 11).
//
// Same contract as core::LayerCommunicator (read its file comment for the
// rows each mode holds and how every collective is built), with these
// differences:
//   - tensors are fp32 [rows, H] device buffers held by GpuLayerActivations,
//     which carries their row counts (the CPU path's vector sizes);
//   - the TP all-reduce + residual add + RMSNorm (kAllReduceAddNorm) and the
//     attention-TP all-reduce + norm (kAttnTpAllReduceNorm) run fused (NCCL
//     all-reduce, then one add-and-norm kernel) or unfused (all-reduce, add
//     kernel, norm kernel) as the options say; both always all-reduce;
//   - every step only enqueues work: kernels and world collectives on the
//     world group's stream (stream()), attention-TP collectives on that
//     group's stream, joined to the world stream with events. Steps return
//     once enqueued; Synchronize() waits. No step allocates or synchronises
//     (device memory is allocated when the activations are created).
//   - a collective whose element count is zero is not entered; the count is
//     the same on every rank of the group (it comes from the DP layout), so
//     all ranks skip it together.
// Results: data movement, residual adds and the reduce-scatter's ascending
// chunk sum are bitwise equal to the CPU path; NCCL's all-reduce sums in its
// own order, and the norm's sum of squares is a tree, so values agree with
// the CPU path to fp32 rounding (tests: relative 1e-5).
//
// Not thread-safe (like Collective). Source: DESIGN §3, §4; core/
// layer_communicator.h; sglang layer communicator (seed 002).

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/dp_padding.h"
#include "core/layer_communicator.h"
#include "core/layer_plan.h"
#include "core/parallel_groups.h"
#include "core/rms_norm.h"
#include "kernels/device_step_executor.h"
#include "kernels/gpu_activations.h"
#include "kernels/nccl_collective.h"
#include "kernels/rms_norm.cuh"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {

// The world and attention-TP groups of a rank as stream collectives.
using GpuParallelGroups = core::BasicParallelGroups<StreamCollective>;

// The implementation of the all-reduce + residual + norm steps.
using GpuLayerCommunicatorOptions = DeviceStepOptions;

class GpuLayerCommunicator {
 public:
  // `groups` (not owned, must outlive the communicator): stream collectives
  // on one device. `plan` from PlanLayers / BuildLayerPlan for groups->layout().
  // Creates its DeviceStepExecutor (two CUDA events).
  // Errors: kInvalidArgument for a null groups, hidden < 1,
  // options.all_reduce_norm out of range; kInternal from CUDA.
  static absl::StatusOr<std::unique_ptr<GpuLayerCommunicator>> Create(
      const GpuParallelGroups* groups, const core::LayerPlan& plan, int64_t hidden,
      const GpuLayerCommunicatorOptions& options = {});
  ~GpuLayerCommunicator() = default;
  GpuLayerCommunicator(const GpuLayerCommunicator&) = delete;
  GpuLayerCommunicator& operator=(const GpuLayerCommunicator&) = delete;

  const core::LayerPlan& plan() const { return plan_; }
  // The world group's stream: every step's work is ordered on it.
  cudaStream_t stream() const { return executor_->stream(); }
  // The all-reduce + norm implementation a step over `rows` rows uses.
  AllReduceNormImpl AllReduceNormFor(int64_t rows) const;

  // Step 1, as core::LayerCommunicator::PrepareAttention.
  // Errors: as the CPU path (kInvalidArgument for a layout that does not fit
  // the groups, a tensor whose rows != ModeRows, naming tensor, mode and both
  // numbers; norm hidden != H); kResourceExhausted when act's capacity is
  // below the rows the step needs; kInvalidArgument when act or norm live on
  // another device; collective and CUDA errors.
  absl::Status PrepareAttention(const core::DpGatherLayout& dp, const DeviceRmsNorm& input_norm,
                                GpuLayerActivations& act) const;

  // Step 2, as core::LayerCommunicator::PrepareMlp (same ops and options);
  // kAllReduceAddNorm and kAttnTpAllReduceNorm use AllReduceNormFor(rows).
  // Errors: as PrepareAttention; kFailedPrecondition without a residual.
  absl::Status PrepareMlp(const core::DpGatherLayout& dp, const DeviceRmsNorm& post_attention_norm,
                          GpuLayerActivations& act) const;

  // As core::LayerCommunicator::ResolveAfterMlp.
  core::AfterMlpOp ResolveAfterMlp(const core::DpGatherLayout& dp, bool allow_reduce_scatter) const;

  // Step 3, as core::LayerCommunicator::PostMlp.
  // Errors: as PrepareAttention; kInvalidArgument when `op` is not allowed by
  // the plan; kFailedPrecondition for reduce_scatter under SUM_LEN,
  // add_residual_all_gather without a residual, take_split with a residual.
  absl::Status PostMlp(const core::DpGatherLayout& dp, core::AfterMlpOp op,
                       GpuLayerActivations& act) const;

  // Waits for all enqueued work (world stream, with the group's deadline).
  // Errors: the collective's (kDeadlineExceeded, kUnavailable).
  absl::Status Synchronize() const;

 private:
  GpuLayerCommunicator() = default;

  absl::Status CheckRows(const char* step, const char* tensor, int64_t rows,
                         const core::DpGatherLayout& dp, core::ScatterMode mode) const;
  absl::Status CheckActivations(const char* step, const core::DpGatherLayout& dp,
                                const GpuLayerActivations& act) const;
  absl::Status CheckNorm(const char* which, const DeviceRmsNorm& norm) const;

  const GpuParallelGroups* groups_ = nullptr;
  core::LayerPlan plan_;
  int64_t hidden_ = 0;
  std::unique_ptr<DeviceStepExecutor> executor_;
};

}  // namespace moe_ep::kernels
