#pragma once

// grpc.health.v1 reporting for the worker (DESIGN §8): NOT_SERVING until the
// worker is joined and allocated (and its group is not broken), SERVING after,
// NOT_SERVING again on Leave and for good on shutdown. Reported under the
// service names "" (the whole server) and "moe_ep.v1.Worker".
//
// Uses gRPC's default health service: call grpc::EnableDefaultHealthCheckService(true)
// before building the server (EnableDefaultHealthService() does that), then
// Attach() the built server's GetHealthCheckService().
//
// Thread-safe.

#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpcpp/health_check_service_interface.h"

namespace moe_ep::server {

// Service names reported: "" and "moe_ep.v1.Worker".
inline constexpr const char* kWorkerServiceName = "moe_ep.v1.Worker";

// Turns on gRPC's default health service for servers built after this call.
void EnableDefaultHealthService();

class HealthReporter {
 public:
  // Starts reporting through `service` too (null is ignored: then only the
  // remembered state changes). Call it once per server that serves health
  // (the control plane, and the plaintext probe port of --health-listen).
  // Applies the current state at once.
  void Attach(grpc::HealthCheckServiceInterface* service);
  // Sets SERVING (true) or NOT_SERVING (false) for both names. Ignored after Shutdown().
  void SetServing(bool serving);
  // NOT_SERVING for good: later SetServing() calls are ignored.
  void Shutdown();
  bool serving() const;

 private:
  void ApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  std::vector<grpc::HealthCheckServiceInterface*> services_ ABSL_GUARDED_BY(mu_);
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace moe_ep::server
