#pragma once

// How the one-sided GPU data plane (server/onesided_data_plane.h) serves any
// placement table and a rank mask (DESIGN §15, §17; issue 17 item 5, issue
// 34 item 2) with a dispatcher that routes by the contiguous placement only
// (kernels/onesided/onesided_dispatcher.h): on the host, each (token,
// logical expert) choice is mapped to the replica
// core::PlacementTable::ChooseReplica picks (the CPU reference's choice, bit
// for bit), and that replica to a "dispatch id" that names a (rank, local
// slot) pair in a numbering where the live ranks' slots are contiguous.
//
// Slots: rank r's local slot s holds the s-th of its distinct slot experts
// (core::DistinctSlotExperts, ascending; any set of logical ids, D_r of
// them), which is how its device expert set is laid out
// (kernels/device_experts.h). Live rank c (c-th live rank in rank order)
// owns dispatch ids [base_c, base_c + D_c): slot s is dispatch id base_c + s.
// The bases make the dispatcher's ExpertPlacement::Contiguous(V, live) give
// every live rank those ids:
//   - when the D_c are the DESIGN §7 split of their sum, base_c = D_0 + .. +
//     D_{c-1} and V = the sum (the contiguous table maps every id to
//     itself);
//   - otherwise every live rank gets M = max D_c ids, base_c = c * M and
//     V = M * live; ids base_c + D_c .. base_c + M - 1 name no slot and no
//     choice is mapped to them.
// So any table works; nothing about which logical ids a rank holds matters.
//
// Choices of an expert with no live replica become the invalid id -1 with
// weight 0: they are sent nowhere and contribute zero, and are reported
// (lost_choices, lost_experts). Pure host code, no CUDA. Thread-safe (no
// shared state). Source: DESIGN §7, §13, §15, §17; issues 17, 34.

#include <cstdint>
#include <vector>

#include "absl/types/span.h"
#include "core/placement_table.h"

namespace moe_ep::server {

struct OneSidedRouteMap {
  uint64_t table_fingerprint = 0;  // of the table (mask included) it was made for
  int num_experts = 0;             // E: logical experts of the table
  std::vector<int> live_ranks;     // [live]: original rank of each dispatcher rank
  std::vector<int> dispatch_rank;  // [R]: dispatcher rank of each rank, -1 when masked
  std::vector<int> dispatch_base;  // [R]: dispatch id of its slot 0, -1 when masked
  std::vector<int> num_local;      // [R]: D_r, its distinct slot experts (local slots)
  // [R * E]: local slot of logical expert e on rank r at r * E + e (its
  // position in core::DistinctSlotExperts(table, r)), -1 when r holds none.
  std::vector<int32_t> local_slot;
  int num_dispatch_experts = 0;  // V: the dispatcher's num_experts
  int ep_size() const { return static_cast<int>(live_ranks.size()); }
};

// MakeOneSidedRouteMap()
//
// The numbering above for `table` (under its mask, PlacementTable::WithMask).
// Every table is served (no error: every rank of a table holds a slot).
// Example: FromSlotExperts(4, {{0, 1}, {2, 3}, {1, 2}}) with rank 1 masked
// -> live_ranks {0, 2}, D = {2, 2} (the split of 4 on 2), dispatch_base
// {0, -1, 2}, V = 4; expert 2 on rank 2 is slot 1, dispatch id 2 + 1 = 3.
// FromSlotExperts(3, {{0, 0}, {1, 2}}): D = {1, 2}, not the split of 3 on 2
// ({2, 1}), so M = 2, dispatch_base {0, 2}, V = 4; experts 0, 1, 2 are
// dispatch ids 0, 2, 3 (id 1 names no slot).
OneSidedRouteMap MakeOneSidedRouteMap(const core::PlacementTable& table);

// OneSidedSlotIds()
//
// The dispatch ids of `rank`'s slots, [D_r]: base + 0 .. base + D_r - 1, what
// its device expert set answers to (kernels::DeviceExpertSet::Renumber).
// REQUIRES: 0 <= rank < R and rank live (dispatch_base >= 0).
std::vector<int> OneSidedSlotIds(const OneSidedRouteMap& map, int rank);

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
// with weight 0; any other goes to replica (r, s) = ChooseReplica(
// source_rank, t, id), dispatch id dispatch_base[r] + local_slot[r * E + id].
// REQUIRES: map made from table; sizes num_tokens * top_k; source_rank live.
OneSidedChoices MapOneSidedChoices(const core::PlacementTable& table, const OneSidedRouteMap& map,
                                   int source_rank, absl::Span<const int32_t> topk_ids,
                                   absl::Span<const float> topk_weights, int64_t num_tokens,
                                   int top_k);

}  // namespace moe_ep::server
