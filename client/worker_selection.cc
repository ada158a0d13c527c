#include "client/worker_selection.h"

#include <string>

#include "client/targets.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<AttachedWorkers> AttachWorkers(const WorkerSelection& selection) {
  AttachedWorkers out;
  if (!selection.targets.empty()) {
    ASSIGN_OR_RETURN(out.targets, ParseTargets(selection.targets));
    return out;
  }
  LocalClusterOptions options;
  options.num_workers = selection.num_workers;
  options.backend = selection.backend;
  options.worker_binary = selection.worker_binary;
  options.log_dir = selection.log_dir;
  if (!selection.worker_log_level.empty()) {
    options.extra_args.push_back("--log_level=" + selection.worker_log_level);
  }
  if (selection.worker_memory_cap_bytes > 0) {
    options.extra_args.push_back("--memory_cap_bytes=" +
                                 std::to_string(selection.worker_memory_cap_bytes));
  }
  ASSIGN_OR_RETURN(out.cluster, LocalCluster::Start(options));
  out.targets = out.cluster->targets();
  return out;
}

}  // namespace moe_ep::client
