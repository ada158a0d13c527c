#include "proto/rpc/rpc_log.h"

#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/str_split.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/rendezvous.grpc.pb.h"
#include "server/rendezvous_service.h"
#include "spdlog/sinks/ostream_sink.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;
using ::testing::MatchesRegex;

// A Rendezvous server with the RPC log: its failures warn, Set is info.
// spdlog's default logger writes "<level> <message>" lines into `log` while
// the test runs (trace: every line).
class RpcLogTest : public ::testing::Test {
 protected:
  void SetUp() override {
    previous_ = spdlog::default_logger();
    auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log_);
    sink->set_pattern("%l %v");
    auto logger = std::make_shared<spdlog::logger>("rpc-log-test", sink);
    logger->set_level(spdlog::level::trace);
    spdlog::set_default_logger(logger);

    rpc::RpcLogOptions options;
    options.warn_prefixes = {"/moe_ep.v1.Rendezvous/"};
    options.info_methods = {"/moe_ep.v1.Rendezvous/Set"};
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&rendezvous_);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(rpc::MakeRpcLogInterceptorFactory(options));
    builder.experimental().SetInterceptorCreators(std::move(creators));
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Rendezvous::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                        grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now());
    spdlog::set_default_logger(previous_);
  }

  // The log lines written so far.
  std::vector<std::string> Lines() {
    spdlog::default_logger()->flush();
    return absl::StrSplit(log_.str(), '\n', absl::SkipEmpty());
  }

  std::ostringstream log_;
  std::shared_ptr<spdlog::logger> previous_;
  RendezvousService rendezvous_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
};

TEST_F(RpcLogTest, AFailedCallWarnsOnceWithItsCodeTheCallerAndTheMessage) {
  grpc::ClientContext context;
  v1::GetRequest request;
  request.set_key("missing");
  request.set_timeout_ms(0);
  v1::GetResponse response;
  const grpc::Status status = stub_->Get(&context, request, &response);
  ASSERT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  const std::vector<std::string> lines = Lines();
  ASSERT_EQ(lines.size(), 1u) << log_.str();
  EXPECT_THAT(lines[0],
              MatchesRegex("warning /moe_ep.v1.Rendezvous/Get from ipv4:127.0.0.1:[0-9]+ failed "
                           "after [0-9.]+ ms: DEADLINE_EXCEEDED: .+"));
  EXPECT_THAT(lines[0], HasSubstr(status.error_message()));
}

TEST_F(RpcLogTest, AStateChangeIsInfoAndOtherCallsDebug) {
  {
    grpc::ClientContext context;
    v1::SetRequest request;
    request.set_key("gen1/k");
    request.set_value("v");
    v1::SetResponse response;
    ASSERT_TRUE(stub_->Set(&context, request, &response).ok());
  }
  {
    grpc::ClientContext context;
    v1::GetRequest request;
    request.set_key("gen1/k");
    v1::GetResponse response;
    ASSERT_TRUE(stub_->Get(&context, request, &response).ok());
    EXPECT_EQ(response.value(), "v");
  }
  const std::vector<std::string> lines = Lines();
  ASSERT_EQ(lines.size(), 2u) << log_.str();
  EXPECT_THAT(lines[0], MatchesRegex("info /moe_ep.v1.Rendezvous/Set from ipv4:127.0.0.1:[0-9]+: "
                                     "OK in [0-9.]+ ms"));
  EXPECT_THAT(lines[1], MatchesRegex("debug /moe_ep.v1.Rendezvous/Get from ipv4:127.0.0.1:[0-9]+: "
                                     "OK in [0-9.]+ ms"));
}

TEST(WorkerRpcLogOptions, WarnsOnWorkerFailuresAndLogsItsStateChangesAtInfo) {
  const rpc::RpcLogOptions o = rpc::WorkerRpcLogOptions();
  EXPECT_EQ(o.warn_prefixes, std::vector<std::string>{"/moe_ep.v1.Worker/"});
  EXPECT_THAT(o.info_methods, ::testing::Contains("/moe_ep.v1.Worker/Join"));
  EXPECT_THAT(o.info_methods, ::testing::Contains("/moe_ep.v1.Worker/LoadExperts"));
  EXPECT_THAT(o.info_methods, ::testing::Not(::testing::Contains("/moe_ep.v1.Worker/Forward")));
  EXPECT_THAT(o.info_methods, ::testing::Not(::testing::Contains("/moe_ep.v1.Worker/Lease")));
}

}  // namespace
}  // namespace moe_ep::server
