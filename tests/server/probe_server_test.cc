#include "proto/rpc/probe_server.h"

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "grpcpp/create_channel.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "proto/rpc/health.h"
#include "tests/server/health_probe.h"

namespace moe_ep::server {
namespace {

// Calls `method` with an empty body over a generic stub; the status.
grpc::Status CallGeneric(const std::string& address, const std::string& method) {
  auto channel = grpc::CreateChannel(address, grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  grpc::Slice empty("");
  grpc::ByteBuffer request(&empty, 1);
  grpc::ByteBuffer response;
  grpc::Status status;
  std::mutex mu;
  std::condition_variable done_cv;
  bool done = false;
  stub.UnaryCall(&context, method, grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
    std::lock_guard<std::mutex> lock(mu);
    status = std::move(s);
    done = true;
    done_cv.notify_one();
  });
  std::unique_lock<std::mutex> lock(mu);
  done_cv.wait(lock, [&] { return done; });
  return status;
}

TEST(ProbeServer, ServesHealthAndNotReflectionEvenWithTheReflectionPluginRegistered) {
  // As main.cc does for the main port: the plugin is then process-global.
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  rpc::EnableDefaultHealthService();
  grpc::CallbackGenericService unimplemented;
  int port = 0;
  auto server = rpc::StartProbeServer("127.0.0.1:0", &unimplemented, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  const grpc::Status reflection =
      CallGeneric(address, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo");
  EXPECT_EQ(reflection.error_code(), grpc::StatusCode::UNIMPLEMENTED) << reflection.error_message();
  const grpc::Status worker = CallGeneric(address, "/moe_ep.v1.Worker/GetStatus");
  EXPECT_EQ(worker.error_code(), grpc::StatusCode::UNIMPLEMENTED);
  // Health answers (the default service: "" is SERVING).
  EXPECT_EQ(ProbeHealth(address, ""), kServing);
  (*server)->Shutdown();
}

}  // namespace
}  // namespace moe_ep::server
