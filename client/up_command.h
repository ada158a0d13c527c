#pragma once

// `moe-ep up`: start an embedded local cluster, form the group, print the
// workers, wait for Ctrl-C (SIGINT/SIGTERM), stop them all. On a machine with
// NVIDIA GPUs and --backend auto or nccl: one NCCL worker per GPU.

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/worker_selection.h"

namespace moe_ep::client {

// REQUIRES: InstallInterruptHandler() was called (the wait ends on its signal).
// Returns OK after Ctrl-C once every worker has stopped.
// Errors: those of AttachWorkers, LocalCluster::Start, Coordinator::WaitReady and
// FormGroup; kAborted when a worker dies while the group is up (the message
// names it, its pid, address and exit code or signal; the other workers are
// stopped first). Source: issue 8.
absl::Status RunUpCommand(const WorkerSelection& selection, std::ostream& out);

}  // namespace moe_ep::client
