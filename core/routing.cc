#include "core/routing.h"

#include <algorithm>
#include <limits>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace moe_ep::core {

namespace {

absl::Status CheckRouteInput(absl::Span<const int32_t> topk_ids, int64_t num_tokens, int top_k) {
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
  return absl::OkStatus();
}

// The route with `rank_of(t, id)` giving the destination rank of valid
// choice id of token t, or -1 for an id that selects no rank.
template <typename RankOf>
DispatchRoute BuildRoute(absl::Span<const int32_t> topk_ids, int64_t num_tokens, int top_k,
                         int ep_size, const RankOf& rank_of) {
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
      // Invalid ids are the caller's padding: they select no rank at all.
      const int r = rank_of(t, topk_ids[t * top_k + k]);
      if (r >= 0) ranks.push_back(r);
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

}  // namespace

absl::StatusOr<DispatchRoute> ComputeDispatchRoute(absl::Span<const int32_t> topk_ids,
                                                   int64_t num_tokens, int top_k,
                                                   const ExpertPlacement& placement) {
  RETURN_IF_ERROR(CheckRouteInput(topk_ids, num_tokens, top_k));
  return BuildRoute(
      topk_ids, num_tokens, top_k, placement.ep_size(),
      [&](int64_t /*t*/, int32_t id) { return placement.IsValid(id) ? placement.RankOf(id) : -1; });
}

absl::StatusOr<DispatchRoute> ComputeDispatchRoute(absl::Span<const int32_t> topk_ids,
                                                   int64_t num_tokens, int top_k,
                                                   const PlacementTable& table, int source_rank) {
  RETURN_IF_ERROR(CheckRouteInput(topk_ids, num_tokens, top_k));
  if (source_rank < 0 || source_rank >= table.ep_size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("source_rank: expected in [0, %d), got %d", table.ep_size(), source_rank));
  }
  const int num_experts = table.num_experts();
  return BuildRoute(topk_ids, num_tokens, top_k, table.ep_size(), [&](int64_t t, int32_t id) {
    // A lost expert (no live replica under a rank mask) selects no rank.
    return id >= 0 && id < num_experts && !table.LiveReplicas(id).empty()
               ? table.ChooseReplica(source_rank, t, id).rank
               : -1;
  });
}

int32_t PayloadExpertId(const PlacementTable& table, int source_rank, int64_t source_token_idx,
                        int32_t expert_id, int dest_rank, int32_t invalid_expert_id) {
  if (expert_id < 0 || expert_id >= table.num_experts()) return expert_id;
  const size_t live = table.LiveReplicas(expert_id).size();
  if (live == 0) return invalid_expert_id;  // lost under a rank mask: nobody computes it
  if (live == 1) return expert_id;
  return table.ChooseReplica(source_rank, source_token_idx, expert_id).rank == dest_rank
             ? expert_id
             : invalid_expert_id;
}

absl::Status ValidateExpertIds(absl::Span<const int32_t> topk_ids, int top_k, int num_experts,
                               int32_t invalid_expert_id) {
  if (top_k < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("top_k: expected >= 1, got %d", top_k));
  }
  int64_t bad = 0;
  int64_t first = -1;
  for (int64_t i = 0; i < static_cast<int64_t>(topk_ids.size()); ++i) {
    const int32_t id = topk_ids[i];
    if ((id >= 0 && id < num_experts) || id == invalid_expert_id) continue;
    if (bad++ == 0) first = i;
  }
  if (bad == 0) return absl::OkStatus();
  const int64_t rows = static_cast<int64_t>(topk_ids.size()) / top_k;
  return ExpertIdError(
      first, top_k, topk_ids[first], num_experts, invalid_expert_id,
      absl::StrFormat("%d id%s out of range in %d rows; only the configured invalid id marks "
                      "padding",
                      bad, bad == 1 ? "" : "s", rows));
}

absl::Status ExpertIdError(int64_t index, int top_k, int32_t id, int num_experts,
                           int32_t invalid_expert_id, std::string_view detail) {
  const int k = top_k > 0 ? top_k : 1;
  return absl::InvalidArgumentError(absl::StrFormat(
      "topk_ids[row %d, choice %d] = %d: outside [0, %d) and not the invalid expert id %d (%s)",
      index / k, index % k, id, num_experts, invalid_expert_id, detail));
}

void CountExpertTokens(absl::Span<const int32_t> topk_ids, int num_experts,
                       absl::Span<int64_t> counts) {
  for (int32_t id : topk_ids) {
    if (id >= 0 && id < num_experts && id < static_cast<int64_t>(counts.size())) ++counts[id];
  }
}

}  // namespace moe_ep::core
