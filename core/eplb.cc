#include "core/eplb.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

// Where balanced packing put one item: its pack and its position in the pack.
struct Packed {
  int pack = 0;
  int position = 0;
};

// Items in descending weight order (stable: equal weights in ascending item
// order), each to the lightest pack that is not full (lowest pack on a tie);
// every pack takes weights.size() / num_packs items.
// REQUIRES: num_packs >= 1 divides weights.size().
std::vector<Packed> BalancedPacking(const std::vector<double>& weights, int num_packs) {
  const int n = static_cast<int>(weights.size());
  const int per_pack = n / num_packs;
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return weights[a] > weights[b]; });
  std::vector<double> pack_weight(num_packs, 0.0);
  std::vector<int> pack_items(num_packs, 0);
  std::vector<Packed> out(n);
  for (int item : order) {
    int best = -1;
    for (int p = 0; p < num_packs; ++p) {
      if (pack_items[p] < per_pack && (best < 0 || pack_weight[p] < pack_weight[best])) best = p;
    }
    out[item] = Packed{best, pack_items[best]};
    pack_weight[best] += weights[item];
    ++pack_items[best];
  }
  return out;
}

// Replication: physical replica p < weights.size() is logical expert p; each
// further replica goes to the expert with the largest weight per replica
// (lowest id on a tie). Returns the logical expert of each of the
// `num_replicas` replicas, and fills `replica_count` ([weights.size()]).
// REQUIRES: num_replicas >= weights.size().
std::vector<int> Replicate(const std::vector<double>& weights, int num_replicas,
                           std::vector<int>* replica_count) {
  const int n = static_cast<int>(weights.size());
  std::vector<int> logical(n);
  std::iota(logical.begin(), logical.end(), 0);
  replica_count->assign(n, 1);
  for (int p = n; p < num_replicas; ++p) {
    int best = 0;
    for (int e = 1; e < n; ++e) {
      if (weights[e] / (*replica_count)[e] > weights[best] / (*replica_count)[best]) best = e;
    }
    logical.push_back(best);
    ++(*replica_count)[best];
  }
  return logical;
}

absl::Status ValidateLoad(absl::Span<const double> tokens_per_expert, int num_slots, int ep_size) {
  const int64_t num_experts = static_cast<int64_t>(tokens_per_expert.size());
  if (num_experts < 1) {
    return absl::InvalidArgumentError(
        "tokens_per_expert: expected one count per logical expert, got none");
  }
  for (int64_t e = 0; e < num_experts; ++e) {
    const double t = tokens_per_expert[e];
    if (!std::isfinite(t) || t < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("tokens_per_expert[%d]: expected a finite count >= 0, got %g", e, t));
    }
  }
  if (ep_size < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("ep_size: expected >= 1, got %d", ep_size));
  }
  if (num_slots < num_experts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_slots: expected >= the number of logical experts (%d) so that every "
                        "expert has a replica, got %d",
                        num_experts, num_slots));
  }
  if (num_slots % ep_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_slots: expected a multiple of ep_size (%d) so that every rank holds "
                        "the same number of slots, got %d",
                        ep_size, num_slots));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<PlacementTable> RebalanceHierarchical(absl::Span<const double> tokens_per_expert,
                                                     const EplbOptions& options) {
  RETURN_IF_ERROR(ValidateLoad(tokens_per_expert, options.num_slots, options.ep_size));
  if (options.num_groups < 1 || options.num_nodes < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_groups and num_nodes: expected each >= 1, got %d and %d",
                        options.num_groups, options.num_nodes));
  }
  const int num_experts = static_cast<int>(tokens_per_expert.size());
  int num_groups = options.num_groups;
  int num_nodes = options.num_nodes;
  // As published: the hierarchy applies only when nodes divide the groups.
  if (num_groups % num_nodes != 0) {
    num_groups = 1;
    num_nodes = 1;
  }
  if (num_experts % num_groups != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_groups: expected a divisor of the number of logical experts (%d), got %d", num_experts,
        num_groups));
  }
  if (options.ep_size % num_nodes != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_nodes: expected a divisor of ep_size (%d), got %d", options.ep_size, num_nodes));
  }

  const int group_size = num_experts / num_groups;
  const int groups_per_node = num_groups / num_nodes;
  const int experts_per_node = num_experts / num_nodes;
  const int slots_per_node = options.num_slots / num_nodes;
  const int ranks_per_node = options.ep_size / num_nodes;
  const int slots_per_rank = options.num_slots / options.ep_size;

  // Step 1: groups to nodes. Node-major order of the experts ("mlog"): node
  // n's experts are mlog ids [n * experts_per_node, (n + 1) * experts_per_node).
  std::vector<double> group_load(num_groups, 0.0);
  for (int e = 0; e < num_experts; ++e) group_load[e / group_size] += tokens_per_expert[e];
  const std::vector<Packed> group_node = BalancedPacking(group_load, num_nodes);
  std::vector<int> mlog_to_logical(num_experts);
  for (int e = 0; e < num_experts; ++e) {
    const Packed& g = group_node[e / group_size];
    const int mlog = (g.pack * groups_per_node + g.position) * group_size + e % group_size;
    mlog_to_logical[mlog] = e;
  }

  std::vector<std::vector<int>> slot_experts(options.ep_size, std::vector<int>(slots_per_rank));
  for (int node = 0; node < num_nodes; ++node) {
    // Step 2: replicas within the node.
    std::vector<double> node_load(experts_per_node);
    for (int j = 0; j < experts_per_node; ++j) {
      node_load[j] = tokens_per_expert[mlog_to_logical[node * experts_per_node + j]];
    }
    std::vector<int> replica_count;
    const std::vector<int> replica_expert = Replicate(node_load, slots_per_node, &replica_count);
    // Step 3: replicas to the node's ranks by load per replica.
    std::vector<double> replica_load(slots_per_node);
    for (int p = 0; p < slots_per_node; ++p) {
      replica_load[p] = node_load[replica_expert[p]] / replica_count[replica_expert[p]];
    }
    const std::vector<Packed> replica_rank = BalancedPacking(replica_load, ranks_per_node);
    for (int p = 0; p < slots_per_node; ++p) {
      const int rank = node * ranks_per_node + replica_rank[p].pack;
      slot_experts[rank][replica_rank[p].position] =
          mlog_to_logical[node * experts_per_node + replica_expert[p]];
    }
  }
  return PlacementTable::FromSlotExperts(num_experts, std::move(slot_experts));
}

absl::StatusOr<PlacementTable> RebalanceGreedy(absl::Span<const double> tokens_per_expert,
                                               int num_slots, int ep_size) {
  RETURN_IF_ERROR(ValidateLoad(tokens_per_expert, num_slots, ep_size));
  const int num_experts = static_cast<int>(tokens_per_expert.size());
  const int slots_per_rank = num_slots / ep_size;
  const std::vector<double> load(tokens_per_expert.begin(), tokens_per_expert.end());
  std::vector<int> replica_count;
  const std::vector<int> replica_expert = Replicate(load, num_slots, &replica_count);

  std::vector<int> order(num_slots);
  std::iota(order.begin(), order.end(), 0);
  auto per_replica = [&](int p) {
    return load[replica_expert[p]] / replica_count[replica_expert[p]];
  };
  std::stable_sort(order.begin(), order.end(),
                   [&](int a, int b) { return per_replica(a) > per_replica(b); });

  std::vector<std::vector<int>> slot_experts(ep_size);
  std::vector<double> rank_load(ep_size, 0.0);
  for (int p : order) {
    const int e = replica_expert[p];
    int best = -1;
    bool best_distinct = false;
    for (int r = 0; r < ep_size; ++r) {
      if (static_cast<int>(slot_experts[r].size()) == slots_per_rank) continue;
      const std::vector<int>& held = slot_experts[r];
      const bool distinct = std::find(held.begin(), held.end(), e) == held.end();
      // A rank without the expert beats one with it; then the lighter rank.
      if (best < 0 || (distinct && !best_distinct) ||
          (distinct == best_distinct && rank_load[r] < rank_load[best])) {
        best = r;
        best_distinct = distinct;
      }
    }
    slot_experts[best].push_back(e);
    rank_load[best] += per_replica(p);
  }
  return PlacementTable::FromSlotExperts(num_experts, std::move(slot_experts));
}

}  // namespace moe_ep::core
