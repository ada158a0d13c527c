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
//
// Thread-safe. Source: gRPC 1.51 src/core/lib/surface/server.cc
// (MaybeFinishShutdown waits for channels_ to empty).

#include <cstdint>
#include <memory>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "grpcpp/support/server_interceptor.h"

namespace moe_ep::server {

class InFlightCalls {
 public:
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
  bool IdleLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  int64_t count_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace moe_ep::server
