#pragma once

// The memory preflight of `moe-ep stack` (and `moe-ep run --tp`): what the
// layer stack will hold on this machine, checked against MemAvailable before
// any worker starts, the way `moe-ep run` checks its MoE layers
// (client/memory_budget.h). On this machine: every local worker (with
// --targets, none) and this process. All sizes in bytes.
//   worker       stack   core::EstimateLayerStackBytes(config, rank 0)
//                        (rank 0 holds the most experts)
//                other   core::EstimateLayerStackScratchBytes(config,
//                        gathered_rows, dense-MLP TP size) + 16 * gathered_rows
//                        * H (the step's tokens and output, message and
//                        tensor) + 128 MiB (process)
//   coordinator  reference  core::EstimateReferenceLayerStackBytes(config,
//                        step_rows): the largest layer whole, e.g. every
//                        expert of a sparse layer
//                messages  step_rows * H * (8 + 4 * attn_tp) (tokens and every
//                        rank's output)
//                process   256 MiB
// The check: num_local_workers * worker + coordinator <= MemAvailable -
// margin (MemorySafetyMarginBytes).
// Source: issue 9 item 3 (DeepSeek-V3 --tp 2 --layers 4 ran 49 s, then a
// worker was OOM-killed).
// Example (DeepSeek-V3, --tp 2 --layers 4: layers 0-2 dense, 3 sparse): each
// worker holds 4 x 196 MiB attention, 3 x 756 MiB dense MLPs and 128 x 84 MiB
// experts (about 14.5 GiB); the reference holds layer 3's 256 experts (21 GiB).

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/layer_stack.h"

namespace moe_ep::client {

struct StackMemoryInput {
  core::LayerStackConfig config;  // as the workers will build it
  int num_local_workers = 0;      // workers started on this machine (0 with --targets)
  int64_t step_rows = 0;          // tokens of the largest step, all DP groups
  int64_t gathered_rows = 0;      // rows a rank sees in that step (attn_dp * largest group)
};

struct StackMemoryEstimate {
  int64_t worker_stack_bytes = 0;   // weights and workspace of rank 0
  int64_t worker_other_bytes = 0;   // scratch, messages, process
  int64_t worker_bytes = 0;         // the two above
  int64_t local_workers_bytes = 0;  // num_local_workers * worker_bytes
  int64_t reference_bytes = 0;      // peak of the single-process reference
  int64_t coordinator_bytes = 0;    // this process: reference, messages, process
  int64_t needed_bytes = 0;         // local_workers_bytes + coordinator_bytes
};

// The estimate above.
// Errors: kInvalidArgument for num_local_workers, step_rows or gathered_rows
// < 0 (names the field); the core estimates' errors (an invalid config).
absl::StatusOr<StackMemoryEstimate> EstimateStackMemory(const StackMemoryInput& input);

// OK when the estimate fits in `available_bytes` minus the margin.
// Errors: kResourceExhausted otherwise, giving what is needed (workers and
// this process, with the largest parts) and what is available, then the
// options: `--layers <the most leading layers that fit>` (or that even one
// does not), smaller stand-in sizes (--hidden, --moe-intermediate,
// --dense-intermediate) and `--targets` (what this process alone needs).
// The EstimateStackMemory errors.
absl::Status CheckStackMemory(const StackMemoryInput& input, int64_t available_bytes);

// The --memory-cap-bytes of each local worker: an equal share of what this
// process leaves, (available - margin - coordinator_bytes) / num_local_workers,
// at least 1; at least worker_bytes whenever CheckStackMemory passed. 0 (no
// cap) when num_local_workers is 0.
int64_t StackWorkerMemoryCapBytes(const StackMemoryEstimate& estimate, int num_local_workers,
                                  int64_t available_bytes);

}  // namespace moe_ep::client
