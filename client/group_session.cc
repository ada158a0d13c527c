#include "client/group_session.h"

#include <utility>

#include "absl/time/time.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<GroupSession> FormWorkerGroup(const AttachedWorkers& workers,
                                             CoordinatorOptions options) {
  options.backend = workers.backend;
  options.channel_credentials = workers.channel_credentials;
  GroupSession session;
  ASSIGN_OR_RETURN(session.coordinator, Coordinator::Connect(workers.targets, std::move(options)));
  RETURN_IF_ERROR(session.coordinator->WaitReady(absl::Seconds(30)));
  ASSIGN_OR_RETURN(session.joined, session.coordinator->FormGroup());
  return session;
}

}  // namespace moe_ep::client
