#include "client/placement_request.h"

namespace moe_ep::client {

v1::InstallPlacementRequest MakeInstallPlacementRequest(int layer,
                                                        const core::PlacementTable& table) {
  v1::InstallPlacementRequest request;
  request.set_layer(layer);
  for (int r = 0; r < table.ep_size(); ++r) {
    const std::vector<int>& slots = table.SlotExperts(r);
    request.add_ranks()->mutable_slot_experts()->Assign(slots.begin(), slots.end());
  }
  request.set_fingerprint(table.Fingerprint());
  return request;
}

}  // namespace moe_ep::client
