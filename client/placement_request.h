#pragma once

// The InstallPlacement request of a placement table (DESIGN §15): the
// logical expert of every slot of every rank, with the table's fingerprint
// so a worker that decodes another table rejects it. Pure; thread-safe.
// Source: DESIGN §15; issue 17 item 1.

#include "core/placement_table.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::client {

// ranks[r].slot_experts = table.SlotExperts(r); fingerprint =
// table.Fingerprint(). Example: Contiguous(4, 2), layer 1 -> layer 1,
// ranks [[0, 1], [2, 3]].
v1::InstallPlacementRequest MakeInstallPlacementRequest(int layer,
                                                        const core::PlacementTable& table);

}  // namespace moe_ep::client
