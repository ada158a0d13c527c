#pragma once

// Prometheus metrics of `moe-ep coordinator` (DESIGN §16, issue 12 item 5),
// served on http://HOST:PORT/metrics by prometheus-cpp's Exposer
// (--metrics-listen):
//   read from GroupKeeper::Snapshot() at scrape time (gauges, counters):
//     moe_ep_coordinator_generation            generation of the group formed last
//     moe_ep_coordinator_group_ready           1 while the phase is READY
//     moe_ep_coordinator_phase{phase}          1 for the current phase
//     moe_ep_coordinator_formations_total      successful formations (first included)
//     moe_ep_coordinator_reforms_total         formations after the first
//     moe_ep_coordinator_failed_attempts_total
//     moe_ep_coordinator_last_form_seconds     Join + ConfigureLayers + AllocateWorkspace
//     moe_ep_coordinator_last_load_seconds     LoadExperts of every layer
//     moe_ep_coordinator_last_recovery_seconds first rank lost -> READY again
//     moe_ep_coordinator_masked_ranks          ranks masked out, kept (issue 17)
//     moe_ep_coordinator_lost_experts          experts with no live replica
//     moe_ep_coordinator_readds_total          masked ranks re-added by Rejoin
//     moe_ep_coordinator_rank_state{rank,target,state}  1 for each rank's state
//   from the keeper's events (histograms, seconds):
//     moe_ep_coordinator_form_seconds, moe_ep_coordinator_recovery_seconds
//
// Thread-safe. Source: issue 12 item 5; prometheus-cpp 1.0 (core + pull).

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "moe_ep/v1/coordinator.pb.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}

namespace moe_ep::client {

class CoordinatorMetrics {
 public:
  // `snapshot` is called at scrape time (GroupKeeper::Snapshot).
  explicit CoordinatorMetrics(std::function<v1::GetGroupResponse()> snapshot);
  ~CoordinatorMetrics();

  // For GroupKeeperOptions::on_event: "formed" and "recovered" feed the
  // histograms. Thread-safe, never blocks on anything but prometheus-cpp.
  void RecordEvent(const v1::GroupEvent& event);

  // Serves /metrics on `listen` ("host:port"; port 0 picks one).
  // Errors: kUnavailable when it cannot be bound (names the address).
  absl::Status Serve(const std::string& listen);
  int port() const { return port_; }
  // Stops serving /metrics (before the keeper that `snapshot` reads goes away).
  void StopServing();

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

 private:
  class SnapshotCollectable;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<SnapshotCollectable> snapshot_;
  prometheus::Histogram& form_seconds_;
  prometheus::Histogram& recovery_seconds_;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace moe_ep::client
