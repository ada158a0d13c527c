#pragma once

// grpc.health.v1 reporting for the worker (DESIGN §8, §12; issue 8). Two
// service names, for the two questions a probe asks:
//
//   kLivenessServiceName ("")      SERVING from start-up while the process
//                                  serves; NOT_SERVING for good on shutdown
//                                  (SIGTERM drain). For liveness and startup
//                                  probes: a worker waiting to be joined, or
//                                  whose group broke, is alive and must not
//                                  be restarted.
//   kReadinessServiceName          SERVING only while the worker is joined,
//   ("moe_ep.v1.Worker")           allocated and its group is not broken;
//                                  NOT_SERVING otherwise. For readiness
//                                  probes and for coordinators that Watch.
//
// Uses gRPC's default health service: call EnableDefaultHealthService()
// before building the server, then Attach() the built server's
// GetHealthCheckService().
//
// Lock order: the default service holds its own mutex while it writes to
// Watch streams, and a stream that ends runs the server's interceptors under
// the stream's mutex. So nothing that holds a lock of this process may be
// taken from an interceptor (server/metrics.h keeps that rule), and this
// reporter calls into gRPC under its own mutex only, which is never taken
// from gRPC's threads. Abseil's deadlock detector checks this order in tests.
//
// Thread-safe.

#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "grpcpp/health_check_service_interface.h"

namespace moe_ep::rpc {

inline constexpr const char* kLivenessServiceName = "";
inline constexpr const char* kReadinessServiceName = "moe_ep.v1.Worker";
// The readiness name under its older spelling in this codebase.
inline constexpr const char* kWorkerServiceName = kReadinessServiceName;
// The full method name of grpc.health.v1's streaming Watch: a call that
// stays open while its client watches, so the drain on SIGTERM does not wait
// for it (server/in_flight_calls.h); the servers' Shutdown ends it, after
// HealthReporter::Shutdown() has pushed NOT_SERVING into it.
inline constexpr const char* kHealthWatchMethod = "/grpc.health.v1.Health/Watch";

// Turns on gRPC's default health service for servers built after this call.
void EnableDefaultHealthService();

class HealthReporter {
 public:
  // Starts reporting through `service` too (null is ignored: then only the
  // remembered state changes). Call it once per server that serves health
  // (the control plane, and the plaintext probe port of --health-listen).
  // Applies the current state at once: liveness SERVING unless shut down,
  // readiness as last set.
  void Attach(grpc::HealthCheckServiceInterface* service);
  // Sets readiness SERVING (true) or NOT_SERVING (false). Liveness is not
  // affected. Ignored after Shutdown().
  void SetReady(bool ready);
  // Both names NOT_SERVING for good: later SetReady() calls are ignored.
  void Shutdown();
  // The readiness last set (false after Shutdown()).
  bool ready() const;
  // True until Shutdown().
  bool live() const;

 private:
  void ApplyLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable absl::Mutex mu_;
  std::vector<grpc::HealthCheckServiceInterface*> services_ ABSL_GUARDED_BY(mu_);
  bool ready_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace moe_ep::rpc
