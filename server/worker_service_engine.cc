// WorkerService::RunOnDataPlane (server/worker_service.h): the entry of the
// embedded worker's in-process data calls (server/moe_ep.h, DESIGN §14).
// Kept apart from the RPC handlers: it shares only the collective slot and
// the group checks with them.

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/worker_service.h"

namespace moe_ep::server {

absl::Status WorkerService::RunOnDataPlane(
    const char* call, absl::Time deadline,
    absl::FunctionRef<absl::Status(DataPlane&, const core::EpDispatcherOptions&)> fn) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(slot.AcquireUntil(deadline, nullptr, call));
  RETURN_IF_ERROR(RequireGroup(WorkerPhase::kAllocated, call));
  // Every rank's engine sees the same agreed mask, so every rank fails here
  // alike: no route to a lost rank, no wait on it.
  RETURN_IF_ERROR(RequireNoMask(call));
  data_plane_->SetCall(CallBound{deadline, nullptr});
  return GroupResult(call, fn(*data_plane_, allocation_->options));
}

}  // namespace moe_ep::server
