#include "server/grpc_store.h"

#include <chrono>
#include <memory>
#include <thread>

#include "gloo/common/error.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "server/rendezvous_service.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

// A Rendezvous server on a loopback port chosen by the OS.
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
  std::string address() const { return "127.0.0.1:" + std::to_string(port); }
  RendezvousService service;
  int port = 0;
  std::unique_ptr<grpc::Server> server;
};

int FreePort() {
  RendezvousServer probe;
  return probe.port;
}

TEST(GrpcStore, SetGetWait) {
  RendezvousServer server;
  ASSERT_NE(server.server, nullptr);
  GrpcStore store(server.address(), absl::Seconds(5));
  store.set("gen1/0", {'a', 'b'});
  EXPECT_EQ(store.get("gen1/0"), (std::vector<char>{'a', 'b'}));
  store.wait({"gen1/0"});
  store.wait({"gen1/0"}, std::chrono::milliseconds(100));
}

TEST(GrpcStore, GetWaitsForAnotherClientsSet) {
  RendezvousServer server;
  GrpcStore reader(server.address(), absl::Seconds(5));
  GrpcStore writer(server.address(), absl::Seconds(5));
  std::thread t([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    writer.set("k", {'1'});
  });
  EXPECT_EQ(reader.get("k"), std::vector<char>{'1'});
  t.join();
}

TEST(GrpcStore, WaitTimeoutThrowsGlooIoExceptionNamingKey) {
  RendezvousServer server;
  GrpcStore store(server.address(), absl::Seconds(5));
  try {
    store.wait({"gen3/missing"}, std::chrono::milliseconds(200));
    FAIL() << "expected gloo::IoException";
  } catch (const gloo::IoException& e) {
    EXPECT_THAT(e.what(), HasSubstr("Timed out"));
    EXPECT_THAT(e.what(), HasSubstr("gen3/missing"));
  }
}

TEST(GrpcStore, ReusedKeyWithNewValueThrows) {
  RendezvousServer server;
  GrpcStore store(server.address(), absl::Seconds(5));
  store.set("k", {'1'});
  EXPECT_THROW(store.set("k", {'2'}), gloo::IoException);
}

TEST(GrpcStore, RetriesUntilRankZeroComesUp) {
  const int port = FreePort();
  const std::string address = "127.0.0.1:" + std::to_string(port);
  std::unique_ptr<RendezvousServer> late;
  std::thread starter([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    late = std::make_unique<RendezvousServer>(address);
  });
  GrpcStore store(address, absl::Seconds(10));
  store.set("early", {'x'});
  starter.join();
  ASSERT_NE(late->server, nullptr);
  EXPECT_EQ(late->service.NumKeys(), 1);
}

TEST(GrpcStore, UnreachableStoreTimesOut) {
  const int port = FreePort();
  GrpcStore store("127.0.0.1:" + std::to_string(port), absl::Milliseconds(300));
  const auto start = std::chrono::steady_clock::now();
  try {
    store.get("k");
    FAIL() << "expected gloo::IoException";
  } catch (const gloo::IoException& e) {
    EXPECT_THAT(e.what(), HasSubstr("Timed out"));
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
}

}  // namespace
}  // namespace moe_ep::server
