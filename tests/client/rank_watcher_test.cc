#include "client/rank_watcher.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/time/clock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::client {
namespace {

TEST(RankWatcher, ReportsATargetThatRefusesConnections) {
  RankWatcherOptions options;
  options.probe_interval = absl::Milliseconds(50);
  options.retry_interval = absl::Milliseconds(50);
  std::atomic<int> changes{0};
  RankWatcher watcher("127.0.0.1:9", options, [&] { ++changes; });  // discard port: closed
  RankObservation obs;
  for (int i = 0; i < 400 && !obs.probed; ++i) {  // up to 20 s on a loaded machine
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    obs = watcher.Observe();
  }
  ASSERT_TRUE(obs.probed);
  EXPECT_EQ(obs.probe.code(), absl::StatusCode::kUnavailable) << obs.probe;
  EXPECT_FALSE(obs.watch_open);
  EXPECT_EQ(obs.readiness, grpc::health::v1::HealthCheckResponse::UNKNOWN);
  EXPECT_EQ(obs.last_answer, absl::InfinitePast());
  EXPECT_GE(changes.load(), 1);  // the first probe result
  EXPECT_EQ(watcher.target(), "127.0.0.1:9");
  // Failures in a row are counted (a failure threshold reads them), and each
  // one is a change.
  for (int i = 0; i < 400 && obs.probe_failures < 3; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
    obs = watcher.Observe();
  }
  EXPECT_GE(obs.probe_failures, 3);
  EXPECT_GE(changes.load(), 3);
}

// A worker whose GetStatus reads its state when asked and then holds the
// answer until released: a probe in flight while the state changes.
class HeldStatusWorker final : public v1::Worker::Service {
 public:
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse* response) override {
    std::unique_lock<std::mutex> lock(mu_);
    response->set_state(state_);
    ++asked_;
    changed_.notify_all();
    changed_.wait(lock, [&] { return !hold_; });
    return grpc::Status::OK;
  }
  void Hold() {
    std::lock_guard<std::mutex> lock(mu_);
    hold_ = true;
  }
  // Waits until a probe asked after this call is held.
  void WaitForAHeldProbe() {
    std::unique_lock<std::mutex> lock(mu_);
    const int seen = asked_;
    changed_.wait(lock, [&] { return asked_ > seen; });
  }
  void SetStateAndRelease(v1::WorkerState state) {
    std::lock_guard<std::mutex> lock(mu_);
    state_ = state;
    hold_ = false;
    changed_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable changed_;
  v1::WorkerState state_ = v1::WORKER_STATE_STARTED;
  bool hold_ = false;
  int asked_ = 0;
};

// The group keeper tells a stale answer from a fresh one by when the probe
// was asked (a re-added rank's probe asked before its Rejoin can arrive
// after it, still STARTED; the CI flake of CoordinatorMaskTwoRanksTest).
TEST(RankWatcher, AnAnswerCarriesWhenItsProbeWasAsked) {
  HeldStatusWorker worker;
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.RegisterService(&worker);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  ASSERT_NE(server, nullptr);

  RankWatcherOptions options;
  options.probe_interval = absl::Milliseconds(20);
  options.probe_timeout = absl::Seconds(30);
  options.retry_interval = absl::Milliseconds(20);
  worker.Hold();
  RankWatcher watcher("127.0.0.1:" + std::to_string(port), options, [] {});
  worker.WaitForAHeldProbe();            // asked while STARTED
  const absl::Time event = absl::Now();  // the state changes after the ask
  worker.SetStateAndRelease(v1::WORKER_STATE_ALLOCATED);
  RankObservation obs;
  for (int i = 0; i < 1000 && !obs.probed; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    obs = watcher.Observe();
  }
  ASSERT_TRUE(obs.probed);
  ASSERT_TRUE(obs.probe.ok()) << obs.probe;
  // The first answer shows the state when asked, arrived after the event,
  // and says it was asked before it.
  EXPECT_EQ(obs.status.state(), v1::WORKER_STATE_STARTED);
  EXPECT_GT(obs.last_answer, event);
  EXPECT_LT(obs.last_answer_asked, event);
  // A later probe is asked after the event and shows the new state.
  for (int i = 0; i < 1000 && obs.last_answer_asked <= event; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
    obs = watcher.Observe();
  }
  EXPECT_GT(obs.last_answer_asked, event);
  EXPECT_EQ(obs.status.state(), v1::WORKER_STATE_ALLOCATED);
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

}  // namespace
}  // namespace moe_ep::client
