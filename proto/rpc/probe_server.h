#pragma once

// The plaintext --health-listen port (issue 13 item 8): a gRPC server that
// serves grpc.health.v1 and nothing else. gRPC's server reflection plugin is
// process-global (registered at static initialization of the reflection
// library, and by InitProtoReflectionServerBuilderPlugin), so every
// ServerBuilder would add reflection: this one drops every builder plugin
// before it starts. Every other method answers UNIMPLEMENTED. Source: DESIGN
// §8, §12; issue 8, issue 13.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"

namespace moe_ep::rpc {

// StartProbeServer()
//
// Binds `listen` (host:port; port 0 picks one, written to `*port`) without
// TLS and serves the default health service (EnableDefaultHealthService()
// of proto/rpc/health.h must have run) and `unimplemented` (a callback service
// that answers UNIMPLEMENTED; it makes gRPC poll the server's completion
// queue, and must outlive the server). Attach the server's
// GetHealthCheckService() to a HealthReporter. UNAVAILABLE when the address
// cannot be bound. Thread-compatible (call from main).
absl::StatusOr<std::unique_ptr<grpc::Server>> StartProbeServer(
    const std::string& listen, grpc::CallbackGenericService* unimplemented, int* port);

}  // namespace moe_ep::rpc
