#pragma once

// `moe-ep up`: start an embedded local cluster, form the group, print the
// workers, wait for Ctrl-C (SIGINT/SIGTERM), stop them all.

#include <ostream>

#include "absl/status/status.h"
#include "client/worker_selection.h"

namespace moe_ep::client {

// REQUIRES: InstallInterruptHandler() was called (the wait ends on its signal).
// Errors: those of LocalCluster::Start, Coordinator::WaitReady and FormGroup.
absl::Status RunUpCommand(const WorkerSelection& selection, std::ostream& out);

}  // namespace moe_ep::client
