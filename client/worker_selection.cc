#include "client/worker_selection.h"

#include <string>

#include "client/targets.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<LocalWorkerPlan> PlanLocalWorkers(const std::string& backend, int num_workers,
                                                 int num_gpus) {
  if (backend != "gloo" && num_gpus > 0) return LocalWorkerPlan{num_gpus, "nccl", true};
  if (backend == "nccl") {
    return absl::FailedPreconditionError(
        "--backend nccl: no NVIDIA GPU found on this machine (no /dev/nvidia<N> device nodes, or "
        "CUDA_VISIBLE_DEVICES hides them); use --backend gloo or auto");
  }
  return LocalWorkerPlan{num_workers, backend, false};
}

absl::StatusOr<LocalWorkerPlan> PlanWorkers(const WorkerSelection& selection) {
  if (!selection.targets.empty()) {
    ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(selection.targets));
    return LocalWorkerPlan{static_cast<int>(targets.size()), selection.backend, false};
  }
  return PlanLocalWorkers(selection.backend, selection.num_workers, CountLocalGpus());
}

absl::StatusOr<AttachedWorkers> AttachWorkers(const WorkerSelection& selection) {
  AttachedWorkers out;
  ASSIGN_OR_RETURN(LocalWorkerPlan plan, PlanWorkers(selection));
  out.backend = plan.backend;
  if (!selection.targets.empty()) {
    ASSIGN_OR_RETURN(out.targets, ParseTargets(selection.targets));
    return out;
  }
  LocalClusterOptions options;
  options.num_workers = plan.num_workers;
  options.backend = plan.backend;
  options.worker_binary = selection.worker_binary;
  options.log_dir = selection.log_dir;
  if (!selection.worker_log_level.empty()) {
    options.extra_args.push_back("--log_level=" + selection.worker_log_level);
  }
  if (selection.worker_memory_cap_bytes > 0) {
    options.extra_args.push_back("--memory_cap_bytes=" +
                                 std::to_string(selection.worker_memory_cap_bytes));
  }
  if (plan.one_per_gpu) UseOneWorkerPerGpu(plan.num_workers, &options);
  ASSIGN_OR_RETURN(out.cluster, LocalCluster::Start(options));
  out.targets = out.cluster->targets();
  return out;
}

}  // namespace moe_ep::client
