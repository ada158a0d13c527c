#pragma once

// Memory of a layer stack (core/layer_stack.h): what a rank of
// DistributedLayerStack holds once built, and the peak of
// ReferenceLayerStack in one process. The worker caps its build with the
// first (server/layer_stack_runner.h, --memory-cap-bytes); `moe-ep stack`
// adds both to its memory preflight (client/memory_budget.h) so a stack too
// large for the machine is refused before any worker starts.
//
// Sizes in bytes. Weights are bf16 (2 bytes), the stand-in attention and the
// norms fp32 (core/layer_stack.cc MakeLayerWeights); an MLP computes on its
// weights widened to fp32 (core/experts.h Apply).
// Source: issue 9 item 3 (`moe-ep stack` on DeepSeek-V3 was OOM-killed).

#include <cstdint>

#include "absl/status/statusor.h"
#include "core/layer_stack.h"

namespace moe_ep::core {

// EstimateLayerStackBytes()
//
// An upper bound of the bytes rank `rank` holds for a stack built from
// `config`: per layer the attention stand-in [H, H] fp32 and two norms [H]
// fp32; per dense layer the whole dense SwiGLU (3 * I * H bf16, generated
// whole before it is sharded); per sparse layer this rank's experts
// (contiguous placement, 3 * I * H bf16 each); and, when a sparse layer runs
// SCATTERED, the all-to-all workspace (ComputeAllocatedWorkspace with
// E = tp_size, N = capacity_tokens, bf16). Activations of a step are not
// included. Errors: those of ValidateLayerStackConfig, ExpertPlacement and
// ComputeAllocatedWorkspace. Pure and thread-safe.
// Example: tp 2, H 32, dense I 64, expert I 32, 8 experts, top-2, one dense
// and one sparse layer, N 16, rank 0: 2*(4096+256) + 12288 + 4*6144 +
// workspace.
absl::StatusOr<int64_t> EstimateLayerStackBytes(const LayerStackConfig& config, int rank);

// EstimateLayerStackScratchBytes()
//
// An upper bound of what one Forward of the stack allocates on top of
// EstimateLayerStackBytes on a rank that sees `rows` token rows (for a rank of
// DistributedLayerStack: the DP-gathered rows of a step, every DP group's
// tokens; for the reference: all tokens of the step):
//   widened   3 * I * H * 4 (the largest MLP's weights widened to fp32: one
//             expert, or the dense MLP's shard of I / shards rows)
//   rows      rows * (8 * 4 * H + 2 * 4 * I + 8 * K) (hidden, residual,
//             output and their copies in fp32, the SwiGLU intermediates,
//             routing)
// with I the largest of the expert and the (sharded) dense intermediate.
// `dense_shards` is 1 for the reference and the dense-MLP TP size of a rank.
// Errors: kInvalidArgument for rows < 0 or dense_shards < 1;
// ValidateLayerStackConfig errors.
absl::StatusOr<int64_t> EstimateLayerStackScratchBytes(const LayerStackConfig& config, int64_t rows,
                                                       int dense_shards);

// EstimateReferenceLayerStackBytes()
//
// The peak of ReferenceLayerStack over `rows` tokens: it builds one layer at
// a time, so the largest layer's weights (attention and norms, plus the whole
// dense MLP or all num_experts experts of a sparse layer) plus
// EstimateLayerStackScratchBytes(config, rows, 1).
// Example: DeepSeek-V3's layer 3 (H 7168, 256 experts of I 2048) holds
// 256 * 88,080,384 = 22,548,578,304 bytes of experts.
// Errors: as EstimateLayerStackScratchBytes.
absl::StatusOr<int64_t> EstimateReferenceLayerStackBytes(const LayerStackConfig& config,
                                                         int64_t rows);

}  // namespace moe_ep::core
