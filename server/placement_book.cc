#include "server/placement_book.h"

#include <utility>

namespace moe_ep::server {

void PlacementBook::Reset(std::shared_ptr<const core::PlacementTable> contiguous) {
  load_.Reset(contiguous->num_experts());
  tables_.clear();
  contiguous_ = std::move(contiguous);
}

const core::PlacementTable* PlacementBook::Installed(int layer) const {
  auto it = tables_.find(layer);
  return it == tables_.end() ? nullptr : it->second.get();
}

void PlacementBook::Install(int layer, std::shared_ptr<const core::PlacementTable> table) {
  tables_.insert_or_assign(layer, std::move(table));
}

std::shared_ptr<const core::PlacementTable> PlacementBook::Placement(int layer) const {
  auto it = tables_.find(layer);
  return it == tables_.end() ? contiguous_ : it->second;
}

absl::StatusOr<core::ExpertLoadCounts> PlacementBook::ReadExpertLoad(int layer, bool reset) {
  if (!ready()) {
    return absl::FailedPreconditionError("GetExpertLoad: no workspace; call Allocate first");
  }
  return load_.Read(layer, reset);
}

}  // namespace moe_ep::server
