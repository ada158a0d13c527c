#include "server/onesided_route_map.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/expert_source.h"

namespace moe_ep::server {

absl::StatusOr<OneSidedRouteMap> MakeOneSidedRouteMap(const core::PlacementTable& table) {
  const int world = table.ep_size();
  OneSidedRouteMap map;
  map.table_fingerprint = table.Fingerprint();
  map.dispatch_rank.assign(world, -1);
  map.first_expert.assign(world, 0);
  map.dispatch_base.assign(world, -1);
  map.num_local.assign(world, 0);
  for (int r = 0; r < world; ++r) {
    const std::vector<int> distinct = core::DistinctSlotExperts(table, r);
    if (distinct.empty()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the one-sided data plane needs every rank to hold an expert; rank ", r,
                       " holds none in the placement table"));
    }
    map.first_expert[r] = distinct.front();
    map.num_local[r] = static_cast<int>(distinct.size());
    if (distinct.back() - distinct.front() + 1 != map.num_local[r]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the one-sided data plane needs each rank's distinct slot experts to be one range of "
          "ids; rank ",
          r, " holds ", core::DescribeExpertIds(distinct),
          "; install a table whose ranks hold ranges, or join with gpu_data_plane \"nccl\""));
    }
    if (!table.IsLive(r)) continue;
    map.dispatch_rank[r] = map.ep_size();
    map.dispatch_base[r] = map.num_dispatch_experts;
    map.live_ranks.push_back(r);
    map.num_dispatch_experts += map.num_local[r];
  }
  absl::StatusOr<core::ExpertPlacement> split =
      core::ExpertPlacement::Contiguous(map.num_dispatch_experts, map.ep_size());
  if (!split.ok()) return absl::FailedPreconditionError(split.status().message());
  for (int c = 0; c < map.ep_size(); ++c) {
    const int r = map.live_ranks[c];
    if (split->NumLocalExperts(c) != map.num_local[r]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the one-sided data plane places the live ranks' experts contiguously (",
          map.num_dispatch_experts, " on ", map.ep_size(),
          " live ranks: ", split->NumLocalExperts(c), " on live rank ", r, "), but rank ", r,
          " holds ", map.num_local[r],
          " distinct experts; install a table with as many distinct experts on every rank, or "
          "join with gpu_data_plane \"nccl\""));
    }
  }
  return map;
}

OneSidedChoices MapOneSidedChoices(const core::PlacementTable& table, const OneSidedRouteMap& map,
                                   int source_rank, absl::Span<const int32_t> topk_ids,
                                   absl::Span<const float> topk_weights, int64_t num_tokens,
                                   int top_k) {
  OneSidedChoices out;
  const int64_t n = num_tokens * top_k;
  out.ids.assign(n, -1);
  out.weights.assign(topk_weights.begin(), topk_weights.begin() + n);
  for (int64_t i = 0; i < n; ++i) {
    const int32_t id = topk_ids[i];
    if (id < 0 || id >= table.num_experts()) continue;
    if (table.LiveReplicas(id).empty()) {
      out.weights[i] = 0.0f;
      ++out.lost_choices;
      auto at = std::lower_bound(out.lost_experts.begin(), out.lost_experts.end(), id);
      if (at == out.lost_experts.end() || *at != id) out.lost_experts.insert(at, id);
      continue;
    }
    const core::ReplicaSlot replica = table.ChooseReplica(source_rank, i / top_k, id);
    out.ids[i] = map.dispatch_base[replica.rank] + (id - map.first_expert[replica.rank]);
  }
  return out;
}

}  // namespace moe_ep::server
