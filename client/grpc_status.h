#pragma once

// Conversion of gRPC call results into absl::Status. The canonical codes have
// the same numbers in both libraries; the message is kept as is.

#include "absl/status/status.h"
#include "grpcpp/support/status.h"

namespace moe_ep::client {

// Returns the absl::Status with the same code and message as `status`
// (OK -> OkStatus()).
absl::Status ToAbslStatus(const grpc::Status& status);

}  // namespace moe_ep::client
