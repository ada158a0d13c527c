#include "server/onesided_route_map.h"

#include <algorithm>

#include "core/expert_source.h"

namespace moe_ep::server {

OneSidedRouteMap MakeOneSidedRouteMap(const core::PlacementTable& table) {
  const int world = table.ep_size();
  const int num_experts = table.num_experts();
  OneSidedRouteMap map;
  map.table_fingerprint = table.Fingerprint();
  map.num_experts = num_experts;
  map.dispatch_rank.assign(world, -1);
  map.dispatch_base.assign(world, -1);
  map.num_local.assign(world, 0);
  map.local_slot.assign(static_cast<size_t>(world) * num_experts, -1);
  for (int r = 0; r < world; ++r) {
    const std::vector<int> distinct = core::DistinctSlotExperts(table, r);
    map.num_local[r] = static_cast<int>(distinct.size());
    for (int s = 0; s < map.num_local[r]; ++s) {
      map.local_slot[static_cast<size_t>(r) * num_experts + distinct[s]] = s;
    }
    if (!table.IsLive(r)) continue;
    map.dispatch_rank[r] = map.ep_size();
    map.live_ranks.push_back(r);
  }
  // The DESIGN §7 split of the live ranks' sum: the first (sum % live) take
  // sum / live + 1, the rest sum / live.
  const int live = map.ep_size();
  int sum = 0;
  int widest = 0;
  for (int r : map.live_ranks) {
    sum += map.num_local[r];
    widest = std::max(widest, map.num_local[r]);
  }
  bool is_split = true;
  for (int c = 0; c < live; ++c) {
    const int want = sum / live + (c < sum % live ? 1 : 0);
    is_split = is_split && map.num_local[map.live_ranks[c]] == want;
  }
  int base = 0;
  for (int c = 0; c < live; ++c) {
    const int r = map.live_ranks[c];
    map.dispatch_base[r] = base;
    base += is_split ? map.num_local[r] : widest;
  }
  map.num_dispatch_experts = base;
  return map;
}

std::vector<int> OneSidedSlotIds(const OneSidedRouteMap& map, int rank) {
  std::vector<int> ids(map.num_local[rank]);
  for (int s = 0; s < map.num_local[rank]; ++s) ids[s] = map.dispatch_base[rank] + s;
  return ids;
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
    out.ids[i] = map.dispatch_base[replica.rank] +
                 map.local_slot[static_cast<size_t>(replica.rank) * map.num_experts + id];
  }
  return out;
}

}  // namespace moe_ep::server
