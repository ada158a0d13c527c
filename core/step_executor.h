#pragma once

// Executors of step programs (core/step_program.h) on host tensors: the
// interface the layer stack runs its communication steps through, and the
// host executor over core::ControlCollective. The device executor is
// kernels::DeviceStepExecutor (device tensors); kernels::StagedStepExecutor
// puts it behind this interface for host tensors (ForwardLayers on NCCL
// workers). Source: DESIGN §3, §4; issue 11 item 1.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/parallel_groups.h"
#include "core/rms_norm.h"
#include "core/step_program.h"

namespace moe_ep::core {

// The token tensors of one rank between steps.
struct LayerActivations {
  std::vector<float> hidden;  // [rows, H]
  // [rows, H]; none before the first layer's input norm and after
  // add_residual_all_gather (the residual was added into hidden).
  std::optional<std::vector<float>> residual;
};

class StepExecutor {
 public:
  virtual ~StepExecutor() = default;

  // "host" or "device".
  virtual std::string name() const = 0;

  // Run()
  //
  // Executes `program` (built by core/step_program.h for this executor's
  // rank and layout) on `act`. `norm` is the step's RMSNorm; it may be null
  // when !program.UsesNorm().
  // Errors: kInvalidArgument when act's tensors do not hold the program's
  // input rows * H (naming the label, tensor and both numbers) or the norm
  // is missing or of another width, before any communication; the
  // collectives' errors (kDeadlineExceeded, kUnavailable). A collective over
  // the groups the program uses: every rank runs its program of the same
  // step. On error `act` is unspecified.
  virtual absl::Status Run(const StepProgram& program, const RmsNorm* norm,
                           LayerActivations& act) = 0;
};

// The input checks every executor makes: hidden holds hidden_rows_in rows,
// the residual residual_rows_in rows (or is absent when < 0), and the norm
// (width `norm_hidden`, < 0 = no norm) has width `hidden` when the program
// uses one. `rank` is for messages.
// Errors: kInvalidArgument (see StepExecutor::Run). Pure.
absl::Status CheckStepInputs(const StepProgram& program, int64_t hidden, int64_t norm_hidden,
                             int64_t hidden_rows, bool has_residual, int64_t residual_rows,
                             int rank);

// The executor over a rank's ParallelGroups (Gloo, or the host view of any
// group). Collective operations and how they are built on core/collective.h:
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
// The "fused" all-reduce + residual + RMSNorm is the all-reduce followed by
// one add-and-norm pass; the all-reduce is never skipped.
// Not thread-safe (like its groups).
class HostStepExecutor final : public StepExecutor {
 public:
  // `groups` (not owned) must outlive the executor; `hidden` is H >= 1.
  HostStepExecutor(const ParallelGroups* groups, int64_t hidden)
      : groups_(groups), hidden_(hidden) {}

  std::string name() const override { return "host"; }
  absl::Status Run(const StepProgram& program, const RmsNorm* norm, LayerActivations& act) override;

 private:
  ControlCollective& Group(StepGroup group) const;

  const ParallelGroups* groups_;
  int64_t hidden_;
};

}  // namespace moe_ep::core
