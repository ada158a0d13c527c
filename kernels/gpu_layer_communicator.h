#pragma once

// The GPU half of core::LayerCommunicator (DESIGN §3, §4; issue 4): the three
// communication steps of one decoder layer's plan on device buffers, over
// stream collectives (kernels/stream_collective.h) formed by GpuParallelGroups.
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
#include "kernels/nccl_collective.h"
#include "kernels/rms_norm.cuh"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {

// The world and attention-TP groups of a rank as stream collectives.
using GpuParallelGroups = core::BasicParallelGroups<StreamCollective>;

// The RMSNorm parameters on a device: weight [H] fp32 and eps.
class DeviceRmsNorm {
 public:
  // Copies `norm`'s weight to `device` (synchronous; setup time).
  // Errors: kInvalidArgument for a bad device; kResourceExhausted / kInternal
  // from CUDA.
  static absl::StatusOr<std::unique_ptr<DeviceRmsNorm>> Upload(const core::RmsNorm& norm,
                                                               int device);
  ~DeviceRmsNorm();
  DeviceRmsNorm(const DeviceRmsNorm&) = delete;
  DeviceRmsNorm& operator=(const DeviceRmsNorm&) = delete;

  const float* weight() const { return weight_; }
  float eps() const { return eps_; }
  int64_t hidden() const { return hidden_; }
  int device() const { return device_; }

 private:
  DeviceRmsNorm() = default;
  float* weight_ = nullptr;
  float eps_ = 0.0f;
  int64_t hidden_ = 0;
  int device_ = 0;
};

// The token tensors of one rank between steps (core::LayerActivations on a
// device): hidden [hidden_rows, H], an optional residual [residual_rows, H],
// and a scratch buffer the steps use, each with room for capacity_rows rows.
// The steps swap buffers, so hidden() and residual() may change after a step.
class GpuLayerActivations {
 public:
  // Allocates three buffers of max(capacity_rows, 1) * H floats on `device`.
  // capacity_rows must cover the most rows any step of the plans used with it
  // touches: dp.global_rows when a plan has a FULL mode, else dp.local_rows.
  // Starts with hidden_rows 0 and no residual.
  // Errors: kInvalidArgument for capacity_rows < 0, H < 1, a bad device;
  // kResourceExhausted when cudaMalloc fails.
  static absl::StatusOr<std::unique_ptr<GpuLayerActivations>> Create(int device,
                                                                     int64_t capacity_rows,
                                                                     int64_t hidden);
  ~GpuLayerActivations();
  GpuLayerActivations(const GpuLayerActivations&) = delete;
  GpuLayerActivations& operator=(const GpuLayerActivations&) = delete;

  int device() const { return device_; }
  int64_t capacity_rows() const { return capacity_rows_; }
  int64_t hidden_size() const { return hidden_size_; }
  float* hidden() const { return hidden_; }
  int64_t hidden_rows() const { return hidden_rows_; }
  // Null when there is no residual.
  float* residual() const { return has_residual_ ? residual_ : nullptr; }
  bool has_residual() const { return has_residual_; }
  int64_t residual_rows() const { return has_residual_ ? residual_rows_ : 0; }

  // Declares what the buffers hold after the caller wrote them on a stream
  // (e.g. the attention output into hidden()). residual_rows < 0 = none.
  // Errors: kInvalidArgument when a count is < 0 (hidden) or > capacity.
  absl::Status SetRows(int64_t hidden_rows, int64_t residual_rows);

  // Synchronous copies between `host` and the buffers (cudaMemcpy), for setup
  // and checks. REQUIRES: the stream that last wrote the buffers has finished
  // (GpuLayerCommunicator::Synchronize). Rows = vector size / H.
  // Errors: kInvalidArgument when a size is not a multiple of H or exceeds
  // the capacity; kInternal from CUDA.
  absl::Status Upload(const core::LayerActivations& host);
  absl::StatusOr<core::LayerActivations> Download() const;

 private:
  friend class GpuLayerCommunicator;
  GpuLayerActivations() = default;

  int device_ = 0;
  int64_t capacity_rows_ = 0;
  int64_t hidden_size_ = 0;
  float* hidden_ = nullptr;
  float* residual_ = nullptr;
  float* scratch_ = nullptr;
  int64_t hidden_rows_ = 0;
  int64_t residual_rows_ = 0;
  bool has_residual_ = false;
};

struct GpuLayerCommunicatorOptions {
  // The implementation of the all-reduce + residual + norm steps.
  AllReduceNormImpl all_reduce_norm = AllReduceNormImpl::kFused;
  // With kFused, steps with more rows than this take the unfused path (the
  // fused path is the small-batch one, DESIGN §3). < 0: no limit.
  int64_t fused_max_rows = -1;
};

class GpuLayerCommunicator {
 public:
  // `groups` (not owned, must outlive the communicator): stream collectives
  // on one device. `plan` from PlanLayers / BuildLayerPlan for groups->layout().
  // Creates two CUDA events (fork/join of the attention-TP stream).
  // Errors: kInvalidArgument for a null groups, hidden < 1, a group whose
  // backend is not NCCL (naming the backend), options.all_reduce_norm out of
  // range; kInternal from CUDA.
  static absl::StatusOr<std::unique_ptr<GpuLayerCommunicator>> Create(
      const GpuParallelGroups* groups, const core::LayerPlan& plan, int64_t hidden,
      const GpuLayerCommunicatorOptions& options = {});
  ~GpuLayerCommunicator();
  GpuLayerCommunicator(const GpuLayerCommunicator&) = delete;
  GpuLayerCommunicator& operator=(const GpuLayerCommunicator&) = delete;

  const core::LayerPlan& plan() const { return plan_; }
  // The world group's stream: every step's work is ordered on it.
  cudaStream_t stream() const { return world_->stream(); }
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
  // Runs `enqueue` (which enqueues on attn_tp_->stream()) ordered after the
  // world stream's prior work and before its later work.
  template <typename F>
  absl::Status OnAttnTpStream(F&& enqueue) const;
  // All-gather of `rows` rows a rank from `src` into `dst` ([size * rows, H])
  // in the attention-TP group.
  absl::Status AttnTpAllGather(const float* src, int64_t rows, float* dst) const;
  // Reduce-scatter of `full` ([n * c, H], n = group size) in `group` into
  // `out` [c, H] through `recv` [n * c, H]: AllToAllV of equal chunks (on the
  // attention-TP stream when `on_attn_tp`), then the ascending chunk sum on
  // the world stream. `out` may be `full` (the sum is ordered after the
  // exchange), never `recv`.
  absl::Status ReduceScatter(StreamCollective& group, bool on_attn_tp, const float* full,
                             int64_t full_rows, float* recv, float* out) const;
  absl::Status AddAndNorm(const DeviceRmsNorm& norm, GpuLayerActivations& act) const;

  const GpuParallelGroups* groups_ = nullptr;
  StreamCollective* world_ = nullptr;
  StreamCollective* attn_tp_ = nullptr;
  core::LayerPlan plan_;
  int64_t hidden_ = 0;
  GpuLayerCommunicatorOptions options_;
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_ = nullptr;
};

}  // namespace moe_ep::kernels
