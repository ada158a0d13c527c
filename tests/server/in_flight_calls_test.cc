#include "server/in_flight_calls.h"

#include <algorithm>
#include <atomic>
#include <thread>

#include "absl/time/clock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/rendezvous.grpc.pb.h"
#include "server/rendezvous_service.h"

namespace moe_ep::server {
namespace {

// A Rendezvous server counting its calls; a Get of a missing key blocks for
// its timeout_ms, which makes a call that stays in flight for a known time.
struct CountedServer {
  explicit CountedServer(std::vector<std::string> uncounted = {}) : calls(std::move(uncounted)) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&rendezvous);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
    creators.push_back(calls.MakeInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(creators));
    server = builder.BuildAndStart();
    stub = v1::Rendezvous::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                       grpc::InsecureChannelCredentials()));
  }
  ~CountedServer() { server->Shutdown(std::chrono::system_clock::now()); }
  grpc::Status Get(const std::string& key, int64_t timeout_ms) {
    grpc::ClientContext context;
    v1::GetRequest request;
    request.set_key(key);
    request.set_timeout_ms(timeout_ms);
    v1::GetResponse response;
    return stub->Get(&context, request, &response);
  }

  InFlightCalls calls;
  RendezvousService rendezvous;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<v1::Rendezvous::Stub> stub;
};

TEST(InFlightCalls, IdleServerCountsZeroAndWaitIdleReturnsAtOnce) {
  CountedServer s;
  EXPECT_EQ(s.calls.count(), 0);
  const absl::Time start = absl::Now();
  EXPECT_TRUE(s.calls.WaitIdle(start + absl::Seconds(5)));
  EXPECT_LT(absl::Now() - start, absl::Milliseconds(100));
  // A finished call leaves the count at 0.
  EXPECT_EQ(s.Get("missing", 0).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_TRUE(s.calls.WaitIdle(absl::Now() + absl::Seconds(1)));
  EXPECT_EQ(s.calls.count(), 0);
}

TEST(InFlightCalls, CountsARunningCallUntilItsStatusIsSent) {
  CountedServer s;
  std::thread caller([&] { (void)s.Get("never-set", 800); });
  // The call is counted while its handler waits for the key.
  const absl::Time until = absl::Now() + absl::Seconds(5);
  while (s.calls.count() == 0 && absl::Now() < until) absl::SleepFor(absl::Milliseconds(5));
  EXPECT_EQ(s.calls.count(), 1);
  EXPECT_FALSE(s.calls.WaitIdle(absl::Now() + absl::Milliseconds(50)));
  // ... and not after the handler answered DEADLINE_EXCEEDED.
  EXPECT_TRUE(s.calls.WaitIdle(absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(s.calls.count(), 0);
  caller.join();
}

// An uncounted method (the worker's health Watch, issue 31 item 3) never
// holds WaitIdle, while the others still count.
TEST(InFlightCalls, UncountedMethodsDoNotCount) {
  CountedServer s({"/moe_ep.v1.Rendezvous/Get"});
  std::atomic<bool> done{false};
  grpc::StatusCode code = grpc::StatusCode::OK;
  const absl::Time start = absl::Now();
  std::thread caller([&] {
    code = s.Get("never-set", 800).error_code();
    done = true;
  });
  int64_t most = 0;
  while (!done) {  // the whole time the Get waits in its handler
    most = std::max(most, s.calls.count());
    EXPECT_TRUE(s.calls.WaitIdle(absl::Now()));
    absl::SleepFor(absl::Milliseconds(5));
  }
  caller.join();
  EXPECT_EQ(code, grpc::StatusCode::DEADLINE_EXCEEDED);  // it did wait for the key
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(700));
  EXPECT_EQ(most, 0);
}

}  // namespace
}  // namespace moe_ep::server
