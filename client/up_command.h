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

// How `moe-ep up` starts its workers on a machine with `num_gpus` GPUs
// (CountLocalGpus in client/local_cluster.h):
//   --backend gloo            `num_workers` Gloo workers (GPUs unused);
//   --backend auto or nccl    with GPUs: one NCCL worker per GPU, worker i on
//                             --device=i (`num_workers` is not used);
//   --backend auto            without GPUs: `num_workers` workers that resolve
//                             "auto" themselves (Gloo);
//   --backend nccl            without GPUs: kFailedPrecondition saying so.
struct UpPlan {
  int num_workers = 0;
  std::string backend;       // passed to the workers and to Join
  bool one_per_gpu = false;  // worker i gets --device=i
};
absl::StatusOr<UpPlan> PlanUp(const std::string& backend, int num_workers, int num_gpus);

// REQUIRES: InstallInterruptHandler() was called (the wait ends on its signal).
// Errors: those of PlanUp, LocalCluster::Start, Coordinator::WaitReady and
// FormGroup.
absl::Status RunUpCommand(const WorkerSelection& selection, std::ostream& out);

}  // namespace moe_ep::client
