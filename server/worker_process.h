#pragma once

// Everything `moe-ep-worker` serves, set up from its flags and running on
// gRPC's threads: the moe_ep.v1.Worker and moe_ep.v1.Rendezvous services,
// grpc.health.v1 (and the plaintext probe server of --health-listen), server
// reflection v1alpha and v1, TLS / bearer-token auth, RPC metrics (and the
// Prometheus server of --metrics-listen), the drain of in-flight calls. One
// setup for both users (DESIGN §14): server/main.cc (the moe-ep-worker
// process, which adds stop signals and the "listening on" line) and the
// embedded worker of server/moe_ep.h (inside an engine's process).
//
// Thread-safe (after Start, every method may be called from any thread; the
// destructor must not race with other calls). Source: DESIGN §8, §14; issue
// 13 (memory cap), issue 16 item 1.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/worker_flags.h"
#include "server/worker_service.h"

namespace moe_ep::server {

class WorkerProcess {
 public:
  // Configures logging (stderr, --log-level, --log-format; the logger
  // "moe-ep-worker" is made once per process and reused), checks the NCCL
  // runtime when built with CUDA (server/nccl_runtime.h), resolves the
  // backend, device and memory cap, builds the credentials, binds
  // --listen (and --health-listen, --metrics-listen), writes the port files
  // and starts serving. Errors (each message names the flag):
  // kInvalidArgument (a flag value: backend, device, TLS files, token file),
  // kUnavailable (a listen address cannot be bound), kFailedPrecondition
  // (the NCCL runtime differs from the one built against), kInternal (a port
  // file cannot be written).
  static absl::StatusOr<std::unique_ptr<WorkerProcess>> Start(const WorkerFlags& flags);

  // Stops now (Shutdown(absl::Now())) unless Shutdown ran.
  ~WorkerProcess();
  WorkerProcess(const WorkerProcess&) = delete;
  WorkerProcess& operator=(const WorkerProcess&) = delete;

  // "host:port" of the bound --listen address.
  const std::string& address() const;
  // One line for the log: backend, device, memory cap and store budget.
  const std::string& summary() const;
  // The Worker service (the in-process data calls go through it).
  WorkerService& worker();
  // RPCs now running.
  int64_t in_flight() const;
  // Readiness (proto/rpc/health.h): joined, allocated, not broken, not stopping.
  bool ready() const;

  // Health NOT_SERVING, new calls UNAVAILABLE "shutting down", waits for the
  // calls running until `drain_deadline`, then cancels what still runs and
  // stops the servers. Returns false when calls were still running at the
  // deadline. Later calls do nothing and return true.
  bool Shutdown(absl::Time drain_deadline);

 private:
  struct Parts;
  explicit WorkerProcess(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace moe_ep::server
