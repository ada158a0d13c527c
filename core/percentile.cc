#include "core/percentile.h"

#include <algorithm>
#include <cmath>
#include <cstddef>

namespace moe_ep::core {

double Percentile(absl::Span<const double> sorted, double p) {
  if (sorted.empty()) return 0.0;
  auto rank = static_cast<size_t>(std::ceil(p / 100.0 * static_cast<double>(sorted.size())));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

LatencySummary Summarize(std::vector<double>& samples_us) {
  std::sort(samples_us.begin(), samples_us.end());
  return LatencySummary{Percentile(samples_us, 50), Percentile(samples_us, 99)};
}

}  // namespace moe_ep::core
