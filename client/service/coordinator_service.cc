#include "client/service/coordinator_service.h"

#include "proto/rpc/status_conversion.h"

namespace moe_ep::client {

grpc::Status CoordinatorService::GetGroup(grpc::ServerContext*, const v1::GetGroupRequest*,
                                          v1::GetGroupResponse* response) {
  *response = keeper_->Snapshot();
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Apply(grpc::ServerContext*, const v1::ApplyRequest* request,
                                       v1::ApplyResponse* response) {
  absl::StatusOr<v1::ApplyResponse> applied = keeper_->Apply(request->desired());
  if (!applied.ok()) return rpc::ToGrpcStatus(applied.status());
  *response = *applied;
  return grpc::Status::OK;
}

grpc::Status CoordinatorService::Drain(grpc::ServerContext*, const v1::DrainRequest*,
                                       v1::DrainResponse* response) {
  *response = keeper_->Drain();
  return grpc::Status::OK;
}

}  // namespace moe_ep::client
