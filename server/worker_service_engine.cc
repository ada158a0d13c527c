// WorkerService::RunOnDataPlane (server/worker_service.h): the entry of the
// embedded worker's in-process data calls (server/moe_ep.h, DESIGN §14).
// Kept apart from the RPC handlers: it shares only the collective slot and
// the group checks with them.

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/worker_service.h"

namespace moe_ep::server {

absl::Status WorkerService::RunOnDataPlane(
    const char* call, absl::Time deadline,
    absl::FunctionRef<absl::Status(DataPlane&, const core::EpDispatcherOptions&)> fn) {
  {
    absl::MutexLock lock(&slot_mu_);
    if (!slot_mu_.AwaitWithDeadline(absl::Condition(&slot_free_), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          call, ": another collective call kept this worker busy past the call's deadline"));
    }
    slot_free_ = false;
  }
  absl::Cleanup release = [this] {
    absl::MutexLock lock(&slot_mu_);
    slot_free_ = true;
  };
  RETURN_IF_ERROR(RequireGroup(WorkerPhase::kAllocated, call));
  return GroupResult(fn(*data_plane_, allocation_->options));
}

}  // namespace moe_ep::server
