#pragma once

// Tokens per rank under a placement table, and the balance figure EPLB
// minimises (DESIGN §15): max over ranks of the rank's tokens, divided by the
// mean over ranks.
//
// Load model: each logical expert's tokens are split evenly over its replicas
// (what PlacementTable::ChooseReplica's round-robin gives over many tokens),
// and a rank's load is the sum over its slots. Source: DeepSeek EPLB
// (deepseek-ai/EPLB README), SGLang's EPLB statistics; issue 17.

#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/placement_table.h"

namespace moe_ep::core {

// RankLoads()
//
// Returns [ep_size] tokens per rank: for each slot of rank r holding expert
// e, tokens_per_expert[e] / table.Replicas(e).size(). Units are those of
// `tokens_per_expert` (tokens; counts may be fractional averages).
//
// Errors: kInvalidArgument when tokens_per_expert.size() != num_experts, or
// an entry is negative or not finite (names the expert and value).
// Pure and thread-safe.
// Example: tokens {6, 2, 4}; slots rank 0 {0, 1}, rank 1 {0, 2} (expert 0 has
// two replicas) -> {6/2 + 2, 6/2 + 4} = {5, 7}.
absl::StatusOr<std::vector<double>> RankLoads(const PlacementTable& table,
                                              absl::Span<const double> tokens_per_expert);

// MaxOverMean()
//
// Returns max(loads) / mean(loads): 1 is perfect balance, ep_size is all load
// on one rank.
//
// Errors: kInvalidArgument when `loads` is empty, has a negative or
// non-finite entry, or sums to 0 (no load: the ratio is undefined).
// Example: {3, 1} -> 1.5. Pure and thread-safe.
absl::StatusOr<double> MaxOverMean(absl::Span<const double> loads);

}  // namespace moe_ep::core
