#include "client/up_command.h"

#include <signal.h>

#include <cstring>
#include <ostream>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/time.h"
#include "client/coordinator.h"
#include "client/group_session.h"
#include "client/interrupt.h"
#include "client/local_cluster.h"
#include "client/status_command.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::Status RunUpCommand(const WorkerSelection& selection, const GroupSetupOptions& setup,
                          std::ostream& out) {
  RETURN_IF_ERROR(ValidateGroupSetup(setup, 0));
  ASSIGN_OR_RETURN(AttachedWorkers workers, AttachWorkers(selection));
  if (workers.backend == "nccl" && workers.cluster != nullptr) {
    out << "moe-ep: " << workers.targets.size() << " GPU(s) found: one NCCL worker per GPU\n";
  }
  if (workers.cluster != nullptr) {
    // Its own workers are leased too, renewed while `up` runs (issue 31 item
    // 2): `bench --targets` or another client is refused, naming this owner,
    // instead of re-forming the group and dropping its experts.
    workers.lease = selection.lease;
    if (workers.lease.owner_id.empty()) workers.lease.owner_id = DefaultOwnerId();
  }
  CoordinatorOptions options;
  options.group_timeout = absl::Seconds(setup.group_timeout_s);  // --group-timeout
  ASSIGN_OR_RETURN(GroupSession group, FormWorkerGroup(workers, options));
  Coordinator* const coordinator = group.coordinator.get();
  RETURN_IF_ERROR(SetUpGroup(*coordinator, setup, out));
  const bool running_workers = workers.cluster == nullptr;  // --targets
  out << "moe-ep: " << workers.targets.size()
      << (running_workers ? " running workers formed" : " workers up") << ", group generation "
      << coordinator->generation() << "\n"
      << RenderWorkerTable(workers.targets, coordinator->StatusEach())
      << "targets: " << absl::StrJoin(workers.targets, ",") << "\n";
  if (running_workers) {
    out.flush();
    return absl::OkStatus();
  }
  out << "Press Ctrl-C to stop.\n";
  out.flush();
  // Until Ctrl-C, or until a worker dies: a group cannot lose a member and
  // live on, so `up` then stops the others and fails, naming the worker and
  // its exit code or signal (the cluster has already printed that line).
  int signo = 0;
  while ((signo = InterruptSignal()) == 0) {
    absl::StatusOr<WorkerExit> exit = workers.cluster->WaitForExit(absl::Milliseconds(100));
    if (!exit.ok()) continue;
    out << "moe-ep: a worker died; stopping the other workers" << std::endl;
    group.lease.reset();  // gives the lease back where a worker still answers
    (void)workers.cluster->Stop();
    return absl::AbortedError(absl::StrCat("the group lost a member: ", exit->description));
  }
  out << "moe-ep: " << strsignal(signo) << ", stopping " << workers.targets.size() << " workers"
      << std::endl;
  group.lease.reset();  // gives the lease back, then the workers stop
  RETURN_IF_ERROR(workers.cluster->Stop());
  out << "moe-ep: all workers stopped" << std::endl;
  return absl::OkStatus();
}

}  // namespace moe_ep::client
