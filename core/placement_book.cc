#include "core/placement_book.h"

#include <algorithm>
#include <utility>

namespace moe_ep::core {

void PlacementBook::Reset(std::shared_ptr<const PlacementTable> contiguous) {
  load_.Reset(contiguous->num_experts());
  tables_.clear();
  masked_.clear();
  contiguous_ = std::move(contiguous);
}

const PlacementTable* PlacementBook::Installed(int layer) const {
  auto it = tables_.find(layer);
  return it == tables_.end() ? nullptr : it->second.get();
}

void PlacementBook::Install(int layer, std::shared_ptr<const PlacementTable> table) {
  auto old = tables_.find(layer);
  if (old != tables_.end()) masked_.erase(old->second.get());
  tables_.insert_or_assign(layer, std::move(table));
}

void PlacementBook::SetLive(std::vector<bool> live) {
  if (std::all_of(live.begin(), live.end(), [](bool b) { return b; })) live.clear();
  live_ = std::move(live);
  masked_.clear();
}

std::shared_ptr<const PlacementTable> PlacementBook::Placement(int layer) const {
  auto it = tables_.find(layer);
  const std::shared_ptr<const PlacementTable>& table =
      it == tables_.end() ? contiguous_ : it->second;
  if (live_.empty() || table == nullptr) return table;
  auto cached = masked_.find(table.get());
  if (cached != masked_.end()) return cached->second;
  absl::StatusOr<PlacementTable> masked = table->WithMask(live_);
  if (!masked.ok()) return table;  // another ep_size: not this mask's
  auto made = std::make_shared<const PlacementTable>(*std::move(masked));
  masked_.emplace(table.get(), made);
  return made;
}

absl::StatusOr<ExpertLoadCounts> PlacementBook::ReadExpertLoad(int layer, bool reset) {
  if (!ready()) {
    return absl::FailedPreconditionError("GetExpertLoad: no workspace; call Allocate first");
  }
  return load_.Read(layer, reset);
}

}  // namespace moe_ep::core
