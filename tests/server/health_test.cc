#include "server/health.h"

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

TEST(HealthReporter, ReportsBothNamesAndStaysDownAfterShutdown) {
  EnableDefaultHealthService();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  RendezvousService some_service;  // a server needs at least one service
  builder.RegisterService(&some_service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);
  const std::string address = "127.0.0.1:" + std::to_string(port);

  HealthReporter health;
  health.Attach(server->GetHealthCheckService());
  EXPECT_FALSE(health.serving());
  EXPECT_EQ(ProbeHealth(address, ""), kNotServing);
  EXPECT_EQ(ProbeHealth(address, kWorkerServiceName), kNotServing);

  health.SetServing(true);
  EXPECT_TRUE(health.serving());
  EXPECT_EQ(ProbeHealth(address, ""), kServing);
  EXPECT_EQ(ProbeHealth(address, kWorkerServiceName), kServing);

  health.Shutdown();
  health.SetServing(true);  // ignored after Shutdown
  EXPECT_FALSE(health.serving());
  EXPECT_EQ(ProbeHealth(address, ""), kNotServing);
  EXPECT_EQ(ProbeHealth(address, kWorkerServiceName), kNotServing);
  server->Shutdown();
}

TEST(HealthReporter, RemembersStateUntilAttached) {
  HealthReporter health;
  health.SetServing(true);
  EXPECT_TRUE(health.serving());
  health.Attach(nullptr);
  EXPECT_TRUE(health.serving());
}

}  // namespace
}  // namespace moe_ep::server
