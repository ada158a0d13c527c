#pragma once

// `moe-ep up`: start an embedded local cluster, form the group, print the
// workers, wait for Ctrl-C (SIGINT/SIGTERM), stop them all. On a machine with
// NVIDIA GPUs and --backend auto or nccl: one NCCL worker per GPU. With
// --targets: form and configure a group of running workers, then exit.

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/group_setup.h"
#include "client/worker_selection.h"

namespace moe_ep::client {

// Without --targets: starts the local workers, takes their lease (owner
// --owner, default DefaultOwnerId(); renewed until it stops, then given
// back: issue 31 item 2), forms the group, configures it when setup.hidden
// > 0 (client/group_setup.h), prints the workers and waits for Ctrl-C. REQUIRES:
// InstallInterruptHandler() was called (the wait ends on its signal). Returns OK after Ctrl-C once
// every worker has stopped. With --targets (issue 16 item 3): forms a new group of those already
// running workers (moe-ep-worker processes or workers embedded in an
// engine, server/moe_ep.h), configures it the same way, prints the table and
// returns at once; the workers keep the group (and the lease taken for the
// set-up is given back: a later command that would re-form a group holding
// experts is refused unless --take-over, client/group_session.h).
// Errors: those of AttachWorkers, LocalCluster::Start, Coordinator::WaitReady,
// FormGroup and SetUpGroup; kAborted when a local worker dies while the group
// is up (the message names it, its pid, address and exit code or signal; the
// other workers are stopped first). Source: issue 8, issue 16.
absl::Status RunUpCommand(const WorkerSelection& selection, const GroupSetupOptions& setup,
                          std::ostream& out);

}  // namespace moe_ep::client
