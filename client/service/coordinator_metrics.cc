#include "client/service/coordinator_metrics.h"

#include <exception>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/thread_stack_floor.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"

namespace moe_ep::client {
namespace {

prometheus::MetricFamily Single(const std::string& name, const std::string& help,
                                prometheus::MetricType type, double value) {
  prometheus::MetricFamily family;
  family.name = name;
  family.help = help;
  family.type = type;
  prometheus::ClientMetric metric;
  if (type == prometheus::MetricType::Counter) {
    metric.counter.value = value;
  } else {
    metric.gauge.value = value;
  }
  family.metric.push_back(std::move(metric));
  return family;
}

prometheus::MetricFamily Gauge(const std::string& name, const std::string& help, double value) {
  return Single(name, help, prometheus::MetricType::Gauge, value);
}
prometheus::MetricFamily Counter(const std::string& name, const std::string& help, double value) {
  return Single(name, help, prometheus::MetricType::Counter, value);
}

// Seconds, from a fast loopback re-form (~0.1 s) to a slow one.
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120};
}

}  // namespace

class CoordinatorMetrics::SnapshotCollectable final : public prometheus::Collectable {
 public:
  explicit SnapshotCollectable(std::function<v1::GetGroupResponse()> snapshot)
      : snapshot_(std::move(snapshot)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const v1::GetGroupResponse g = snapshot_();
    std::vector<prometheus::MetricFamily> out;
    out.push_back(Gauge("moe_ep_coordinator_generation", "generation of the group formed last",
                        static_cast<double>(g.generation())));
    out.push_back(Gauge("moe_ep_coordinator_group_ready",
                        "1 while the group is formed and matches the desired state",
                        g.phase() == v1::GROUP_PHASE_READY ? 1 : 0));
    prometheus::MetricFamily phase;
    phase.name = "moe_ep_coordinator_phase";
    phase.help = "1 for the coordinator's current phase";
    phase.type = prometheus::MetricType::Gauge;
    for (int p = v1::GroupPhase_MIN; p <= v1::GroupPhase_MAX; ++p) {
      if (!v1::GroupPhase_IsValid(p)) continue;
      prometheus::ClientMetric metric;
      metric.label.push_back({"phase", v1::GroupPhase_Name(static_cast<v1::GroupPhase>(p))});
      metric.gauge.value = g.phase() == p ? 1 : 0;
      phase.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(phase));
    out.push_back(Counter("moe_ep_coordinator_formations_total",
                          "successful formations of the group (the first included)",
                          static_cast<double>(g.formations())));
    out.push_back(Counter("moe_ep_coordinator_reforms_total",
                          "formations after the first (re-forms)",
                          static_cast<double>(g.formations() > 0 ? g.formations() - 1 : 0)));
    out.push_back(Counter("moe_ep_coordinator_failed_attempts_total",
                          "formation attempts that failed (each followed by a back-off)",
                          static_cast<double>(g.failed_attempts())));
    out.push_back(Gauge("moe_ep_coordinator_last_form_seconds",
                        "Join + ConfigureLayers + AllocateWorkspace of the last formation, s",
                        g.last_form_seconds()));
    out.push_back(Gauge("moe_ep_coordinator_last_load_seconds",
                        "LoadExperts of every layer in the last formation, s",
                        g.last_load_seconds()));
    out.push_back(Gauge("moe_ep_coordinator_last_recovery_seconds",
                        "from the group losing a rank to READY again, last time, s",
                        g.last_recovery_seconds()));
    out.push_back(Gauge("moe_ep_coordinator_masked_ranks",
                        "ranks the survivors masked out (kept without a re-form)",
                        static_cast<double>(g.masked_ranks_size())));
    out.push_back(Gauge("moe_ep_coordinator_lost_experts",
                        "logical experts with no live replica under the mask",
                        static_cast<double>(g.lost_experts_size())));
    out.push_back(Counter("moe_ep_coordinator_readds_total",
                          "masked ranks re-added (Rejoin) instead of re-forming",
                          static_cast<double>(g.readds())));
    prometheus::MetricFamily ranks;
    ranks.name = "moe_ep_coordinator_rank_state";
    ranks.help = "1 for each rank's state as the coordinator sees it";
    ranks.type = prometheus::MetricType::Gauge;
    for (const v1::RankView& r : g.ranks()) {
      prometheus::ClientMetric metric;
      metric.label.push_back({"rank", absl::StrCat(r.rank())});
      metric.label.push_back({"state", v1::RankState_Name(r.state())});
      metric.label.push_back({"target", r.target()});
      metric.gauge.value = 1;
      ranks.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(ranks));
    return out;
  }

 private:
  std::function<v1::GetGroupResponse()> snapshot_;
};

CoordinatorMetrics::CoordinatorMetrics(std::function<v1::GetGroupResponse()> snapshot)
    : registry_(std::make_shared<prometheus::Registry>()),
      snapshot_(std::make_shared<SnapshotCollectable>(std::move(snapshot))),
      form_seconds_(prometheus::BuildHistogram()
                        .Name("moe_ep_coordinator_form_seconds")
                        .Help("Join + ConfigureLayers + AllocateWorkspace of each formation, s")
                        .Register(*registry_)
                        .Add({}, SecondsBuckets())),
      recovery_seconds_(prometheus::BuildHistogram()
                            .Name("moe_ep_coordinator_recovery_seconds")
                            .Help("from the group losing a rank to READY again, s")
                            .Register(*registry_)
                            .Add({}, SecondsBuckets())) {}

CoordinatorMetrics::~CoordinatorMetrics() = default;

void CoordinatorMetrics::RecordEvent(const v1::GroupEvent& event) {
  if (event.kind() == "formed") form_seconds_.Observe(event.seconds());
  if (event.kind() == "recovered") recovery_seconds_.Observe(event.seconds());
}

void CoordinatorMetrics::StopServing() { exposer_.reset(); }

absl::Status CoordinatorMetrics::Serve(const std::string& listen) {
  // civetweb's threads need the stack floor on CUDA-linked builds.
  (void)core::EffectiveThreadStackBytes(0);
  try {
    exposer_ = std::make_unique<prometheus::Exposer>(listen, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot serve /metrics on ", listen, ": ", e.what()));
  }
  exposer_->RegisterCollectable(registry_);
  exposer_->RegisterCollectable(snapshot_);
  const std::vector<int> ports = exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen: no port bound for ", listen));
  }
  port_ = ports[0];
  return absl::OkStatus();
}

}  // namespace moe_ep::client
