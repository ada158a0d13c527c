#pragma once

// The memory preflight of `moe-ep run`: what the run will hold on this
// machine, checked against the memory this process may use (core::AvailableMemoryBytes:
// MemAvailable, lowered to a pod's cgroup headroom) before any worker starts, so that a
// model too large for the machine fails fast with the options that do fit
// instead of being OOM-killed (or taking the machine down) mid-run.
//
// On this machine: every worker of the embedded local cluster (with
// --targets, none) and this process. All sizes in bytes. The estimate:
//   expert         3 * I * H * 2 (gate, up [I, H], down [H, I], bf16), or the
//                  weights' real bytes in their format (issue 35:
//                  core::quant::ExpertWeightBytes; fp8 I * H * 3 + scales,
//                  mxfp4 17/32 a weight + biases)
//   worker         experts   ceil(M / E) * expert * L   (0 with identity experts)
//                  workspace ComputeAllocatedWorkspace(E, N, H, K, bf16)
//                  other     3 * I * H * 4 (one expert widened to fp32;
//                            bf16 swiglu only: the quantized reference
//                            decodes 128-row tiles) + min(E * N, 512) * (8H + 8I) (the
//                            compute chunk) + 8 * N * H (Forward request and
//                            response, message and tensor) + 128 MiB (process)
//   coordinator    chunk     C * expert, C = ReferenceChunkExperts (0 with
//                            identity experts)
//                  records   L * rows * (4H + 8K) (every layer's inputs,
//                            outputs and routing, kept for verification)
//                  verify    rows * (14H + 8K) (+ rows * 8I, + 3 * I * H * 4
//                            with bf16 swiglu): one layer's gathered inputs, fp32
//                            reference, one expert's rows in and out
//                  messages  8 * max_step_rows * H
//                  process   256 MiB
// with rows = tokens of a layer summed over steps and ranks. The check:
//   num_local_workers * worker + coordinator <= MemAvailable - margin,
//   margin = max(1 GiB, MemAvailable / 10).
// Source: issue 2 ("any published Hugging Face config" on this machine).
// Example (DeepSeek-V3, 4 local workers, 1 layer, swiglu): expert 88,080,384;
// layer 256 * expert = 22,548,578,304 (21 GiB); each worker holds 64 experts
// = 5,637,144,576; the reference chunk is 12 experts = 1,056,964,608.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/quantized_formats.h"

namespace moe_ep::client {

struct RunMemoryInput {
  int num_experts = 0;               // M, routed experts per layer
  int64_t hidden = 0;                // H
  int64_t intermediate = 0;          // I, expert FFN size
  int top_k = 0;                     // K
  int world = 0;                     // E, ranks
  int num_local_workers = 0;         // workers started on this machine (0 with --targets)
  int num_layers = 0;                // L, MoE layers run
  bool identity = false;             // identity experts: no weights anywhere
  int redundant_slots_per_rank = 0;  // extra expert slots a worker may hold (DESIGN §15)
  int64_t capacity_tokens = 0;       // N, workspace tokens per rank
  int64_t rows_per_layer = 0;        // tokens of one layer, all steps and ranks
  int64_t max_step_rows = 0;         // tokens of the largest step, all ranks
  // The routed experts' weight format (what the workers load).
  core::quant::ExpertWeightFormat weight_format = core::quant::ExpertWeightFormat::kBf16;
};

struct RunMemoryEstimate {
  int64_t expert_bytes = 0;            // one SwiGLU expert (also with identity)
  int64_t layer_expert_bytes = 0;      // M * expert_bytes
  int64_t worker_expert_bytes = 0;     // the largest rank's experts, all L layers
  int64_t worker_workspace_bytes = 0;  // its all-to-all workspace
  int64_t worker_other_bytes = 0;      // compute scratch, messages, process
  int64_t worker_bytes = 0;            // the three above
  int64_t local_workers_bytes = 0;     // num_local_workers * worker_bytes
  int reference_chunk_experts = 0;     // C
  int64_t reference_chunk_bytes = 0;   // C * expert_bytes (0 with identity)
  int64_t coordinator_bytes = 0;       // this process
  int64_t needed_bytes = 0;            // local_workers_bytes + coordinator_bytes
};

// Experts per chunk of the verification's reference: as many as fit in
// 1 GiB, at least 1, at most 16 and at most `num_experts`. 16 when
// expert_bytes is 0 (identity). Examples: DeepSeek-V3 (84 MiB) -> 12,
// Mixtral-8x7B (336 MiB) -> 3, Qwen3-30B-A3B (9 MiB) -> 16.
int ReferenceChunkExperts(int64_t expert_bytes, int num_experts);

// The estimate above.
// Errors: kInvalidArgument when M, H, I, K, E, L or N < 1, M < E,
// num_local_workers < 0, or rows_per_layer / max_step_rows < 0 (names the
// field and value).
absl::StatusOr<RunMemoryEstimate> EstimateRunMemory(const RunMemoryInput& input);

// max(1 GiB, available_bytes / 10).
int64_t MemorySafetyMarginBytes(int64_t available_bytes);

// OK when the estimate fits in `available_bytes` minus the margin.
// Errors: kResourceExhausted otherwise, giving what is needed (workers and
// this process) and what is available, then the options: `--experts
// identity`, `--layers <the largest L that fits>` (or that even one layer
// does not fit), `--targets` (workers elsewhere; names what this process
// alone needs). The EstimateRunMemory errors.
absl::Status CheckRunMemory(const RunMemoryInput& input, int64_t available_bytes);

// The --memory-cap-bytes given to each local worker: an equal share of what
// this process leaves, (available - margin - coordinator_bytes) /
// num_local_workers; at least worker_bytes whenever CheckRunMemory passed.
// 0 (no cap) when num_local_workers is 0.
int64_t LocalWorkerMemoryCapBytes(const RunMemoryEstimate& estimate, int num_local_workers,
                                  int64_t available_bytes);

}  // namespace moe_ep::client
