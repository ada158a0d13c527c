#pragma once

// Provider (c) of the one-sided data plane's peer windows (DESIGN §13, issue
// 15 item 1): the NCCL 2.28 device API, for ranks on distinct GPUs of one
// NVLink domain. The window is ncclMemAlloc'd, registered as a symmetric
// window (ncclCommWindowRegister, NCCL_WIN_COLL_SYMMETRIC), and every peer's
// address is read once, at set-up, by a one-block kernel calling
// ncclGetPeerPointer (pure arithmetic over NCCL's flat LSA mapping). A
// device communicator (ncclDevCommCreate, requirements zeroed by hand: 2.28.9
// has no initializer) tells whether every rank is in this rank's LSA team.
// The kernels then see a plain pointer table (kernels/onesided/peer_window.h).
// NCCL refuses two ranks on one GPU, so on one GPU this runs at world 1 only.
// Source: DESIGN §13; ../shared/research/nccl-device-api.md; issue 15.

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/nccl_collective.h"
#include "kernels/onesided/peer_window.h"

namespace moe_ep::kernels::onesided {

// Collective over `collective` (every rank, same `bytes`, outside any graph
// capture). The window is zeroed before registration (so before any peer can
// reach it). The returned object deregisters and frees the window and
// destroys the device communicator when destroyed: a collective too, so
// destroy it on every rank after a group barrier; `collective` must outlive
// it. Errors: kInvalidArgument (null, bytes < 1), kFailedPrecondition (a
// rank outside this rank's LSA team: use the NCCL network path),
// kResourceExhausted (ncclMemAlloc), kUnavailable / kDeadlineExceeded (NCCL,
// via NcclCollective::CallComm), kInternal (CUDA).
absl::StatusOr<std::unique_ptr<PeerWindows>> CreateNcclPeerWindows(NcclCollective* collective,
                                                                   int64_t bytes);

}  // namespace moe_ep::kernels::onesided
