#include "server/grpc_store.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "gloo/common/error.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/server/rendezvous_server.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;
using testing::RendezvousServer;

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

// A store with a stop flag: a get of a key nobody sets waits in slices and
// ends "stopped" once the flag is set (a rank mask round whose plane goes
// away, server/rank_mask.h), not at its timeout; one already stopped does
// not call at all. Without the flag set it still gets what another client sets.
TEST(GrpcStore, AStopFlagEndsAWait) {
  RendezvousServer server;
  auto stop = std::make_shared<std::atomic<bool>>(false);
  GrpcStore store(server.address(), absl::Seconds(60), "", stop);
  GrpcStore writer(server.address(), absl::Seconds(5));
  std::thread t([&] { writer.set("set-later", {'2'}); });
  EXPECT_EQ(store.get("set-later"), std::vector<char>{'2'});
  t.join();
  std::thread stopper([&] {
    // Once the waiter is in its wait (it has set its own key first).
    GrpcStore(server.address(), absl::Seconds(5)).wait({"waiting"});
    // Past a few slices of the get, so the flag ends a slice, not the
    // check before the first one.
    absl::SleepFor(GrpcStore::kStopCheckInterval * 3);
    stop->store(true);
  });
  auto waited = std::async(std::launch::async, [&]() -> std::string {
    store.set("waiting", {'1'});
    try {
      store.get("never-set");
    } catch (const gloo::IoException& e) {
      return e.what();
    }
    return "returned";
  });
  ASSERT_EQ(waited.wait_for(std::chrono::seconds(30)), std::future_status::ready)
      << "the wait did not see the stop flag";
  EXPECT_THAT(waited.get(), HasSubstr("get \"never-set\" stopped: the caller gave up"));
  stopper.join();
  EXPECT_THAT([&] { store.set("after", {'1'}); },
              ::testing::ThrowsMessage<gloo::IoException>(HasSubstr("set \"after\" stopped")));
}

// Probe tells the three answers apart (call_arrival.h relies on it: a port
// that refuses is a lost rank, a silent one is stopped or busy and is not
// masked). A socket that listens but never accepts is what a stopped worker
// looks like from outside: the kernel completes the TCP handshake and
// nothing answers, which gRPC reports as UNAVAILABLE "connection attempt
// timed out before receiving SETTINGS frame" after these channels' 100 ms
// minimum connect timeout, before the probe's own 300 ms.
TEST(GrpcStore, ProbeTellsAnsweringRefusingAndSilentPortsApart) {
  RendezvousServer server;
  ASSERT_NE(server.server, nullptr);
  GrpcStore live(server.address(), absl::Seconds(5));
  EXPECT_EQ(live.Probe(absl::Milliseconds(300)), GrpcStore::ProbeResult::kAnswers);

  // A refusal comes at once; the long probe timeout only keeps a stalled
  // machine from reading it as late (silent).
  GrpcStore closed("127.0.0.1:" + std::to_string(FreePort()), absl::Seconds(5));
  EXPECT_EQ(closed.Probe(absl::Seconds(3)), GrpcStore::ProbeResult::kRefuses);

  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  GrpcStore stopped("127.0.0.1:" + std::to_string(ntohs(addr.sin_port)), absl::Seconds(5));
  const absl::Time start = absl::Now();
  EXPECT_EQ(stopped.Probe(absl::Milliseconds(300)), GrpcStore::ProbeResult::kSilent);
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  close(fd);
}

}  // namespace
}  // namespace moe_ep::server
