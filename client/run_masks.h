#pragma once

// The rank-mask demonstration of `moe-ep run` (DESIGN §15; issue 17 item 4):
// --kill-rank R --kill-at-step S [--restart-at-step S2]. A placement whose
// redundant slots hold replicas of the next ranks' experts, so a killed
// rank's experts partly survive, and the reference's view of a mask: the
// experts left with no live replica contribute zero.
// Thread-compatible. Source: DESIGN §15; issue 17 items 3-4.

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/placement_table.h"

namespace moe_ep::client {

// RingReplicaTable()
//
// `num_experts` experts on `world` ranks, each with ceil(E / W) +
// `redundant_slots_per_rank` slots: rank r holds its contiguous experts
// (DESIGN §7) first, then replicas of the experts of ranks r + 1, r + 2, ...
// (mod W), in order, none twice on a rank. With E = 8, W = 4 and one
// redundant slot: rank 0 holds 0 1 2, rank 1 2 3 4, rank 2 4 5 6, rank 3
// 6 7 0. Errors: kInvalidArgument (E < W, W < 1, redundant < 0, or more
// slots a rank than distinct experts).
absl::StatusOr<core::PlacementTable> RingReplicaTable(int num_experts, int world,
                                                      int redundant_slots_per_rank);

// LostExperts()
//
// The experts of `table` with no replica on a rank `live` marks live
// ([ep_size]), ascending.
std::vector<int> LostExperts(const core::PlacementTable& table, const std::vector<bool>& live);

// DropLostChoices()
//
// Replaces every id of `ids` that is in `lost` (ascending) by -1, the
// invalid id that contributes nothing: what the workers do for an expert
// with no live replica. Returns how many choices it replaced.
int64_t DropLostChoices(const std::vector<int>& lost, absl::Span<int32_t> ids);

}  // namespace moe_ep::client
