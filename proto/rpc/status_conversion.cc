#include "proto/rpc/status_conversion.h"

#include <string>

namespace moe_ep::rpc {

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.raw_code()),
                      std::string(status.message()));
}

}  // namespace moe_ep::rpc
