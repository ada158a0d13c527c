#pragma once

// The Worker service's collective slot (server/worker_service.h): all
// collective work of one worker is serialized through it (a collective is
// single-threaded), and a call waits for it only until its own deadline.
//
//   SlotLease lease(&slot);
//   RETURN_IF_ERROR(lease.Acquire(context, "Forward"));  // held until scope end
//
// Thread-safe (the slot); a SlotLease belongs to one call. Source: DESIGN
// §8; issue 13 item 6 (every wait honours the call's deadline).

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/server_context.h"

namespace moe_ep::server {

// The deadline of the gRPC call `context` serves (absl::InfiniteFuture()
// when it has none, or for a null context).
absl::Time CallDeadline(const grpc::ServerContext* context);

class CollectiveSlot {
 private:
  friend class SlotLease;
  absl::Mutex mu_;
  bool free_ ABSL_GUARDED_BY(mu_) = true;
};

class SlotLease {
 public:
  explicit SlotLease(CollectiveSlot* slot) : slot_(slot) {}
  SlotLease(const SlotLease&) = delete;
  SlotLease& operator=(const SlotLease&) = delete;
  // Releases the slot if Acquire took it.
  ~SlotLease();

  // Takes the slot, waiting until the call's deadline. Errors (naming
  // `rpc`): kDeadlineExceeded (the deadline passed before the call started,
  // or another call held the slot past it), kCancelled (the client gave up
  // while it waited). A call that fails here does no collective work.
  absl::Status Acquire(const grpc::ServerContext* context, absl::string_view rpc);
  // As Acquire, waiting until `deadline`; `context` (may be null: the
  // embedded worker's in-process calls) is checked for cancellation.
  absl::Status AcquireUntil(absl::Time deadline, const grpc::ServerContext* context,
                            absl::string_view rpc);

 private:
  CollectiveSlot* slot_;
  bool held_ = false;
};

}  // namespace moe_ep::server
