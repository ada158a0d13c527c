#pragma once

// moe_ep.v1.Coordinator over a GroupKeeper (client/group_keeper.h): decode,
// call the keeper, encode. Source: proto/moe_ep/v1/coordinator.proto, DESIGN §16.
//
// Thread-safe (the keeper is).

#include "client/group_keeper.h"
#include "moe_ep/v1/coordinator.grpc.pb.h"

namespace moe_ep::client {

class CoordinatorService final : public v1::Coordinator::Service {
 public:
  // `keeper` must outlive the service.
  explicit CoordinatorService(GroupKeeper* keeper) : keeper_(keeper) {}

  grpc::Status GetGroup(grpc::ServerContext* context, const v1::GetGroupRequest* request,
                        v1::GetGroupResponse* response) override;
  // INVALID_ARGUMENT (GroupKeeper::Apply) when the state is invalid.
  grpc::Status Apply(grpc::ServerContext* context, const v1::ApplyRequest* request,
                     v1::ApplyResponse* response) override;
  grpc::Status Drain(grpc::ServerContext* context, const v1::DrainRequest* request,
                     v1::DrainResponse* response) override;

 private:
  GroupKeeper* const keeper_;
};

}  // namespace moe_ep::client
