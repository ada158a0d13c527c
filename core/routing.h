#pragma once

// Per-token destination ranks and deterministic slot assignment for dispatch
// (DESIGN §7). A token is sent once per distinct destination rank of its K
// experts, with all K ids and weights. Ids < 0 or >= num_experts mean "no
// expert": they select no rank (never rank 0; flashinfer issue 4017).
// Slots on each destination fill in increasing source-token order, so a run is
// deterministic (the reference kernel uses atomics and is not).

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/expert_placement.h"

namespace moe_ep::core {

// One source rank's dispatch routing for one step.
struct DispatchRoute {
  int64_t num_tokens = 0;            // T
  int top_k = 0;                     // K
  std::vector<int64_t> send_counts;  // [E]: tokens sent to each destination rank
  // CSR over source tokens: token t's destinations are entries
  // [token_offsets[t], token_offsets[t+1]) of dest_rank / dest_slot, ascending
  // by rank. token_offsets has T + 1 entries.
  std::vector<int64_t> token_offsets;
  std::vector<int32_t> dest_rank;  // destination rank of each send
  std::vector<int64_t> dest_slot;  // slot in [0, send_counts[rank]) on that rank
  // Send order per destination: tokens_for_rank[d][slot] = source token index.
  std::vector<std::vector<int64_t>> tokens_for_rank;
};

// Computes the route of `topk_ids` ([T, K] int32, row-major) under
// `placement`. When `runtime_max_tokens_per_rank` >= 0, every send_counts[d]
// must be <= it (always true when R >= T).
// Errors: kInvalidArgument when topk_ids.size() != T * K, K < 1, T < 0.
absl::StatusOr<DispatchRoute> ComputeDispatchRoute(absl::Span<const int32_t> topk_ids,
                                                   int64_t num_tokens, int top_k,
                                                   const ExpertPlacement& placement);

}  // namespace moe_ep::core
