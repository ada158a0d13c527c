#pragma once

// Which workers a CLI command drives: an embedded local cluster of N workers
// (`--workers N`, the default) or running workers (`--targets h:p,...`), and
// how to reach them: local workers serve plaintext on loopback; running
// workers may need TLS, a client certificate and a bearer token
// (--tls-ca, --tls-cert, --tls-key, --auth-token-file; client/credentials.h).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/credentials.h"
#include "client/local_cluster.h"
#include "grpcpp/security/credentials.h"

namespace CLI {
class App;
}

namespace moe_ep::client {

// The lease a command holds on --targets workers (client/lease_renewer.h;
// LeaseClaim in worker.proto; issue 12 item 4).
struct LeaseOptions {
  std::string owner_id;    // --owner; empty: DefaultOwnerId()
  int64_t ttl_ms = 30000;  // --lease-ttl-ms
  bool take_over = false;  // --take-over
};

// "moe-ep@<hostname>:<pid>": the owner id of a command without --owner.
std::string DefaultOwnerId();

struct WorkerSelection {
  int num_workers = 4;           // local cluster size when `targets` is empty
  std::string targets;           // comma-separated host:port list; wins when set
  std::string backend = "auto";  // NCCL, one worker per GPU, when GPUs are present; else Gloo
  std::string worker_binary;     // empty: next to this executable
  std::string log_dir;           // empty: worker output to stderr
  // Passed to local workers as --log-level (trace, debug, info, warn, error,
  // critical, off); empty leaves the worker's default.
  std::string worker_log_level = "warn";
  // > 0: passed to local workers as --memory-cap-bytes (the worker refuses
  // with RESOURCE_EXHAUSTED beyond it); 0 leaves them uncapped.
  int64_t worker_memory_cap_bytes = 0;
  // How to reach --targets workers (TLS, mTLS, bearer token). Only with
  // `targets`: local workers always serve plaintext on loopback.
  ClientSecurityOptions security;
  // The lease held on --targets workers while the command runs (local
  // workers are the command's own: no lease).
  LeaseOptions lease;
};

// Adds the worker-selection flags of `run`, `bench` and `up` to `cmd`:
// --workers, --backend, --worker-binary, --log-dir, --worker-log-level, and
// when `allow_targets` also --targets and the security flags of
// client/credentials.h (--tls-ca, --tls-cert, --tls-key, --auth-token-file).
// --targets excludes --workers. With `allow_targets` also the lease flags
// --owner, --lease-ttl-ms and --take-over. Parsing fills `w`.
void AddWorkerSelectionFlags(CLI::App* cmd, WorkerSelection* w, bool allow_targets);

// --owner, --lease-ttl-ms and --take-over into `lease` (the lease a command
// holds on --targets workers: client/group_session.h FormWorkerGroup).
void AddLeaseFlags(CLI::App* cmd, LeaseOptions* lease);

// How local workers are started on a machine with `num_gpus` GPUs
// (CountLocalGpus in client/local_cluster.h), for `up`, `run` and `bench`:
//   --backend gloo            `num_workers` Gloo workers (GPUs unused);
//   --backend auto or nccl    with GPUs: one NCCL worker per GPU, worker i on
//                             --device=i (`num_workers` is not used);
//   --backend auto            without GPUs: `num_workers` workers that resolve
//                             "auto" themselves (Gloo);
//   --backend nccl            without GPUs: kFailedPrecondition saying so.
// Source: issue 3 ("moe-ep up on a machine with GPUs starts one worker per GPU").
struct LocalWorkerPlan {
  int num_workers = 0;
  std::string backend;       // passed to the workers and to Join
  bool one_per_gpu = false;  // worker i gets --device=i
};
absl::StatusOr<LocalWorkerPlan> PlanLocalWorkers(const std::string& backend, int num_workers,
                                                 int num_gpus);

// The plan for `selection` on this machine: for --targets, the target count
// and the selection's backend; otherwise PlanLocalWorkers with
// CountLocalGpus(). Errors: those of ParseTargets and PlanLocalWorkers.
absl::StatusOr<LocalWorkerPlan> PlanWorkers(const WorkerSelection& selection);

struct AttachedWorkers {
  std::unique_ptr<LocalCluster> cluster;  // null for --targets
  std::vector<std::string> targets;       // rank order
  std::string backend;                    // what to Join with (the plan's backend)
  // What the coordinator's channels use (CoordinatorOptions::channel_credentials):
  // from `selection.security` for --targets; null (plaintext) for a local cluster.
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
  // For --targets: the lease to hold (owner_id filled in); empty owner_id
  // for a local cluster.
  LeaseOptions lease;
};

// Starts the local cluster as PlanWorkers says, or parses the targets and
// builds their channel credentials.
// Errors: kInvalidArgument for a security option without targets (names the
// flag: local workers serve plaintext on loopback); those of
// MakeClientChannelCredentials, PlanWorkers and LocalCluster::Start.
absl::StatusOr<AttachedWorkers> AttachWorkers(const WorkerSelection& selection);

}  // namespace moe_ep::client
