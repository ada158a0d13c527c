#include "client/health_command.h"

#include <memory>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/health_check_service_interface.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

// A server with only gRPC's default health service (and a generic callback
// service so it has something to poll).
class HealthServer {
 public:
  HealthServer() {
    grpc::EnableDefaultHealthCheckService(true);
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterCallbackGenericService(&generic_);
    server_ = builder.BuildAndStart();
  }
  ~HealthServer() { server_->Shutdown(); }
  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  grpc::HealthCheckServiceInterface* health() { return server_->GetHealthCheckService(); }

 private:
  int port_ = 0;
  grpc::CallbackGenericService generic_;
  std::unique_ptr<grpc::Server> server_;
};

TEST(HealthCommand, ServingIsOkAndPrintsTheStatus) {
  HealthServer server;
  server.health()->SetServingStatus("moe_ep.v1.Worker", true);
  HealthCommandOptions options;
  options.target = server.address();
  options.service = "moe_ep.v1.Worker";
  std::ostringstream out;
  EXPECT_TRUE(RunHealthCommand(options, out).ok());
  EXPECT_EQ(out.str(), server.address() + " service \"moe_ep.v1.Worker\" SERVING\n");
  // "" (liveness) is SERVING by default in gRPC's service.
  options.service = "";
  EXPECT_TRUE(RunHealthCommand(options, out).ok());
}

TEST(HealthCommand, NotServingFailsWithUnavailable) {
  HealthServer server;
  server.health()->SetServingStatus("moe_ep.v1.Worker", false);
  HealthCommandOptions options;
  options.target = server.address();
  options.service = "moe_ep.v1.Worker";
  std::ostringstream out;
  const absl::Status status = RunHealthCommand(options, out);
  EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(status.message(), HasSubstr("is NOT_SERVING"));
  EXPECT_THAT(out.str(), HasSubstr("NOT_SERVING"));
}

TEST(HealthCommand, UnknownServiceIsNotFound) {
  HealthServer server;
  HealthCommandOptions options;
  options.target = server.address();
  options.service = "no.such.Service";
  std::ostringstream out;
  const absl::Status status = RunHealthCommand(options, out);
  EXPECT_EQ(status.code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(status.message(), HasSubstr("no.such.Service"));
}

TEST(HealthCommand, BadOptionsAreRefusedBeforeAnyCall) {
  HealthCommandOptions options;
  std::ostringstream out;
  EXPECT_EQ(RunHealthCommand(options, out).code(), absl::StatusCode::kInvalidArgument);
  options.target = "127.0.0.1:1";
  options.timeout = absl::ZeroDuration();
  EXPECT_EQ(RunHealthCommand(options, out).code(), absl::StatusCode::kInvalidArgument);
}

TEST(HealthCommand, NoServerFailsWithinTheTimeout) {
  HealthCommandOptions options;
  options.target = "127.0.0.1:1";  // nothing listens on port 1
  options.timeout = absl::Milliseconds(500);
  std::ostringstream out;
  const absl::Status status = RunHealthCommand(options, out);
  EXPECT_TRUE(status.code() == absl::StatusCode::kUnavailable ||
              status.code() == absl::StatusCode::kDeadlineExceeded)
      << status;
  EXPECT_THAT(status.message(), HasSubstr("127.0.0.1:1"));
}

}  // namespace
}  // namespace moe_ep::client
