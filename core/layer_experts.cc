#include "core/layer_experts.h"

#include "core/expert_source.h"

namespace moe_ep::core {

int64_t LayerExperts::Bytes(int layer) const {
  auto it = layers_.find(layer);
  return it == layers_.end() ? 0 : it->second.bytes;
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
