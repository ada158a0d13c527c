// Integration tests: grpc.health.v1.Health/Watch streams against real
// moe-ep-worker processes (issue 8). A Watch that ended by cancel or deadline
// used to kill the worker ("[mutex.cc] dying due to potential deadlock"):
// the metrics interceptor took the worker's state lock under the stream's
// mutex while health updates took them in the other order. Abseil's deadlock
// detector stays on in the worker, so any lock-order cycle left kills it here.

#include <signal.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/credentials.h"
#include "client/local_cluster.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/worker.grpc.pb.h"
#include "tests/integration/fake_coordinator.h"
#include "tests/test_certs.h"

namespace moe_ep::testing {
namespace {

using HealthResponse = grpc::health::v1::HealthCheckResponse;

constexpr int kStreamsPerEnding = 100;
constexpr int kThreads = 10;  // streams end concurrently, as under a load balancer

enum class Ending { kCancel, kDeadline };

// WatchOnce's answer for a deadline stream that ended before its first status.
constexpr int kEndedBeforeFirstStatus = 1000;

// One port to watch: its address and the credentials a client needs there.
struct WatchedPort {
  std::string name;
  std::string address;
  std::shared_ptr<grpc::ChannelCredentials> credentials;
  std::string token;  // "" = no authorization header
};

// Opens a Watch on `service`, reads the first status, then ends the stream
// by `ending`. Returns the first status read, or -1 - code when none came.
int WatchOnce(grpc::health::v1::Health::Stub& stub, const WatchedPort& port,
              const std::string& service, Ending ending) {
  grpc::ClientContext context;
  if (!port.token.empty()) context.AddMetadata("authorization", "Bearer " + port.token);
  const auto timeout =
      ending == Ending::kDeadline ? std::chrono::milliseconds(300) : std::chrono::seconds(20);
  context.set_deadline(std::chrono::system_clock::now() + timeout);
  grpc::health::v1::HealthCheckRequest request;
  request.set_service(service);
  std::unique_ptr<grpc::ClientReader<HealthResponse>> reader = stub.Watch(&context, request);
  HealthResponse response;
  const bool got = reader->Read(&response);
  if (ending == Ending::kCancel) {
    context.TryCancel();
  } else {
    while (reader->Read(&response)) {
    }
  }
  const grpc::Status status = reader->Finish();
  // On a loaded machine a deadline stream may end before its first status:
  // still a Watch ended by its deadline, which is what the worker must survive.
  if (!got && ending == Ending::kDeadline &&
      status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED) {
    return kEndedBeforeFirstStatus;
  }
  if (!got) return -1 - status.error_code();
  return response.status();
}

// kStreamsPerEnding Watch streams per ending and per service name, from
// kThreads threads. Expects every first status to be `want_ready` for the
// readiness name and SERVING for the liveness name "".
void WatchManyTimes(const WatchedPort& port, HealthResponse::ServingStatus want_ready) {
  auto channel = grpc::CreateChannel(port.address, port.credentials);
  // Connect (and, for TLS, hand-shake) once before the streams' short deadlines start.
  ASSERT_TRUE(
      channel->WaitForConnected(std::chrono::system_clock::now() + std::chrono::seconds(20)))
      << port.name;
  auto stub = grpc::health::v1::Health::NewStub(channel);
  for (Ending ending : {Ending::kCancel, Ending::kDeadline}) {
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    threads.reserve(kThreads);
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        for (int i = t; i < kStreamsPerEnding; i += kThreads) {
          const bool ready_name = i % 2 == 0;
          const int got = WatchOnce(*stub, port, ready_name ? "moe_ep.v1.Worker" : "", ending);
          if (got == kEndedBeforeFirstStatus) continue;
          if (got != (ready_name ? want_ready : HealthResponse::SERVING)) ++wrong;
        }
      });
    }
    for (std::thread& thread : threads) thread.join();
    EXPECT_EQ(wrong.load(), 0) << port.name
                               << (ending == Ending::kCancel ? " cancel" : " deadline");
  }
}

int ReadPortFile(const std::string& path) {
  for (int i = 0; i < 200; ++i) {
    const std::string text = ReadTextFile(path);
    if (!text.empty() && text.back() == '\n') return std::stoi(text);
    absl::SleepFor(absl::Milliseconds(25));
  }
  return 0;
}

TEST(HealthWatch, PlaintextWorkerSurvivesWatchesOnBothPortsWhileItsStateChanges) {
  const std::string dir = ::testing::TempDir() + "/health_watch_plain";
  std::filesystem::create_directories(dir);
  const std::string port_file = dir + "/health.port";
  std::filesystem::remove(port_file);
  auto fake = FakeCoordinator::Start(
      1, {"--health-listen=127.0.0.1:0", "--health-port-file=" + port_file, "--log-level=warn"});
  ASSERT_TRUE(fake.ok()) << fake.status();
  const int health_port = ReadPortFile(port_file);
  ASSERT_GT(health_port, 0);
  const std::vector<WatchedPort> ports = {
      {"main port", (*fake)->cluster().targets()[0], grpc::InsecureChannelCredentials(), ""},
      {"health port", absl::StrCat("127.0.0.1:", health_port), grpc::InsecureChannelCredentials(),
       ""}};

  // A long-lived Watch sees readiness change with the state (its writes run
  // under gRPC's health mutex, the other half of the old cycle).
  auto watch_stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(ports[0].address, ports[0].credentials));
  grpc::ClientContext long_context;
  grpc::health::v1::HealthCheckRequest long_request;
  long_request.set_service("moe_ep.v1.Worker");
  auto long_reader = watch_stub->Watch(&long_context, long_request);
  HealthResponse update;
  ASSERT_TRUE(long_reader->Read(&update));
  EXPECT_EQ(update.status(), HealthResponse::NOT_SERVING);

  for (const WatchedPort& port : ports) WatchManyTimes(port, HealthResponse::NOT_SERVING);
  ASSERT_TRUE((*fake)->SetUp(SmallModel(), 16, v1::EXPERT_KIND_IDENTITY).ok());
  // Each state change (Join, ConfigureLayers, AllocateWorkspace) writes an
  // update; the last is SERVING.
  bool saw_serving = false;
  for (int i = 0; i < 8 && !saw_serving; ++i) {
    ASSERT_TRUE(long_reader->Read(&update));
    saw_serving = update.status() == HealthResponse::SERVING;
  }
  EXPECT_TRUE(saw_serving);
  for (const WatchedPort& port : ports) WatchManyTimes(port, HealthResponse::SERVING);
  long_context.TryCancel();
  while (long_reader->Read(&update)) {
  }
  (void)long_reader->Finish();

  // Still alive and serving: a step runs and GetStatus answers.
  EXPECT_TRUE((*fake)->cluster().IsRunning(0));
  v1::GetStatusResponse status = (*fake)->StatusOf(0);
  EXPECT_EQ(status.state(), v1::WORKER_STATE_ALLOCATED);
  std::filesystem::remove_all(dir);
}

TEST(HealthWatch, TlsWorkerWithTokenSurvivesWatchesOnBothPorts) {
  TestPki pki;
  if (!MakeTestPki("health_watch_test", &pki)) GTEST_SKIP() << "openssl failed";
  const std::string token_file = pki.dir + "/token";
  WriteTextFile(token_file, "watch-token\n");
  const std::string port_file = pki.dir + "/health.port";
  client::LocalClusterOptions options;
  options.num_workers = 1;
  options.backend = "gloo";
  options.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  options.extra_args = {"--tls-cert=" + pki.server_cert,   "--tls-key=" + pki.server_key,
                        "--auth-token-file=" + token_file, "--health-listen=127.0.0.1:0",
                        "--health-port-file=" + port_file, "--log-level=warn"};
  auto cluster = client::LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int health_port = ReadPortFile(port_file);
  ASSERT_GT(health_port, 0);
  const std::string main_port =
      (*cluster)->targets()[0].substr((*cluster)->targets()[0].rfind(':'));
  client::ClientSecurityOptions security;
  security.tls_ca = pki.ca_cert;
  auto tls = client::MakeClientChannelCredentials(security);
  ASSERT_TRUE(tls.ok()) << tls.status();
  const std::vector<WatchedPort> ports = {
      {"TLS + token main port", "localhost" + main_port, *tls, "watch-token"},
      {"health port", absl::StrCat("127.0.0.1:", health_port), grpc::InsecureChannelCredentials(),
       ""}};
  for (const WatchedPort& port : ports) WatchManyTimes(port, HealthResponse::NOT_SERVING);
  EXPECT_TRUE((*cluster)->IsRunning(0));

  // The main port still serves the worker (with the token).
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(ports[0].address, *tls));
  grpc::ClientContext context;
  context.AddMetadata("authorization", "Bearer watch-token");
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  v1::GetStatusResponse status;
  EXPECT_TRUE(stub->GetStatus(&context, v1::GetStatusRequest(), &status).ok());
  EXPECT_EQ(status.state(), v1::WORKER_STATE_STARTED);
  std::filesystem::remove_all(pki.dir);
}

}  // namespace
}  // namespace moe_ep::testing
