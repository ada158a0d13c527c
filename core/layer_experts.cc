#include "core/layer_experts.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/expert_source.h"

namespace moe_ep::core {

int64_t LayerExperts::Bytes(int layer) const {
  auto it = layers_.find(layer);
  return it == layers_.end() ? 0 : it->second.bytes;
}

absl::Status LayerExperts::NotLoaded(absl::string_view call, int layer, int rank) const {
  std::vector<int> loaded;
  for (const auto& [l, entry] : layers_) loaded.push_back(l);
  return absl::FailedPreconditionError(absl::StrCat(
      call, ": layer ", layer, " has no loaded experts on rank ", rank,
      " (layers with experts here: ",
      loaded.empty() ? std::string("none") : absl::StrCat("[", absl::StrJoin(loaded, ","), "]"),
      "); call LoadExperts first"));
}

int64_t LayerExperts::TotalBytes() const {
  int64_t total = 0;
  for (const auto& [layer, entry] : layers_) total += entry.bytes;
  return total;
}

bool LayerExperts::KeepIfSlotsOf(int layer, const PlacementTable& table, int rank) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return false;
  if (it->second.expert_ids == DistinctSlotExperts(table, rank)) return true;
  layers_.erase(it);
  return false;
}

}  // namespace moe_ep::core
