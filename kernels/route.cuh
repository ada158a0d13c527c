#pragma once

// Host launcher of the GPU dispatch routing (DESIGN §7): per token, the
// distinct destination ranks of its K experts; per destination, the number of
// tokens sent and each token's slot. Slots fill in increasing source-token
// order via block prefix sums (no atomics), so the result is deterministic and
// equals core::ComputeDispatchRoute exactly.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/expert_id_error.h"

namespace moe_ep::kernels {

// Largest ep_size the GPU kernels support (per-token destination tables and
// shared-memory arrays are sized by it).
inline constexpr int kMaxEpSize = 64;
// Largest top_k the GPU kernels support.
inline constexpr int kMaxTopK = 64;

// A placement table in device memory (DESIGN §15): the replicas of logical
// expert e live on ranks replica_ranks[replica_offsets[e] ..
// replica_offsets[e + 1]), in core::PlacementTable::Replicas order. A valid
// choice id of token t goes to
//   replica_ranks[replica_offsets[id] + (t + source_rank) mod n_id]
// (core::PlacementTable::ChooseReplica). Null replica_offsets: the
// contiguous placement of DESIGN §7.
struct DevicePlacement {
  const int32_t* replica_offsets = nullptr;  // device [num_experts + 1]
  const int32_t* replica_ranks = nullptr;    // device [num_slots]
  int source_rank = 0;                       // this rank
};

struct RouteParams {
  const int32_t* topk_ids = nullptr;    // device [max_tokens, K] int32, rows [0, T) read
  const int64_t* num_tokens = nullptr;  // device scalar T, clamped to max_tokens
  int64_t max_tokens = 0;               // R: rows of topk_ids / token_slot
  int top_k = 0;                        // K
  int num_experts = 0;                  // ids outside [0, num_experts) select no rank
  int ep_size = 0;                      // E (contiguous placement, DESIGN §7)
  int32_t* token_slot = nullptr;        // device [max_tokens, E]: slot on rank d or -1
  int32_t* send_counts = nullptr;       // device [E]: tokens sent to each rank
  DevicePlacement placement;            // the table; null offsets = contiguous
  // Load statistics (DESIGN §15): device [num_experts], += 1 for every valid
  // (token, choice) pair of the step, by atomics of block 0 (integer sums, so
  // the totals are exact and deterministic). Null: not counted.
  unsigned long long* expert_tokens = nullptr;
  // DESIGN §7: ids neither in [0, num_experts) nor invalid_expert_id are the
  // caller's bug; block 0 records them in *id_error (kernels/expert_id_error.h)
  // and they select no rank, like the invalid id. Null: not checked.
  int32_t invalid_expert_id = -1;
  ExpertIdError* id_error = nullptr;
};

// LaunchRoute()
//
// Enqueues the routing of the T = min(*num_tokens, max_tokens) tokens on
// `stream`. T lives in device memory so a captured CUDA graph can be replayed
// with any T <= max_tokens. Rows t >= T of token_slot are not written.
// One block per destination rank walks the tokens in chunks of 512 and
// assigns slots with a block-wide exclusive scan; work is O(T * K * E).
//
// Errors (checked on the host, nothing enqueued):
//   kInvalidArgument  null pointers, max_tokens < 0, top_k outside
//                     [1, kMaxTopK], ep_size outside [1, kMaxEpSize],
//                     num_experts < ep_size.
//   kInternal         the launch failed (cudaGetErrorString in the message).
// Never allocates or synchronises (graph-capturable).
// Example: E=2, 4 experts (2 per rank), K=2, ids [[0,3],[1,1],[-1,9]] ->
//   token_slot [[0,0],[1,-1],[-1,-1]], send_counts [2,1]; with
//   expert_tokens, += {1, 2, 0, 1}; with id_error (invalid id -1), 9 at
//   flat index 5 is recorded: count 1.
absl::Status LaunchRoute(const RouteParams& params, cudaStream_t stream);

}  // namespace moe_ep::kernels
