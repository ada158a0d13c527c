#include "client/expert_rebalance.h"

#include <algorithm>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "client/text_table.h"
#include "core/eplb.h"
#include "core/placement_load.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<std::vector<double>> SumExpertLoad(
    const std::vector<v1::GetExpertLoadResponse>& per_rank, int num_experts) {
  std::vector<double> sum(std::max(num_experts, 0), 0.0);
  for (size_t r = 0; r < per_rank.size(); ++r) {
    if (per_rank[r].tokens_per_expert_size() != num_experts) {
      return absl::InvalidArgumentError(absl::StrCat("GetExpertLoad: rank ", r, " reports ",
                                                     per_rank[r].tokens_per_expert_size(),
                                                     " experts, expected ", num_experts));
    }
    for (int e = 0; e < num_experts; ++e) {
      sum[e] += static_cast<double>(per_rank[r].tokens_per_expert(e));
    }
  }
  return sum;
}

absl::StatusOr<core::PlacementTable> RebalanceForBudget(
    const std::vector<double>& tokens_per_expert, int world, int redundant_slots_per_rank) {
  const int num_experts = static_cast<int>(tokens_per_expert.size());
  core::EplbOptions options;
  options.ep_size = world;
  options.num_slots =
      world > 0 ? world * ((num_experts + world - 1) / world + redundant_slots_per_rank) : 0;
  return core::RebalanceHierarchical(tokens_per_expert, options);
}

absl::StatusOr<RankBalance> BalanceOf(const core::PlacementTable& table,
                                      const std::vector<double>& tokens_per_expert) {
  ASSIGN_OR_RETURN(std::vector<double> loads, core::RankLoads(table, tokens_per_expert));
  RankBalance b;
  if (loads.empty()) return b;
  b.max_tokens = *std::max_element(loads.begin(), loads.end());
  b.mean_tokens = std::accumulate(loads.begin(), loads.end(), 0.0) / loads.size();
  return b;
}

namespace {

std::string Cell(const RankBalance& b) {
  if (b.mean_tokens <= 0) return "-";
  return absl::StrFormat("%.4f (%.0f / %.1f)", b.ratio(), b.max_tokens, b.mean_tokens);
}

}  // namespace

std::string RenderLoadTable(const std::vector<LayerRebalance>& layers) {
  TextTable table(
      {"layer", "before: contiguous", "predicted: EPLB", "after: EPLB", "slots/rank", "table"});
  for (const LayerRebalance& l : layers) {
    table.AddRow({absl::StrCat(l.layer), Cell(l.before), Cell(l.predicted), Cell(l.after),
                  absl::StrCat(l.slots_per_rank, " (", l.redundant_slots_per_rank, " redundant)"),
                  absl::StrFormat("%016x", l.fingerprint)});
  }
  return absl::StrCat(
      "load per rank, max/mean tokens (max / mean) of (token, choice) pairs routed:\n",
      table.Render());
}

}  // namespace moe_ep::client
