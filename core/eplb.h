#pragma once

// Expert-parallel load balancing (DESIGN §15): from tokens per logical expert
// (one MoE layer's load statistics) and a physical slot budget, a placement
// table with redundant replicas of the hottest experts, packed onto ranks so
// every rank holds the same number of slots and about the same load.
//
// RebalanceHierarchical() is the published hierarchical EPLB algorithm of
// DeepSeek (deepseek-ai/EPLB, eplb.py `rebalance_experts`), written from its
// description:
//   1. Groups to nodes. Logical experts form num_groups consecutive groups
//      (DeepSeek-V3's n_group); the groups are packed onto num_nodes nodes by
//      balanced packing of their summed load, num_groups / num_nodes groups a
//      node, so experts of one group stay on one node.
//   2. Replicas within a node. Each node's num_experts / num_nodes experts get
//      num_slots / num_nodes slots: every expert one, and each further slot
//      goes to the expert with the largest load per replica (its load divided
//      by its current replica count).
//   3. Replicas to ranks. Each node's replicas, weighted by load per replica,
//      are packed onto its ep_size / num_nodes ranks by balanced packing, one
//      replica a slot.
// Balanced packing: items in descending weight order, each to the pack with
// the smallest summed weight among those not yet full (every pack takes
// items / packs); an item's slot on its pack is its arrival order.
// Tie-breaks, made explicit so results are reproducible: equal weights keep
// ascending item order (a stable sort), equal pack weights take the lowest
// pack, equal loads per replica take the lowest expert id. Arithmetic is in
// double. As published, when num_nodes does not divide num_groups the
// algorithm runs globally (one group, one node).
//
// RebalanceGreedy() is a plain greedy for comparison: the replication of step
// 2 over all experts at once, then replicas in descending load-per-replica
// order, each to the least-loaded rank with a free slot that does not hold a
// replica of the same expert yet (any rank with a free slot when all such
// ranks hold one), so replicas of an expert land on distinct ranks where
// possible.
//
// Both functions are pure (equal inputs give equal tables on every rank) and
// thread-safe; cost O(S * (E + S)) for S slots and E experts (288 x 256:
// well under a millisecond).
// Source: deepseek-ai/EPLB README and eplb.py (MIT); DESIGN §15; issue 17.

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/placement_table.h"

namespace moe_ep::core {

struct EplbOptions {
  // Physical slots over all ranks (EPLB's num_replicas): a multiple of
  // ep_size, >= the number of logical experts. 288 for DeepSeek-V3's 256
  // experts with 32 redundant slots.
  int num_slots = 0;
  // EP ranks (EPLB's num_gpus).
  int ep_size = 0;
  // Expert groups: consecutive blocks of num_experts / num_groups experts.
  int num_groups = 1;
  // Nodes: consecutive blocks of ep_size / num_nodes ranks.
  int num_nodes = 1;
};

// RebalanceHierarchical()
//
// Returns a table with options.num_slots / options.ep_size slots on every
// rank for the load `tokens_per_expert` ([E] tokens per logical expert,
// E = tokens_per_expert.size()), built as the file comment describes.
//
// Errors (kInvalidArgument; messages name the option, expected and got):
//   E < 1; an entry negative or not finite (names the expert);
//   ep_size, num_groups or num_nodes < 1;
//   num_slots < E, or not a multiple of ep_size;
//   (when num_nodes divides num_groups) E not a multiple of num_groups, or
//   ep_size not a multiple of num_nodes.
// Example (the deepseek-ai/EPLB README, layer 0): load
// {90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86}, 16 slots, 4 groups,
// 2 nodes, 8 ranks -> PhysicalToLogical()
// {5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1}.
absl::StatusOr<PlacementTable> RebalanceHierarchical(absl::Span<const double> tokens_per_expert,
                                                     const EplbOptions& options);

// RebalanceGreedy()
//
// Returns a table with num_slots / ep_size slots on every rank, built by the
// plain greedy of the file comment.
//
// Errors: as RebalanceHierarchical() for E, the entries, ep_size and
// num_slots.
absl::StatusOr<PlacementTable> RebalanceGreedy(absl::Span<const double> tokens_per_expert,
                                               int num_slots, int ep_size);

}  // namespace moe_ep::core
