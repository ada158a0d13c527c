#include "server/rendezvous_service.h"

#include <chrono>
#include <memory>
#include <thread>
#include <vector>

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

// Rendezvous.Arrive (issue 29; core/arrival_board.h is the board's own test).
v1::ArriveRequest ArriveOf(const std::string& round, int rank, int64_t timeout_ms,
                           std::vector<int> members = {0, 1}) {
  v1::ArriveRequest request;
  request.set_round(round);
  request.set_rank(rank);
  request.mutable_members()->Assign(members.begin(), members.end());
  request.set_timeout_ms(timeout_ms);
  return request;
}

grpc::Status Arrive(v1::Rendezvous::Stub& stub, const v1::ArriveRequest& request,
                    v1::ArriveResponse* response, const std::string& secret = "") {
  grpc::ClientContext ctx;
  if (!secret.empty()) ctx.AddMetadata(kSecretMetadataKey, secret);
  return stub.Arrive(&ctx, request, response);
}

TEST_F(RendezvousServiceTest, ArriveCompletesWhenBothRanksComeAndRefusalEndsAPeer) {
  v1::ArriveResponse first;
  std::thread rank0(
      [&] { ASSERT_TRUE(Arrive(*stub_, ArriveOf("gen1/arrive/0/0", 0, 5000), &first).ok()); });
  v1::ArriveResponse second;
  ASSERT_TRUE(Arrive(*stub_, ArriveOf("gen1/arrive/0/0", 1, 5000), &second).ok());
  rank0.join();
  EXPECT_TRUE(first.complete());
  EXPECT_TRUE(second.complete());
  // The next call: rank 1 refuses its request, rank 0 is told so.
  v1::ArriveRequest refuse = ArriveOf("gen1/arrive/0/1", 1, 0);
  refuse.set_action(v1::ArriveRequest::ACTION_REFUSE);
  refuse.set_refusal("INVALID_ARGUMENT: top_k: expected >= 1, got 0");
  refuse.set_refusal_ttl_ms(2000);
  v1::ArriveResponse ignored;
  ASSERT_TRUE(Arrive(*stub_, refuse, &ignored).ok());
  v1::ArriveResponse peer;
  ASSERT_TRUE(Arrive(*stub_, ArriveOf("gen1/arrive/0/1", 0, 2000), &peer).ok());
  EXPECT_FALSE(peer.complete());
  EXPECT_EQ(peer.refused_rank(), 1);
  EXPECT_EQ(peer.refusal(), "INVALID_ARGUMENT: top_k: expected >= 1, got 0");
  // A lone arrival answers the missing rank, and withdraws.
  v1::ArriveResponse alone;
  ASSERT_TRUE(Arrive(*stub_, ArriveOf("gen1/arrive/0/2", 0, 20), &alone).ok());
  EXPECT_FALSE(alone.complete());
  EXPECT_THAT(std::vector<int>(alone.missing().begin(), alone.missing().end()),
              ::testing::ElementsAre(1));
  v1::ArriveRequest withdraw = ArriveOf("gen1/arrive/0/2", 0, 0);
  withdraw.set_action(v1::ArriveRequest::ACTION_WITHDRAW);
  ASSERT_TRUE(Arrive(*stub_, withdraw, &alone).ok());
  EXPECT_FALSE(alone.complete());
}

TEST_F(RendezvousServiceTest, ArriveRejectsBadArguments) {
  v1::ArriveResponse response;
  EXPECT_EQ(Arrive(*stub_, ArriveOf("", 0, 0), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Arrive(*stub_, ArriveOf("gen1/a", -1, 0), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Arrive(*stub_, ArriveOf("gen1/a", 0, 0, {}), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Arrive(*stub_, ArriveOf("gen1/a", 0, 0, {0, 70000}), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Arrive(*stub_, ArriveOf("gen1/a", 0, -5), &response).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  const grpc::Status not_member = Arrive(*stub_, ArriveOf("gen1/a", 2, 0), &response);
  EXPECT_EQ(not_member.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(not_member.error_message(), HasSubstr("arriving rank 2"));
}

}  // namespace
}  // namespace moe_ep::server

// ------------------------------------------------ limits and writers (issue 13 item 10)

namespace moe_ep::server {
namespace {

class LimitedStoreTest : public ::testing::Test {
 protected:
  void Start(StoreLimits limits) {
    service_ = std::make_unique<RendezvousService>(limits);
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(service_.get());
    server_ = builder.BuildAndStart();
    ASSERT_NE(server_, nullptr);
    stub_ = v1::Rendezvous::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                        grpc::InsecureChannelCredentials()));
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }
  grpc::Status Set(const std::string& key, const std::string& value,
                   const std::string& secret = "") {
    grpc::ClientContext ctx;
    if (!secret.empty()) ctx.AddMetadata(kSecretMetadataKey, secret);
    v1::SetRequest req;
    req.set_key(key);
    req.set_value(value);
    v1::SetResponse resp;
    return stub_->Set(&ctx, req, &resp);
  }
  std::unique_ptr<RendezvousService> service_;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Rendezvous::Stub> stub_;
};

TEST_F(LimitedStoreTest, KeyValueCountAndByteLimits) {
  StoreLimits limits;
  limits.max_key_bytes = 16;
  limits.max_value_bytes = 100;
  limits.max_keys = 3;
  limits.max_total_bytes = 150;
  Start(limits);
  EXPECT_EQ(Set(std::string(17, 'k'), "v").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Set("gen1/a", std::string(101, 'v')).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(Set("gen1/a", std::string(94, 'v')).ok());          // 100 bytes
  const grpc::Status full = Set("gen1/b", std::string(50, 'v'));  // 156 > 150
  EXPECT_EQ(full.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(full.error_message(), HasSubstr("--store-max-bytes"));
  ASSERT_TRUE(Set("gen1/b", "1").ok());
  ASSERT_TRUE(Set("gen1/c", "1").ok());
  EXPECT_EQ(Set("gen1/d", "1").error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_EQ(service_->NumKeys(), 3);
  EXPECT_EQ(service_->StoredBytes(), 100 + 7 + 7);
}

TEST_F(LimitedStoreTest, AWaitOnManyMissingKeysIsShortAndLeavesOtherCallsAlone) {
  StoreLimits limits;
  limits.max_wait_keys = 20000;
  Start(limits);
  v1::WaitRequest wait;
  for (int i = 0; i < 10000; ++i) wait.add_keys("gen1/missing_key_number_" + std::to_string(i));
  wait.set_timeout_ms(0);
  grpc::ClientContext ctx;
  v1::WaitResponse resp;
  // Before: a ~300 KB message, RESOURCE_EXHAUSTED on the wire.
  const grpc::Status status = stub_->Wait(&ctx, wait, &resp);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_LT(status.error_message().size(), 1024u);
  EXPECT_THAT(status.error_message(), HasSubstr("10000 key(s)"));
  EXPECT_THAT(status.error_message(), HasSubstr("and 9992 more"));
  EXPECT_TRUE(Set("gen1/after", "x").ok());
}

TEST_F(LimitedStoreTest, AWaitNamingTooManyKeysIsInvalidArgument) {
  StoreLimits limits;
  limits.max_wait_keys = 4;
  Start(limits);
  v1::WaitRequest wait;
  for (int i = 0; i < 5; ++i) wait.add_keys("k" + std::to_string(i));
  grpc::ClientContext ctx;
  v1::WaitResponse resp;
  EXPECT_EQ(stub_->Wait(&ctx, wait, &resp).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(LimitedStoreTest, OnlyTheOpenGenerationWithItsSecretIsWritable) {
  StoreLimits limits;
  limits.require_open_generation = true;
  Start(limits);
  // Nothing opened: a future generation's keys cannot be planted.
  EXPECT_EQ(Set("gen7/rank_0", "evil").error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(Set("no_prefix", "x").error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  service_->OpenGeneration(7, "s3cret");
  EXPECT_EQ(Set("gen7/rank_0", "evil").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_EQ(Set("gen7/rank_0", "evil", "wrong!").error_code(), grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Set("gen7/rank_0", "good", "s3cret").ok());
  EXPECT_EQ(Set("gen8/rank_0", "x", "s3cret").error_code(), grpc::StatusCode::UNAVAILABLE);
  service_->OpenGeneration(8, "");
  EXPECT_EQ(Set("gen7/rank_1", "x", "s3cret").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Set("gen8/rank_0", "x").ok());
  EXPECT_EQ(service_->NumKeys(), 2);
}

TEST_F(LimitedStoreTest, OlderGenerationsAreFreedOnceANewerOneFormed) {
  Start(StoreLimits{});
  ASSERT_TRUE(Set("gen1/a", "1111").ok());
  ASSERT_TRUE(Set("gen2/a", "2222").ok());
  ASSERT_TRUE(Set("gen10/a", "x").ok());
  ASSERT_TRUE(Set("other", "y").ok());
  service_->DropGenerationsBelow(3);
  EXPECT_EQ(service_->NumKeys(), 2);
  EXPECT_EQ(service_->StoredBytes(), 7 + 1 + 5 + 1);
  EXPECT_EQ(GenerationOfKey("gen10/a"), 10);
  EXPECT_EQ(GenerationOfKey("gen/a"), -1);
  EXPECT_EQ(GenerationOfKey("genx/a"), -1);
}

// Rendezvous.Arrive on a store that checks its writers (issue 29; ArriveOf
// and Arrive above).
TEST_F(LimitedStoreTest, ArriveNeedsAnOpenedGenerationWithItsSecretAndOutlivesAFailedNewerJoin) {
  StoreLimits limits;
  limits.require_open_generation = true;
  Start(limits);
  v1::ArriveResponse response;
  EXPECT_EQ(Arrive(*stub_, ArriveOf("gen1/arrive/0/0", 0, 0), &response).error_code(),
            grpc::StatusCode::UNAVAILABLE);
  service_->OpenGeneration(1, "one");
  EXPECT_EQ(Arrive(*stub_, ArriveOf("gen1/arrive/0/0", 0, 0), &response).error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  EXPECT_TRUE(Arrive(*stub_, ArriveOf("gen1/arrive/0/0", 0, 0), &response, "one").ok());
  // A Join of generation 2 opened it and then failed: generation 1 is still
  // the group in force, and its calls still meet here (Set of gen1 does not).
  service_->OpenGeneration(2, "two");
  EXPECT_EQ(Set("gen1/x", "v", "one").error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_TRUE(Arrive(*stub_, ArriveOf("gen1/arrive/0/0", 0, 0), &response, "one").ok());
  EXPECT_EQ(Arrive(*stub_, ArriveOf("gen2/arrive/0/0", 0, 0), &response, "one").error_code(),
            grpc::StatusCode::PERMISSION_DENIED);
  // Generation 2 formed: generation 1 is dropped.
  service_->DropGenerationsBelow(2);
  const grpc::Status closed = Arrive(*stub_, ArriveOf("gen1/arrive/0/1", 0, 0), &response, "one");
  EXPECT_EQ(closed.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(closed.error_message(), HasSubstr("generation 1 is closed"));
}

}  // namespace
}  // namespace moe_ep::server
