#pragma once

// Rebalancing a running group from its load statistics (DESIGN §15; issue 17
// item 4): the workers' GetExpertLoad counts summed over ranks, a new table
// from core::RebalanceHierarchical (DeepSeek's EPLB) with the slot budget the
// workspace was allocated with, and the load table `moe-ep run` prints
// before and after. Pure functions; thread-safe.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/placement_table.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::client {

// SumExpertLoad()
//
// [num_experts] tokens per logical expert of the group: the sum over the
// ranks' responses. Errors: kInvalidArgument when a response does not have
// num_experts counts (names the rank and both sizes).
// Example: ranks {1, 0, 2} and {0, 3, 1} -> {1, 3, 3}.
absl::StatusOr<std::vector<double>> SumExpertLoad(
    const std::vector<v1::GetExpertLoadResponse>& per_rank, int num_experts);

// RebalanceForBudget()
//
// The EPLB table for `tokens_per_expert` on `world` ranks with
// ceil(E / world) + redundant_slots_per_rank slots on every rank
// (core::RebalanceHierarchical, one expert group, one node). Errors: those
// of core::RebalanceHierarchical (kInvalidArgument).
// Example: E 10, world 4, 1 redundant -> 4 slots a rank, 16 slots.
absl::StatusOr<core::PlacementTable> RebalanceForBudget(
    const std::vector<double>& tokens_per_expert, int world, int redundant_slots_per_rank);

// One layer's balance: tokens per rank (core::RankLoads: an expert's tokens
// split evenly over its replicas) as max and mean over ranks.
struct RankBalance {
  double max_tokens = 0;
  double mean_tokens = 0;
  // max / mean; 0 when no token was routed.
  double ratio() const { return mean_tokens > 0 ? max_tokens / mean_tokens : 0.0; }
};

// BalanceOf()
//
// The RankBalance of `tokens_per_expert` under `table`. Errors: those of
// core::RankLoads. Example: tokens {6, 2, 4}, slots {0, 1} and {0, 2} ->
// loads {5, 7}: max 7, mean 6.
absl::StatusOr<RankBalance> BalanceOf(const core::PlacementTable& table,
                                      const std::vector<double>& tokens_per_expert);

struct LayerRebalance {
  int layer = 0;
  RankBalance before;     // steps before rebalancing, contiguous table
  RankBalance predicted;  // the same counts under the new table
  RankBalance after;      // steps after rebalancing, new table (0s: none ran)
  int slots_per_rank = 0;
  int redundant_slots_per_rank = 0;
  uint64_t fingerprint = 0;                    // of the new table
  std::vector<std::vector<int>> slot_experts;  // the new table, [world][slots]
};

// The load table: per layer, max/mean tokens per rank before (contiguous),
// predicted and after (the EPLB table), and the table's shape.
std::string RenderLoadTable(const std::vector<LayerRebalance>& layers);

}  // namespace moe_ep::client
