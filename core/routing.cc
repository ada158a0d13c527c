#include "core/routing.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"

namespace moe_ep::core {

absl::StatusOr<DispatchRoute> ComputeDispatchRoute(absl::Span<const int32_t> topk_ids,
                                                   int64_t num_tokens, int top_k,
                                                   const ExpertPlacement& placement) {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_tokens: expected >= 0, got %d", num_tokens));
  }
  if (top_k < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("top_k: expected >= 1, got %d", top_k));
  }
  if (num_tokens > std::numeric_limits<int64_t>::max() / top_k ||
      static_cast<int64_t>(topk_ids.size()) != num_tokens * top_k) {
    return absl::InvalidArgumentError(
        absl::StrFormat("topk_ids: expected num_tokens * top_k = %d * %d elements, got %d",
                        num_tokens, top_k, topk_ids.size()));
  }

  const int ep_size = placement.ep_size();
  DispatchRoute route;
  route.num_tokens = num_tokens;
  route.top_k = top_k;
  route.send_counts.assign(ep_size, 0);
  route.tokens_for_rank.assign(ep_size, {});
  route.token_offsets.reserve(num_tokens + 1);
  route.token_offsets.push_back(0);

  std::vector<int32_t> ranks;  // distinct destination ranks of one token
  ranks.reserve(top_k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    ranks.clear();
    for (int k = 0; k < top_k; ++k) {
      const int32_t id = topk_ids[t * top_k + k];
      // Invalid ids are the caller's padding: they select no rank at all.
      if (!placement.IsValid(id)) continue;
      ranks.push_back(placement.RankOf(id));
    }
    std::sort(ranks.begin(), ranks.end());
    ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
    // Tokens are visited in increasing order, so each destination's slots fill
    // in increasing source-token order.
    for (int32_t d : ranks) {
      route.dest_rank.push_back(d);
      route.dest_slot.push_back(route.send_counts[d]);
      route.tokens_for_rank[d].push_back(t);
      ++route.send_counts[d];
    }
    route.token_offsets.push_back(static_cast<int64_t>(route.dest_rank.size()));
  }
  return route;
}

}  // namespace moe_ep::core
