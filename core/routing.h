#pragma once

// Per-token destination ranks and deterministic slot assignment for dispatch
// (DESIGN §7). A token is sent once per distinct destination rank of its K
// experts, with all K ids and weights. Ids < 0 or >= num_experts select no
// rank (never rank 0; flashinfer issue 4017); of those only the configured
// invalid id is valid input (ValidateExpertIds, which the data planes run
// first).
// Slots on each destination fill in increasing source-token order, so a run is
// deterministic (the reference kernel uses atomics and is not).

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/expert_placement.h"
#include "core/placement_table.h"

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

// ComputeDispatchRoute() under a placement table (DESIGN §15)
//
// As above, with the destination of valid choice id of token t (t < T) of
// source rank `source_rank` being the rank of
// table.ChooseReplica(source_rank, t, id). For PlacementTable::Contiguous
// this is exactly the route under ExpertPlacement::Contiguous. Under a rank
// mask (PlacementTable::WithMask) a choice of a lost expert selects no rank,
// like an invalid id: it contributes zero.
// Errors: as above; kInvalidArgument when source_rank is outside
// [0, table.ep_size()).
absl::StatusOr<DispatchRoute> ComputeDispatchRoute(absl::Span<const int32_t> topk_ids,
                                                   int64_t num_tokens, int top_k,
                                                   const PlacementTable& table, int source_rank);

// PayloadExpertId()
//
// The expert id that choice `expert_id` of token `source_token_idx` of
// `source_rank` carries in the copy of the token sent to `dest_rank`: the id
// itself when it is invalid (outside [0, E)), when its logical expert has one
// live replica, or when the chosen replica (ChooseReplica) is on `dest_rank`;
// `invalid_expert_id` for an expert lost under a rank mask (no live replica);
// otherwise `invalid_expert_id`, so exactly one rank computes each choice
// even when several ranks that receive the token hold a replica of it.
// With the contiguous table every expert has one replica and the payload is
// the caller's ids unchanged (DESIGN §7). Pure and thread-safe.
// Example: expert 3 on ranks 0 and 1, source rank 0, token 1 -> replica
// (1 + 0) mod 2 = 1, on rank 1: dest 1 -> 3, dest 0 -> invalid.
int32_t PayloadExpertId(const PlacementTable& table, int source_rank, int64_t source_token_idx,
                        int32_t expert_id, int dest_rank, int32_t invalid_expert_id);

// ValidateExpertIds()
//
// DESIGN §7: in `topk_ids` ([T, K] int32, flat, K = top_k >= 1) every id is
// an expert in [0, num_experts) or the configured `invalid_expert_id` (-1,
// or num_experts under that convention), which is the caller's padding and
// selects no expert. Any other id is a routing bug of the caller, not
// padding. Errors: kInvalidArgument naming the first such id's row (token)
// and choice, the id, the valid range and how many ids are out of range,
// e.g. "topk_ids[row 3, choice 1] = 40: outside [0, 32) and not the invalid
// expert id -1 (1 id out of range in 5 rows)". Pure; one pass over the ids.
absl::Status ValidateExpertIds(absl::Span<const int32_t> topk_ids, int top_k, int num_experts,
                               int32_t invalid_expert_id);

// ExpertIdError()
//
// The kInvalidArgument of an id out of range at flat index `index` of
// [T, top_k] ids: "topk_ids[row r, choice c] = id: outside [0, E) and not the
// invalid expert id X (<detail>)". ValidateExpertIds and the GPU planes'
// device record (kernels/expert_id_error.h) word it the same way. Pure.
absl::Status ExpertIdError(int64_t index, int top_k, int32_t id, int num_experts,
                           int32_t invalid_expert_id, std::string_view detail);

// CountExpertTokens()
//
// Adds to counts[e] the number of entries of `topk_ids` ([T, K], flat) equal
// to e, for e in [0, num_experts): the load statistics of DESIGN §15, in
// (token, choice) pairs routed to each logical expert. Invalid ids are not
// counted; entries beyond counts.size() are ignored. Pure.
// Example: ids [[0, 2], [2, -1]], 3 experts -> counts += {1, 0, 2}.
void CountExpertTokens(absl::Span<const int32_t> topk_ids, int num_experts,
                       absl::Span<int64_t> counts);

}  // namespace moe_ep::core
