#pragma once

// Server reflection v1 (grpc.reflection.v1) beside Debian's v1alpha (issue 9
// item 7). Debian 12's grpc++_reflection serves only
// grpc.reflection.v1alpha.ServerReflection, and clients that default to v1
// (grpc-js-reflection-client, newer grpcurl) fail against it. The v1 and
// v1alpha messages are wire-identical, so this service relays each v1 stream,
// message by message, to the server's own v1alpha service over an in-process
// channel and relays its answers back (status included).
//
// It is a generic service: every method the server's typed services do not
// have reaches it, and all but
// /grpc.reflection.v1.ServerReflection/ServerReflectionInfo get UNIMPLEMENTED
// (as without it). v1's list_services answer is v1alpha's: the typed
// services, v1alpha reflection among them (a generic service is not listed).
// Register it on the control-plane server only, never on the plaintext probe
// port (that one serves health alone: issue 13 item 8).
//
// Thread-safe: gRPC calls CreateReactor from its threads; Attach() once after
// BuildAndStart(). Source: issue 9 item 7; grpc/grpc
// src/proto/grpc/reflection/v1/reflection.proto.

#include <memory>
#include <string>

#include "absl/synchronization/mutex.h"
#include "grpcpp/channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/server.h"

namespace moe_ep::server {

// The full method name this service answers.
inline constexpr char kReflectionV1Method[] =
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo";

class ReflectionV1Service : public grpc::CallbackGenericService {
 public:
  // Relays v1 calls to `server`'s v1alpha reflection service (the reflection
  // plugin must have been enabled before `server` was built). Before Attach(),
  // v1 calls get UNAVAILABLE "starting".
  void Attach(grpc::Server* server);

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext* ctx) override;

 private:
  absl::Mutex mu_;
  std::shared_ptr<grpc::Channel> in_process_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe_ep::server
