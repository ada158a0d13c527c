#include "server/rendezvous_service.h"

#include <chrono>
#include <memory>
#include <thread>

#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

class RendezvousServiceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Rendezvous::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                        grpc::InsecureChannelCredentials()));
  }
  void TearDown() override { server_->Shutdown(); }

  grpc::Status Set(const std::string& key, const std::string& value) {
    grpc::ClientContext ctx;
    v1::SetRequest req;
    req.set_key(key);
    req.set_value(value);
    v1::SetResponse resp;
    return stub_->Set(&ctx, req, &resp);
  }
  grpc::Status Get(const std::string& key, int64_t timeout_ms, std::string* value) {
    grpc::ClientContext ctx;
    v1::GetRequest req;
    req.set_key(key);
    req.set_timeout_ms(timeout_ms);
    v1::GetResponse resp;
    grpc::Status s = stub_->Get(&ctx, req, &resp);
    *value = resp.value();
    return s;
  }

  RendezvousService service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
};

TEST_F(RendezvousServiceTest, SetThenGet) {
  ASSERT_TRUE(Set("gen1/rank_0", std::string("\x01\x00\x02", 3)).ok());
  std::string value;
  ASSERT_TRUE(Get("gen1/rank_0", 0, &value).ok());
  EXPECT_EQ(value, std::string("\x01\x00\x02", 3));
  EXPECT_EQ(service_.NumKeys(), 1);
}

TEST_F(RendezvousServiceTest, SetIsIdempotentForSameValueAndWriteOnce) {
  ASSERT_TRUE(Set("k", "a").ok());
  EXPECT_TRUE(Set("k", "a").ok());
  grpc::Status s = Set("k", "b");
  EXPECT_EQ(s.error_code(), grpc::StatusCode::ALREADY_EXISTS);
  EXPECT_THAT(s.error_message(), HasSubstr("\"k\""));
  std::string value;
  ASSERT_TRUE(Get("k", 0, &value).ok());
  EXPECT_EQ(value, "a");
}

TEST_F(RendezvousServiceTest, GetWaitsForALaterSet) {
  std::thread setter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    EXPECT_TRUE(Set("late", "v").ok());
  });
  std::string value;
  grpc::Status s = Get("late", 5000, &value);
  setter.join();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(value, "v");
}

TEST_F(RendezvousServiceTest, GetTimesOutNamingTheKey) {
  std::string value;
  const auto start = std::chrono::steady_clock::now();
  grpc::Status s = Get("gen2/missing", 150, &value);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("\"gen2/missing\""));
  EXPECT_GE(elapsed, std::chrono::milliseconds(140));
  EXPECT_LT(elapsed, std::chrono::seconds(3));
}

TEST_F(RendezvousServiceTest, GetIsBoundedByTheCallDeadline) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(200));
  v1::GetRequest req;
  req.set_key("never");
  req.set_timeout_ms(60000);
  v1::GetResponse resp;
  const auto start = std::chrono::steady_clock::now();
  grpc::Status s = stub_->Get(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

TEST_F(RendezvousServiceTest, WaitListsMissingKeys) {
  ASSERT_TRUE(Set("a", "1").ok());
  grpc::ClientContext ctx;
  v1::WaitRequest req;
  req.add_keys("a");
  req.add_keys("b");
  req.add_keys("c");
  req.set_timeout_ms(100);
  v1::WaitResponse resp;
  grpc::Status s = stub_->Wait(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_THAT(s.error_message(), HasSubstr("\"b\", \"c\""));
  EXPECT_THAT(s.error_message(), ::testing::Not(HasSubstr("\"a\"")));

  ASSERT_TRUE(Set("b", "2").ok());
  ASSERT_TRUE(Set("c", "3").ok());
  grpc::ClientContext ctx2;
  EXPECT_TRUE(stub_->Wait(&ctx2, req, &resp).ok());
}

TEST_F(RendezvousServiceTest, BadArguments) {
  EXPECT_EQ(Set("", "v").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  std::string value;
  grpc::Status s = Get("k", -1, &value);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("timeout_ms"));
  grpc::ClientContext ctx;
  v1::WaitRequest req;
  req.add_keys("x");
  req.add_keys("");
  v1::WaitResponse resp;
  s = stub_->Wait(&ctx, req, &resp);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("keys[1]"));
  EXPECT_EQ(service_.NumKeys(), 0);
}

}  // namespace
}  // namespace moe_ep::server
