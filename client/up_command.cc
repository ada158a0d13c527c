#include "client/up_command.h"

#include <signal.h>

#include <cstring>
#include <ostream>
#include <string>

#include "absl/strings/str_join.h"
#include "client/coordinator.h"
#include "client/interrupt.h"
#include "client/status_command.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<UpPlan> PlanUp(const std::string& backend, int num_workers, int num_gpus) {
  if (backend != "gloo" && num_gpus > 0) return UpPlan{num_gpus, "nccl", true};
  if (backend == "nccl") {
    return absl::FailedPreconditionError(
        "--backend nccl: no NVIDIA GPU found on this machine (no /dev/nvidia<N> device nodes, or "
        "CUDA_VISIBLE_DEVICES hides them); use --backend gloo or auto");
  }
  return UpPlan{num_workers, backend, false};
}

namespace {

// One NCCL worker per GPU, with the selection's other worker settings.
absl::StatusOr<AttachedWorkers> StartOnePerGpu(const WorkerSelection& selection, int num_gpus) {
  LocalClusterOptions options;
  options.worker_binary = selection.worker_binary;
  options.log_dir = selection.log_dir;
  if (!selection.worker_log_level.empty()) {
    options.extra_args.push_back("--log_level=" + selection.worker_log_level);
  }
  if (selection.worker_memory_cap_bytes > 0) {
    options.extra_args.push_back("--memory_cap_bytes=" +
                                 std::to_string(selection.worker_memory_cap_bytes));
  }
  UseOneWorkerPerGpu(num_gpus, &options);
  AttachedWorkers out;
  ASSIGN_OR_RETURN(out.cluster, LocalCluster::Start(options));
  out.targets = out.cluster->targets();
  return out;
}

}  // namespace

absl::Status RunUpCommand(const WorkerSelection& selection, std::ostream& out) {
  const int num_gpus = CountLocalGpus();
  ASSIGN_OR_RETURN(UpPlan plan, PlanUp(selection.backend, selection.num_workers, num_gpus));
  AttachedWorkers workers;
  if (plan.one_per_gpu) {
    out << "moe-ep: " << num_gpus << " GPU(s) found: one NCCL worker per GPU\n";
    ASSIGN_OR_RETURN(workers, StartOnePerGpu(selection, num_gpus));
  } else {
    WorkerSelection local = selection;
    local.targets.clear();  // `up` always starts its own workers
    local.num_workers = plan.num_workers;
    local.backend = plan.backend;
    ASSIGN_OR_RETURN(workers, AttachWorkers(local));
  }
  CoordinatorOptions options;
  options.backend = plan.backend;
  ASSIGN_OR_RETURN(std::unique_ptr<Coordinator> coordinator,
                   Coordinator::Connect(workers.targets, options));
  RETURN_IF_ERROR(coordinator->WaitReady(absl::Seconds(30)));
  RETURN_IF_ERROR(coordinator->FormGroup().status());
  out << "moe-ep: " << workers.targets.size() << " workers up, group generation "
      << coordinator->generation() << "\n"
      << RenderWorkerTable(workers.targets, coordinator->StatusEach())
      << "targets: " << absl::StrJoin(workers.targets, ",") << "\n"
      << "Press Ctrl-C to stop.\n";
  out.flush();
  const int signo = WaitForInterrupt();
  out << "moe-ep: " << strsignal(signo) << ", stopping " << workers.targets.size() << " workers"
      << std::endl;
  RETURN_IF_ERROR(workers.cluster->Stop());
  out << "moe-ep: all workers stopped" << std::endl;
  return absl::OkStatus();
}

}  // namespace moe_ep::client
