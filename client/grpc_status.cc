#include "client/grpc_status.h"

#include <string>

namespace moe_ep::client {

absl::Status ToAbslStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  const int code = static_cast<int>(status.error_code());
  // grpc::StatusCode and absl::StatusCode share the canonical numbering 1..16;
  // anything else cannot come from a conforming peer.
  if (code < 1 || code > 16) {
    return absl::UnknownError(std::string("gRPC status code ") + std::to_string(code) + ": " +
                              status.error_message());
  }
  return absl::Status(static_cast<absl::StatusCode>(code), status.error_message());
}

}  // namespace moe_ep::client
