#pragma once

// Counts the calls a gRPC server is running, for the drain on SIGTERM
// (server/main.cc, issue 5 "Graceful shutdown").
//
// Why: grpc::Server::Shutdown(deadline) returns only once every connection is
// gone, not merely every call. An idle client (a coordinator waiting for its
// user, a peer worker) reads the server's GOAWAY only when it next polls, so a
// worker with no call in flight still waited out its whole drain deadline.
// main.cc therefore waits for this count to reach 0 (or the drain deadline)
// and then calls Shutdown(now), which closes the idle connections at once.
//
// A call counts from the moment gRPC creates its interceptors (the method is
// known, before the handler runs) until they are destroyed (status sent).
// Methods named in `uncounted_methods` never count: a grpc.health.v1 Watch
// stays open for as long as its client (every coordinator keeps one on every
// worker) and does no work, so it must not hold the drain; Shutdown(now)
// ends it (issue 31 item 3).
//
// Thread-safe. Source: gRPC 1.51 src/core/lib/surface/server.cc
// (MaybeFinishShutdown waits for channels_ to empty).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"

namespace moe_ep::server {

class InFlightCalls {
 public:
  // `uncounted_methods`: full method names ("/grpc.health.v1.Health/Watch")
  // whose calls are not counted.
  explicit InFlightCalls(std::vector<std::string> uncounted_methods = {});

  // For grpc::ServerBuilder::experimental().SetInterceptorCreators(); the
  // factory refers to this object, which must outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeInterceptorFactory();

  // Calls running now.
  int64_t count() const;
  // Blocks until no call runs or `deadline` passes; true when none runs.
  bool WaitIdle(absl::Time deadline) const;

 private:
  class Interceptor;
  class Factory;
  void Add(int64_t delta);
  bool Counted(const char* method) const;
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::vector<std::string> uncounted_methods_;
  mutable absl::Mutex mu_;
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe_ep::server
