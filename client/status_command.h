#pragma once

// `moe-ep status` and the worker table that `moe-ep up` prints.

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/coordinator.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::client {

// "STARTED", "JOINED", "CONFIGURED", "ALLOCATED" or "UNSPECIFIED".
std::string WorkerStateName(moe_ep::v1::WorkerState state);

// One row per worker: rank (as reported; "-" when unreachable), address,
// state ("UNREACHABLE" with the error in the last column), backend, device,
// device memory, workspace and expert bytes, geometry epoch and R, forwards,
// errors. REQUIRES: statuses.size() == targets.size().
std::string RenderWorkerTable(
    const std::vector<std::string>& targets,
    const std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>>& statuses);

// Queries every target and prints the table to `out`.
// Errors: kInvalidArgument for a bad target list; kUnavailable when any
// worker did not answer (the table is printed first).
absl::Status RunStatusCommand(const std::string& targets, std::ostream& out);
// The same over channels made with `options` (credentials, timeouts).
absl::Status RunStatusCommand(const std::string& targets, const CoordinatorOptions& options,
                              std::ostream& out);

}  // namespace moe_ep::client
