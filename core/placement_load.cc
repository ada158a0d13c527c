#include "core/placement_load.h"

#include <algorithm>
#include <cmath>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace moe_ep::core {

absl::StatusOr<std::vector<double>> RankLoads(const PlacementTable& table,
                                              absl::Span<const double> tokens_per_expert) {
  if (static_cast<int64_t>(tokens_per_expert.size()) != table.num_experts()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tokens_per_expert: expected %d entries (one per logical expert), got %d",
                        table.num_experts(), tokens_per_expert.size()));
  }
  for (int e = 0; e < table.num_experts(); ++e) {
    const double t = tokens_per_expert[e];
    if (!std::isfinite(t) || t < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tokens_per_expert[%d]: expected a finite count >= 0, got %g", e, t));
    }
  }
  std::vector<double> loads(table.ep_size(), 0.0);
  for (int r = 0; r < table.ep_size(); ++r) {
    for (int e : table.SlotExperts(r)) {
      loads[r] += tokens_per_expert[e] / static_cast<double>(table.Replicas(e).size());
    }
  }
  return loads;
}

absl::StatusOr<double> MaxOverMean(absl::Span<const double> loads) {
  if (loads.empty()) return absl::InvalidArgumentError("loads: expected >= 1 rank, got none");
  double sum = 0;
  double max = 0;
  for (size_t r = 0; r < loads.size(); ++r) {
    if (!std::isfinite(loads[r]) || loads[r] < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("loads[%d]: expected a finite load >= 0, got %g", r, loads[r]));
    }
    sum += loads[r];
    max = std::max(max, loads[r]);
  }
  if (sum <= 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "loads: all %d ranks have load 0; max/mean is undefined without load", loads.size()));
  }
  return max / (sum / static_cast<double>(loads.size()));
}

}  // namespace moe_ep::core
