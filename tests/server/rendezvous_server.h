#pragma once

// A Rendezvous service (server/rendezvous_service.h) on a loopback port the
// OS picks, for tests that need a real store: GrpcStore's own tests and
// mask rounds, where every rank serves one. Shut down on destruction.

#include <memory>
#include <string>

#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/rendezvous_service.h"

namespace moe_ep::server::testing {

struct RendezvousServer {
  explicit RendezvousServer(const std::string& address = "127.0.0.1:0") {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(address, grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  ~RendezvousServer() {
    if (server) server->Shutdown();
  }
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  std::string address() const { return "127.0.0.1:" + std::to_string(port); }

  RendezvousService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

}  // namespace moe_ep::server::testing
