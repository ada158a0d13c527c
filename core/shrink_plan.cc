#include "core/shrink_plan.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe_ep::core {

int CommRankOf(const std::vector<int>& members, int original) {
  const auto it = std::lower_bound(members.begin(), members.end(), original);
  if (it == members.end() || *it != original) return -1;
  return static_cast<int>(it - members.begin());
}

std::vector<int> LiveMembers(const std::vector<bool>& live) {
  std::vector<int> members;
  for (int r = 0; r < static_cast<int>(live.size()); ++r) {
    if (live[r]) members.push_back(r);
  }
  return members;
}

absl::StatusOr<ShrinkPlan> PlanShrink(const std::vector<int>& parent_members,
                                      const std::vector<bool>& live, int rank) {
  const int world = static_cast<int>(live.size());
  if (parent_members.empty()) {
    return absl::InvalidArgumentError("PlanShrink: the parent communicator has no members");
  }
  for (size_t i = 0; i < parent_members.size(); ++i) {
    const int m = parent_members[i];
    if (m < 0 || m >= world || (i > 0 && m <= parent_members[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("PlanShrink: parent members expected ascending in [0, ", world, "), entry ",
                       i, " is ", m, " (members [", absl::StrJoin(parent_members, ","), "])"));
    }
  }
  if (rank < 0 || rank >= world) {
    return absl::InvalidArgumentError(
        absl::StrCat("PlanShrink: rank ", rank, " outside [0, ", world, ")"));
  }
  if (!live[rank]) {
    return absl::InvalidArgumentError(
        absl::StrCat("PlanShrink: rank ", rank, " is masked; only live ranks plan a communicator"));
  }
  ShrinkPlan plan;
  plan.members = LiveMembers(live);
  plan.new_rank = CommRankOf(plan.members, rank);
  if (plan.members == parent_members) return plan;  // kKeep
  bool all_in_parent = true;
  for (const int m : plan.members)
    all_in_parent = all_in_parent && CommRankOf(parent_members, m) >= 0;
  if (!all_in_parent) {
    plan.kind = ShrinkPlan::Kind::kReinit;
    return plan;
  }
  plan.kind = ShrinkPlan::Kind::kShrink;
  for (int i = 0; i < static_cast<int>(parent_members.size()); ++i) {
    if (!live[parent_members[i]]) plan.exclude.push_back(i);
  }
  return plan;
}

}  // namespace moe_ep::core
