#include "client/worker_selection.h"

#include <unistd.h>

#include <string>
#include <utility>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
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

void AddWorkerSelectionFlags(CLI::App* cmd, WorkerSelection* w, bool allow_targets) {
  auto* workers = cmd->add_option("--workers", w->num_workers,
                                  "start an embedded local cluster of N moe-ep-worker processes")
                      ->check(CLI::Range(1, 1024))
                      ->capture_default_str();
  if (allow_targets) {
    cmd->add_option("--targets", w->targets,
                    "use running workers instead: host:port,... (rank i = i-th address)")
        ->excludes(workers);
  }
  cmd->add_option("--backend", w->backend, "data-plane backend of the workers: gloo | auto | nccl")
      ->check(CLI::IsMember({"gloo", "auto", "nccl"}))
      ->capture_default_str();
  cmd->add_option("--worker-binary", w->worker_binary,
                  "moe-ep-worker executable (default: next to moe-ep)");
  cmd->add_option("--log-dir", w->log_dir,
                  "write each local worker's output to DIR/worker-<i>.log instead of stderr")
      ->check(CLI::ExistingDirectory);
  cmd->add_option("--worker-log-level", w->worker_log_level, "log level of local workers")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  // TLS / mTLS / token for --targets (local workers serve plaintext on loopback).
  if (allow_targets) AddSecurityFlags(cmd, &w->security);
  if (allow_targets) AddLeaseFlags(cmd, &w->lease);
}

void AddLeaseFlags(CLI::App* cmd, LeaseOptions* lease) {
  cmd->add_option("--owner", lease->owner_id,
                  "owner id of the lease held on --targets workers while this command runs "
                  "(default moe-ep@HOST:PID); another owner's live lease refuses the command");
  cmd->add_option("--lease-ttl-ms", lease->ttl_ms,
                  "time to live of that lease, renewed every third of it")
      ->check(CLI::Range(int64_t{30}, int64_t{3600000}))
      ->capture_default_str();
  cmd->add_flag("--take-over", lease->take_over,
                "take the workers' lease over from another owner (its group is then re-formed)");
}

std::string DefaultOwnerId() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
  return absl::StrCat("moe-ep@", host[0] != '\0' ? host : "localhost", ":", getpid());
}

absl::StatusOr<AttachedWorkers> AttachWorkers(const WorkerSelection& selection) {
  AttachedWorkers out;
  ASSIGN_OR_RETURN(LocalWorkerPlan plan, PlanWorkers(selection));
  out.backend = plan.backend;
  if (!selection.targets.empty()) {
    ASSIGN_OR_RETURN(out.targets, ParseTargets(selection.targets));
    ASSIGN_OR_RETURN(out.channel_credentials, MakeClientChannelCredentials(selection.security));
    out.lease = selection.lease;
    if (out.lease.owner_id.empty()) out.lease.owner_id = DefaultOwnerId();
    return out;
  }
  const ClientSecurityOptions& security = selection.security;
  for (const auto& [flag, value] :
       {std::pair<const char*, const std::string*>{"--tls-ca", &security.tls_ca},
        {"--tls-cert", &security.tls_cert},
        {"--tls-key", &security.tls_key},
        {"--auth-token-file", &security.auth_token_file}}) {
    if (!value->empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(flag, " \"", *value,
                       "\": only with --targets (the local workers serve plaintext on loopback)"));
    }
  }
  LocalClusterOptions options;
  options.num_workers = plan.num_workers;
  options.backend = plan.backend;
  options.worker_binary = selection.worker_binary;
  options.log_dir = selection.log_dir;
  if (!selection.worker_log_level.empty()) {
    options.extra_args.push_back("--log-level=" + selection.worker_log_level);
  }
  if (selection.worker_memory_cap_bytes > 0) {
    options.extra_args.push_back("--memory-cap-bytes=" +
                                 std::to_string(selection.worker_memory_cap_bytes));
  }
  if (plan.one_per_gpu) UseOneWorkerPerGpu(plan.num_workers, &options);
  ASSIGN_OR_RETURN(out.cluster, LocalCluster::Start(options));
  out.targets = out.cluster->targets();
  return out;
}

}  // namespace moe_ep::client
