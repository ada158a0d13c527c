#pragma once

// The device executor of step programs (core/step_program.h; issue 11 item
// 1): runs a program's primitives on a rank's GpuLayerActivations over two
// stream collectives (the world and the attention-TP group), the same list
// core::HostStepExecutor runs on host vectors. kernels::StagedStepExecutor
// uses it.
//
// How the primitives map to the device:
//   all_gather       StreamCollective::AllGather into the scratch buffer
//   reduce_scatter   AllToAllV of equal chunks into scratch, then the
//                    ascending chunk sum (LaunchSumChunks) into the front of
//                    the tensor: bitwise equal to the host executor
//   all_reduce       AllReduceSum; an all_reduce of hidden followed by
//                    add_and_norm runs as AllReduceAddRmsNorm, fused or
//                    unfused as AllReduceNormFor(rows) says (both always
//                    all-reduce)
//   add_residual     LaunchAddInPlace
//   slice / place    cudaMemcpyAsync (place zeroes its rows first)
//   *norm            the kernels of kernels/rms_norm.cuh
// Kernels and world collectives are enqueued on the world group's stream
// (stream()); attention-TP collectives on that group's stream, joined to the
// world stream with events. Run only enqueues; Synchronize waits. Run never
// allocates or synchronises. A collective with zero elements is not entered
// (the count comes from the DP layout: every rank of the group skips it).
// Values: data movement, adds and the reduce-scatter sum are bitwise equal to
// the host executor; NCCL's all-reduce order and the norm's tree sum agree
// to fp32 rounding.
//
// Not thread-safe (like its collectives). Source: DESIGN §3, §4; issue 4.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/step_program.h"
#include "kernels/gpu_activations.h"
#include "kernels/rms_norm.cuh"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {

struct DeviceStepOptions {
  // The implementation of an all-reduce followed by add-and-norm.
  AllReduceNormImpl all_reduce_norm = AllReduceNormImpl::kFused;
  // With kFused, steps with more rows than this take the unfused path (the
  // fused path is the small-batch one, DESIGN §3). < 0: no limit.
  int64_t fused_max_rows = -1;
};

class DeviceStepExecutor {
 public:
  // `world` and `attn_tp` (not owned, must outlive the executor): this
  // rank's groups on one device; `hidden` is H. Creates two CUDA events.
  // Errors: kInvalidArgument for a null group, groups on different devices,
  // hidden < 1, options.all_reduce_norm out of range; kInternal from CUDA.
  static absl::StatusOr<std::unique_ptr<DeviceStepExecutor>> Create(
      StreamCollective* world, StreamCollective* attn_tp, int64_t hidden,
      const DeviceStepOptions& options = {});
  ~DeviceStepExecutor();
  DeviceStepExecutor(const DeviceStepExecutor&) = delete;
  DeviceStepExecutor& operator=(const DeviceStepExecutor&) = delete;

  int device() const { return world_->device(); }
  int64_t hidden() const { return hidden_; }
  // The world group's stream: all of a program's work is ordered on it.
  cudaStream_t stream() const { return world_->stream(); }
  // The all-reduce + norm implementation for `rows` rows.
  AllReduceNormImpl AllReduceNormFor(int64_t rows) const;

  // Run()
  //
  // Enqueues `program` on `act` (built for this rank; `norm` may be null when
  // !program.UsesNorm()). On return act's row counts and buffers describe
  // the program's output.
  // Errors, before anything is enqueued: kInvalidArgument when act or norm
  // live on another device or have another H, and core::CheckStepInputs's;
  // kResourceExhausted when act.capacity_rows() < program.MaxRows(). Then
  // the collectives' and CUDA's errors.
  absl::Status Run(const core::StepProgram& program, const DeviceRmsNorm* norm,
                   GpuLayerActivations& act) const;

  // Waits for all enqueued work (both streams, with the groups' deadline).
  // Errors: the collectives' (kDeadlineExceeded, kUnavailable).
  absl::Status Synchronize() const;

 private:
  DeviceStepExecutor() = default;

  StreamCollective& Group(core::StepGroup group) const;
  // Runs `enqueue` on `group`'s stream, ordered after the world stream's
  // prior work and before its later work (directly for the world group).
  template <typename F>
  absl::Status OnGroupStream(core::StepGroup group, F&& enqueue) const;

  StreamCollective* world_ = nullptr;
  StreamCollective* attn_tp_ = nullptr;
  int64_t hidden_ = 0;
  DeviceStepOptions options_;
  cudaEvent_t fork_ = nullptr;
  cudaEvent_t join_ = nullptr;
};

}  // namespace moe_ep::kernels
