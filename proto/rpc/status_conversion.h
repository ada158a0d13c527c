#pragma once

// Conversion of absl::Status to grpc::Status for every RPC handler of the
// server (STYLE §3: one helper, same numeric codes).

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace moe_ep::rpc {

// ToGrpcStatus()
//
// Returns a grpc::Status with the same canonical code (absl and gRPC share the
// numbering 0..16) and the same message. OK maps to grpc::Status::OK.
// Pure and thread-safe. Source: STYLE §3.
grpc::Status ToGrpcStatus(const absl::Status& status);

}  // namespace moe_ep::rpc
