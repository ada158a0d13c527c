#include "proto/rpc/health.h"

#include <memory>
#include <string>

#include "grpcpp/create_channel.h"
#include "grpcpp/generic/generic_stub.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/rendezvous_service.h"
#include "tests/server/health_probe.h"

namespace moe_ep::server {
namespace {

TEST(HealthReporter, LivenessServesWhileReadinessFollowsTheGroupAndShutdownEndsBoth) {
  rpc::EnableDefaultHealthService();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  RendezvousService some_service;  // a server needs at least one service
  builder.RegisterService(&some_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  rpc::HealthReporter health;
  health.Attach(server->GetHealthCheckService());
  EXPECT_TRUE(health.live());
  EXPECT_FALSE(health.ready());
  EXPECT_EQ(ProbeHealth(address, rpc::kLivenessServiceName), kServing);
  EXPECT_EQ(ProbeHealth(address, rpc::kReadinessServiceName), kNotServing);

  health.SetReady(true);
  EXPECT_TRUE(health.ready());
  EXPECT_EQ(ProbeHealth(address, rpc::kLivenessServiceName), kServing);
  EXPECT_EQ(ProbeHealth(address, rpc::kReadinessServiceName), kServing);

  health.SetReady(false);  // e.g. the group broke: still alive
  EXPECT_EQ(ProbeHealth(address, rpc::kLivenessServiceName), kServing);
  EXPECT_EQ(ProbeHealth(address, rpc::kReadinessServiceName), kNotServing);

  health.SetReady(true);
  health.Shutdown();
  health.SetReady(true);  // ignored after Shutdown
  EXPECT_FALSE(health.ready());
  EXPECT_FALSE(health.live());
  EXPECT_EQ(ProbeHealth(address, rpc::kLivenessServiceName), kNotServing);
  EXPECT_EQ(ProbeHealth(address, rpc::kReadinessServiceName), kNotServing);
  server->Shutdown();
}

TEST(HealthReporter, RemembersReadinessUntilAttached) {
  rpc::HealthReporter health;
  health.SetReady(true);
  EXPECT_TRUE(health.ready());
  health.Attach(nullptr);
  EXPECT_TRUE(health.ready());
}

TEST(HealthReporter, ServerAttachedAfterShutdownReportsNotServing) {
  rpc::EnableDefaultHealthService();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  RendezvousService some_service;
  builder.RegisterService(&some_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  rpc::HealthReporter health;
  health.SetReady(true);
  health.Shutdown();
  health.Attach(server->GetHealthCheckService());
  const std::string address = "127.0.0.1:" + std::to_string(port);
  EXPECT_EQ(ProbeHealth(address, rpc::kLivenessServiceName), kNotServing);
  EXPECT_EQ(ProbeHealth(address, rpc::kReadinessServiceName), kNotServing);
  server->Shutdown();
}

}  // namespace
}  // namespace moe_ep::server
