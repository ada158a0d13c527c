#include "client/rank_watcher.h"

#include <atomic>
#include <chrono>
#include <thread>

#include "gtest/gtest.h"

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

}  // namespace
}  // namespace moe_ep::client
