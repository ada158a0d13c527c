#pragma once

// How the one-sided GPU data plane (server/onesided_data_plane.h) serves a
// placement table and a rank mask (DESIGN §15; issue 17 item 5) with a
// dispatcher that routes by the contiguous placement only
// (kernels/onesided/onesided_dispatcher.h): on the host, each (token, logical
// expert) choice is mapped to the replica core::PlacementTable::ChooseReplica
// picks (the CPU reference's choice, bit for bit), and that replica to a
// "dispatch id" in a numbering where the live ranks' experts are contiguous:
//
//   live rank c (c-th live rank in rank order) holds dispatch ids
//   [base_c, base_c + D_c), D_c = its distinct slot experts, which must be one
//   range of logical ids [first_c, first_c + D_c) (as the NCCL GPU plane
//   needs), and the D_c must be the DESIGN §7 split of V = sum D_c over the
//   live ranks, so the dispatcher's ExpertPlacement::Contiguous(V, live) is
//   exactly this numbering. The logical expert e on rank c is dispatch id
//   base_c + (e - first_c).
//
// Choices of an expert with no live replica become the invalid id -1 with
// weight 0: they are sent nowhere and contribute zero, and are reported
// (lost_choices, lost_experts). Pure host code, no CUDA. Thread-safe (no
// shared state). Source: DESIGN §7, §13, §15; issue 17.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/placement_table.h"

namespace moe_ep::server {

struct OneSidedRouteMap {
  uint64_t table_fingerprint = 0;  // of the table (mask included) it was made for
  std::vector<int> live_ranks;     // [live]: original rank of each dispatcher rank
  std::vector<int> dispatch_rank;  // [R]: dispatcher rank of each rank, -1 when masked
  std::vector<int> first_expert;   // [R]: first logical id of each rank's distinct experts
  std::vector<int> dispatch_base;  // [R]: its first dispatch id, -1 when masked
  std::vector<int> num_local;      // [R]: D_r, its distinct slot experts
  int num_dispatch_experts = 0;    // V: the dispatcher's num_experts
  int ep_size() const { return static_cast<int>(live_ranks.size()); }
};

// MakeOneSidedRouteMap()
//
// The numbering above for `table` (under its mask, PlacementTable::WithMask).
// Errors: kFailedPrecondition naming the rank when a live rank's distinct
// slot experts are not one range of ids, or the live ranks' counts are not
// the §7 split of their sum (e.g. {2, 3}: the dispatcher would place 3 on
// the first); the message says to join with gpu_data_plane "nccl".
// Example: FromSlotExperts(4, {{0, 1}, {2, 3}, {1, 2}}) with rank 1 masked
// -> live_ranks {0, 2}, dispatch_base {0, -1, 2}, first_expert {0, 2, 1},
// V = 4; expert 2 on rank 2 is dispatch id 2 + (2 - 1) = 3.
absl::StatusOr<OneSidedRouteMap> MakeOneSidedRouteMap(const core::PlacementTable& table);

struct OneSidedChoices {
  std::vector<int32_t> ids;       // [T, K] dispatch ids (-1: invalid or lost)
  std::vector<float> weights;     // [T, K]: the request's, 0 for a lost choice
  int64_t lost_choices = 0;       // choices of experts with no live replica
  std::vector<int> lost_experts;  // their logical ids, ascending, distinct
};

// MapOneSidedChoices()
//
// The dispatch ids of `source_rank`'s choices `topk_ids` / `topk_weights`
// ([T, K] flat, T = num_tokens) under `table` and its `map`: an id outside
// [0, E) stays invalid (-1, its weight kept); a lost expert's choice is -1
// with weight 0; any other goes to ChooseReplica(source_rank, t, id).
// REQUIRES: map made from table; sizes num_tokens * top_k; source_rank live.
OneSidedChoices MapOneSidedChoices(const core::PlacementTable& table, const OneSidedRouteMap& map,
                                   int source_rank, absl::Span<const int32_t> topk_ids,
                                   absl::Span<const float> topk_weights, int64_t num_tokens,
                                   int top_k);

}  // namespace moe_ep::server
