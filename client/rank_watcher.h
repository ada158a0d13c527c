#pragma once

// What the coordinator service knows of one worker (DESIGN §16, issue 12
// item 5), from two sources on their own threads:
//   - a grpc.health.v1 Watch of the readiness name "moe_ep.v1.Worker"
//     (proto/rpc/health.h): every status the worker pushes, and the moment the
//     stream breaks (a killed worker's connection closes at once, so a lost
//     rank shows within milliseconds); a broken stream is opened again every
//     `retry_interval`;
//   - a GetStatus probe every `probe_interval` with a deadline of
//     `probe_timeout`: the worker's generation and state, and a worker that is
//     connected but does not answer (hung, SIGSTOPped), which no stream
//     reports.
// Each change calls `on_change` (on the watcher's threads, with no lock of
// the watcher held; it must not destroy the watcher).
//
// Thread-safe. Source: DESIGN §16; issue 12 item 5; proto/rpc/health.h.

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/coordinator.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/client_context.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::client {

struct RankWatcherOptions {
  absl::Duration probe_interval = absl::Milliseconds(250);
  absl::Duration probe_timeout = absl::Seconds(1);
  absl::Duration retry_interval = absl::Milliseconds(100);
  CoordinatorOptions channel;  // credentials, message limit, reconnect back-off
};

// A snapshot of one rank.
struct RankObservation {
  // Health Watch: the stream is open, and the last status it pushed since
  // the last ResetReadiness() (UNKNOWN: none yet).
  bool watch_open = false;
  grpc::health::v1::HealthCheckResponse::ServingStatus readiness =
      grpc::health::v1::HealthCheckResponse::UNKNOWN;
  absl::Status watch_error;                         // why the stream last ended (OK while open)
  absl::Time watch_lost_at = absl::InfinitePast();  // when it last ended
  // GetStatus probe: its last result, and the last successful answer.
  bool probed = false;  // at least one probe finished
  absl::Status probe;
  v1::GetStatusResponse status;
  absl::Time last_answer = absl::InfinitePast();
  // When the probe that brought `status` was sent. A worker's state may
  // change while a probe is in flight, so "the state after event X" is an
  // answer asked after X, not one that merely arrived after it.
  absl::Time last_answer_asked = absl::InfinitePast();
  // Probes that failed in a row since the last answer (0 after an answer):
  // what a failure threshold counts (GroupKeeperOptions::probe_failure_threshold,
  // as a kubelet probe's failureThreshold; issue 31 item 3).
  int probe_failures = 0;
};

class RankWatcher {
 public:
  // Starts both threads at once.
  RankWatcher(std::string target, RankWatcherOptions options, std::function<void()> on_change);
  // Stops and joins both threads (cancels the open Watch).
  ~RankWatcher();
  RankWatcher(const RankWatcher&) = delete;
  RankWatcher& operator=(const RankWatcher&) = delete;

  const std::string& target() const { return target_; }
  RankObservation Observe() const;
  // Forgets the readiness read so far (UNKNOWN until the next push): before a
  // formation, so that only statuses pushed after it count.
  void ResetReadiness();

 private:
  void WatchLoop();
  void ProbeLoop();
  // Sleeps `d` or until Stop; returns false when stopping.
  bool SleepFor(absl::Duration d);
  void Changed() {
    if (on_change_) on_change_();
  }

  const std::string target_;
  const RankWatcherOptions options_;
  const std::function<void()> on_change_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
  std::unique_ptr<v1::Worker::Stub> worker_;

  mutable std::mutex mu_;
  std::condition_variable stop_cv_;
  bool stopping_ = false;                         // guarded by mu_
  grpc::ClientContext* watch_context_ = nullptr;  // guarded by mu_: the open Watch
  RankObservation observation_;                   // guarded by mu_
  std::thread watch_thread_;
  std::thread probe_thread_;
};

}  // namespace moe_ep::client
