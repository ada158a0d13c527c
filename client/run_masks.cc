#include "client/run_masks.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<core::PlacementTable> RingReplicaTable(int num_experts, int world,
                                                      int redundant_slots_per_rank) {
  if (world < 1 || num_experts < world || redundant_slots_per_rank < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "ring replica table: expected 1 <= world <= num_experts and redundant slots >= 0, got ",
        num_experts, " experts, world ", world, ", ", redundant_slots_per_rank,
        " redundant slots"));
  }
  ASSIGN_OR_RETURN(core::ExpertPlacement contiguous,
                   core::ExpertPlacement::Contiguous(num_experts, world));
  const int slots = (num_experts + world - 1) / world + redundant_slots_per_rank;
  std::vector<std::vector<int>> slot_experts(world);
  for (int r = 0; r < world; ++r) {
    std::vector<int>& mine = slot_experts[r];
    for (int d = 0; d < world && static_cast<int>(mine.size()) < slots; ++d) {
      const int owner = (r + d) % world;
      const int first = contiguous.FirstExpert(owner);
      for (int e = first; e < first + contiguous.NumLocalExperts(owner); ++e) {
        if (static_cast<int>(mine.size()) == slots) break;
        if (std::find(mine.begin(), mine.end(), e) == mine.end()) mine.push_back(e);
      }
    }
    if (static_cast<int>(mine.size()) != slots) {
      return absl::InvalidArgumentError(absl::StrCat("ring replica table: rank ", r, " needs ",
                                                     slots, " distinct experts, there are ",
                                                     num_experts));
    }
  }
  return core::PlacementTable::FromSlotExperts(num_experts, std::move(slot_experts));
}

std::vector<int> LostExperts(const core::PlacementTable& table, const std::vector<bool>& live) {
  std::vector<int> lost;
  for (int e = 0; e < table.num_experts(); ++e) {
    bool any = false;
    for (const core::ReplicaSlot& replica : table.Replicas(e)) {
      any = any || (replica.rank < static_cast<int>(live.size()) && live[replica.rank]);
    }
    if (!any) lost.push_back(e);
  }
  return lost;
}

int64_t DropLostChoices(const std::vector<int>& lost, absl::Span<int32_t> ids) {
  int64_t dropped = 0;
  for (int32_t& id : ids) {
    if (std::binary_search(lost.begin(), lost.end(), id)) {
      id = -1;
      ++dropped;
    }
  }
  return dropped;
}

}  // namespace moe_ep::client
