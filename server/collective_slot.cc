#include "server/collective_slot.h"

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace moe_ep::server {

absl::Time CallDeadline(const grpc::ServerContext* context) {
  if (context == nullptr) return absl::InfiniteFuture();
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

SlotLease::~SlotLease() {
  if (!held_) return;
  absl::MutexLock lock(&slot_->mu_);
  slot_->free_ = true;
}

absl::Status SlotLease::Acquire(const grpc::ServerContext* context, absl::string_view rpc) {
  return AcquireUntil(CallDeadline(context), context, rpc);
}

absl::Status SlotLease::AcquireUntil(absl::Time deadline, const grpc::ServerContext* context,
                                     absl::string_view rpc) {
  // A call whose deadline passed or whose client gave up (while queued in
  // gRPC or waiting here) does no collective work at all.
  if (absl::Now() >= deadline) {
    return absl::DeadlineExceededError(
        absl::StrCat(rpc, ": the call's deadline passed before it started"));
  }
  absl::MutexLock lock(&slot_->mu_);
  if (!slot_->mu_.AwaitWithDeadline(absl::Condition(&slot_->free_), deadline)) {
    return absl::DeadlineExceededError(absl::StrCat(
        rpc, ": another collective call kept this worker busy past the call's deadline"));
  }
  if (context != nullptr && context->IsCancelled()) {
    return absl::CancelledError(absl::StrCat(rpc, ": the client cancelled the call"));
  }
  slot_->free_ = false;
  held_ = true;
  return absl::OkStatus();
}

}  // namespace moe_ep::server
