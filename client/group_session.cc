#include "client/group_session.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<GroupSession> FormWorkerGroup(const AttachedWorkers& workers,
                                             CoordinatorOptions options) {
  options.backend = workers.backend;
  options.channel_credentials = workers.channel_credentials;
  if (!workers.lease.owner_id.empty()) {
    options.owner_id = workers.lease.owner_id;
    options.lease_ttl = absl::Milliseconds(workers.lease.ttl_ms);
  }
  GroupSession session;
  ASSIGN_OR_RETURN(session.coordinator, Coordinator::Connect(workers.targets, options));
  RETURN_IF_ERROR(session.coordinator->WaitReady(absl::Seconds(30)));
  if (!options.owner_id.empty()) {
    absl::StatusOr<std::unique_ptr<LeaseRenewer>> lease =
        LeaseRenewer::Start(workers.targets, options, workers.lease.take_over);
    if (absl::IsFailedPrecondition(lease.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the workers are leased by another client; nothing was changed (wait for its lease to "
          "expire, or pass --take-over to take it over: the group is then re-formed and its "
          "experts dropped): ",
          lease.status().message()));
    }
    RETURN_IF_ERROR(lease.status());
    session.lease = *std::move(lease);
  }
  ASSIGN_OR_RETURN(session.joined, session.coordinator->FormGroup());
  return session;
}

}  // namespace moe_ep::client
