#include "server/metrics.h"

#include <chrono>
#include <exception>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/thread_stack_floor.h"
#include "prometheus/collectable.h"
#include "prometheus/exposer.h"
#include "prometheus/metric_family.h"

namespace moe_ep::server {
namespace {

constexpr const char kWorkerPrefix[] = "/moe_ep.v1.Worker/";
constexpr const char kForwardMethod[] = "/moe_ep.v1.Worker/Forward";
constexpr const char kGetStatusMethod[] = "/moe_ep.v1.Worker/GetStatus";

// 50 us .. ~105 s, factor 2: covers a loopback GetStatus and a long Join.
prometheus::Histogram::BucketBoundaries RpcBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double s = 50e-6; s < 120.0; s *= 2) b.push_back(s);
  return b;
}

// 5 us .. ~5 s, factor 2: one dispatch, expert or combine phase.
prometheus::Histogram::BucketBoundaries PhaseBuckets() {
  prometheus::Histogram::BucketBoundaries b;
  for (double s = 5e-6; s < 6.0; s *= 2) b.push_back(s);
  return b;
}

// "DEADLINE_EXCEEDED" for grpc::StatusCode::DEADLINE_EXCEEDED.
std::string CodeName(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::OK:
      return "OK";
    case grpc::StatusCode::CANCELLED:
      return "CANCELLED";
    case grpc::StatusCode::UNKNOWN:
      return "UNKNOWN";
    case grpc::StatusCode::INVALID_ARGUMENT:
      return "INVALID_ARGUMENT";
    case grpc::StatusCode::DEADLINE_EXCEEDED:
      return "DEADLINE_EXCEEDED";
    case grpc::StatusCode::NOT_FOUND:
      return "NOT_FOUND";
    case grpc::StatusCode::ALREADY_EXISTS:
      return "ALREADY_EXISTS";
    case grpc::StatusCode::PERMISSION_DENIED:
      return "PERMISSION_DENIED";
    case grpc::StatusCode::UNAUTHENTICATED:
      return "UNAUTHENTICATED";
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return "RESOURCE_EXHAUSTED";
    case grpc::StatusCode::FAILED_PRECONDITION:
      return "FAILED_PRECONDITION";
    case grpc::StatusCode::ABORTED:
      return "ABORTED";
    case grpc::StatusCode::OUT_OF_RANGE:
      return "OUT_OF_RANGE";
    case grpc::StatusCode::UNIMPLEMENTED:
      return "UNIMPLEMENTED";
    case grpc::StatusCode::INTERNAL:
      return "INTERNAL";
    case grpc::StatusCode::UNAVAILABLE:
      return "UNAVAILABLE";
    case grpc::StatusCode::DATA_LOSS:
      return "DATA_LOSS";
    default:
      return absl::StrCat("CODE_", static_cast<int>(code));
  }
}

// The codes after which server/worker_service.cc marks the group broken.
bool IsGroupBreakingCode(grpc::StatusCode code) {
  switch (code) {
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::UNKNOWN:
    case grpc::StatusCode::INTERNAL:
    case grpc::StatusCode::CANCELLED:
    case grpc::StatusCode::DATA_LOSS:
      return true;
    default:
      return false;
  }
}

std::string StateName(v1::WorkerState state) {
  switch (state) {
    case v1::WORKER_STATE_STARTED:
      return "STARTED";
    case v1::WORKER_STATE_JOINED:
      return "JOINED";
    case v1::WORKER_STATE_CONFIGURED:
      return "CONFIGURED";
    case v1::WORKER_STATE_ALLOCATED:
      return "ALLOCATED";
    default:
      return "UNSPECIFIED";
  }
}

prometheus::MetricFamily Gauge(std::string name, std::string help, double value) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = prometheus::MetricType::Gauge;
  prometheus::ClientMetric metric;
  metric.gauge.value = value;
  family.metric.push_back(std::move(metric));
  return family;
}

prometheus::MetricFamily Counter(std::string name, std::string help, double value) {
  prometheus::MetricFamily family;
  family.name = std::move(name);
  family.help = std::move(help);
  family.type = prometheus::MetricType::Counter;
  prometheus::ClientMetric metric;
  metric.counter.value = value;
  family.metric.push_back(std::move(metric));
  return family;
}

class MetricsInterceptor final : public grpc::experimental::Interceptor {
 public:
  MetricsInterceptor(WorkerMetrics* metrics, std::string method)
      : metrics_(metrics), method_(std::move(method)), start_(std::chrono::steady_clock::now()) {}

  void Intercept(grpc::experimental::InterceptorBatchMethods* methods) override {
    using grpc::experimental::InterceptionHookPoints;
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_MESSAGE) &&
        method_ == kForwardMethod) {
      // The sync server hands the response object itself to interceptors.
      if (const void* message = methods->GetSendMessage(); message != nullptr) {
        metrics_->RecordForward(*static_cast<const v1::ForwardResponse*>(message));
      }
    }
    if (methods->QueryInterceptionHookPoint(InterceptionHookPoints::PRE_SEND_STATUS)) {
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
      // Runs under gRPC's per-call locks (a health Watch ends inside its
      // reactor's mutex): record into prometheus only, never take a lock of
      // the worker here (proto/rpc/health.h, issue 8).
      metrics_->RecordRpc(method_, methods->GetSendStatus().error_code(), seconds);
    }
    methods->Proceed();
  }

 private:
  WorkerMetrics* metrics_;
  std::string method_;
  std::chrono::steady_clock::time_point start_;
};

class MetricsInterceptorFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  explicit MetricsInterceptorFactory(WorkerMetrics* metrics) : metrics_(metrics) {}
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new MetricsInterceptor(metrics_, info->method() ? info->method() : "");
  }

 private:
  WorkerMetrics* metrics_;
};

}  // namespace

// The gauges read from GetStatus at scrape time.
class WorkerMetrics::StatusCollectable final : public prometheus::Collectable {
 public:
  explicit StatusCollectable(std::function<v1::GetStatusResponse()> status)
      : status_(std::move(status)) {}

  std::vector<prometheus::MetricFamily> Collect() const override {
    const v1::GetStatusResponse s = status_();
    std::vector<prometheus::MetricFamily> out;
    out.push_back(Gauge("moe_ep_runtime_max_tokens_per_rank",
                        "R of the committed geometry (tokens per rank; 0 before CommitGeometry)",
                        s.runtime_max_tokens_per_rank()));
    out.push_back(Gauge("moe_ep_capacity_tokens",
                        "workspace capacity N (tokens per rank; 0 before AllocateWorkspace)",
                        s.capacity_tokens()));
    out.push_back(Gauge("moe_ep_workspace_bytes", "bytes allocated by this worker's data plane",
                        s.workspace_bytes()));
    out.push_back(
        Gauge("moe_ep_expert_bytes", "bytes of this rank's expert weights", s.expert_bytes()));
    out.push_back(Gauge("moe_ep_memory_cap_bytes",
                        "cap on workspace + expert bytes (--memory-cap-bytes; 0 = none)",
                        s.memory_cap_bytes()));
    out.push_back(Gauge("moe_ep_device_memory_bytes", "memory of the device this worker runs on",
                        s.device_memory_bytes()));
    out.push_back(
        Gauge("moe_ep_geometry_epoch", "epoch of the committed geometry", s.geometry_epoch()));
    out.push_back(
        Gauge("moe_ep_generation", "generation of the group this worker joined", s.generation()));
    out.push_back(Gauge("moe_ep_rank", "rank in the group (0 before Join)", s.rank()));
    out.push_back(Gauge("moe_ep_world_size", "ranks in the group (0 before Join)", s.world_size()));
    prometheus::MetricFamily state;
    state.name = "moe_ep_state";
    state.help = "1 for the worker's current state";
    state.type = prometheus::MetricType::Gauge;
    for (v1::WorkerState each : {v1::WORKER_STATE_STARTED, v1::WORKER_STATE_JOINED,
                                 v1::WORKER_STATE_CONFIGURED, v1::WORKER_STATE_ALLOCATED}) {
      prometheus::ClientMetric metric;
      metric.label.push_back({"state", StateName(each)});
      metric.gauge.value = s.state() == each ? 1 : 0;
      state.metric.push_back(std::move(metric));
    }
    out.push_back(std::move(state));
    out.push_back(Counter("moe_ep_forwards_total", "Forward calls completed by this worker",
                          s.counters().forwards()));
    out.push_back(Counter("moe_ep_errors_total", "RPCs this worker answered with an error",
                          s.counters().errors()));
    if (s.expert_tokens_size() > 0) {
      prometheus::MetricFamily tokens;
      tokens.name = "moe_ep_expert_tokens_total";
      tokens.help =
          "(token, choice) pairs this rank routed to each logical expert, by MoE layer (DESIGN "
          "§15 load statistics)";
      tokens.type = prometheus::MetricType::Counter;
      for (const v1::LayerExpertTokens& layer : s.expert_tokens()) {
        for (int e = 0; e < layer.tokens_per_expert_size(); ++e) {
          prometheus::ClientMetric metric;
          metric.label.push_back({"layer", std::to_string(layer.layer())});
          metric.label.push_back({"expert", std::to_string(e)});
          metric.counter.value = static_cast<double>(layer.tokens_per_expert(e));
          tokens.metric.push_back(std::move(metric));
        }
      }
      out.push_back(std::move(tokens));
    }
    return out;
  }

 private:
  std::function<v1::GetStatusResponse()> status_;
};

WorkerMetrics::WorkerMetrics(std::function<v1::GetStatusResponse()> status)
    : registry_(std::make_shared<prometheus::Registry>()),
      status_collectable_(std::make_shared<StatusCollectable>(std::move(status))),
      rpcs_(prometheus::BuildCounter()
                .Name("moe_ep_rpcs_total")
                .Help("control-plane RPCs handled, by method and status code")
                .Register(*registry_)),
      rpc_seconds_(prometheus::BuildHistogram()
                       .Name("moe_ep_rpc_duration_seconds")
                       .Help("control-plane RPC latency in seconds, by method and status code")
                       .Register(*registry_)),
      communicator_errors_(prometheus::BuildCounter()
                               .Name("moe_ep_communicator_errors_total")
                               .Help("collective RPCs that failed with a group-breaking code "
                                     "(DEADLINE_EXCEEDED, UNAVAILABLE, CANCELLED, INTERNAL, "
                                     "UNKNOWN, DATA_LOSS)")
                               .Register(*registry_)),
      phase_seconds_(prometheus::BuildHistogram()
                         .Name("moe_ep_forward_phase_seconds")
                         .Help("time of each Forward phase in seconds")
                         .Register(*registry_)),
      dispatch_seconds_(phase_seconds_.Add({{"phase", "dispatch"}}, PhaseBuckets())),
      expert_seconds_(phase_seconds_.Add({{"phase", "expert"}}, PhaseBuckets())),
      combine_seconds_(phase_seconds_.Add({{"phase", "combine"}}, PhaseBuckets())),
      tokens_sent_(prometheus::BuildCounter()
                       .Name("moe_ep_forward_tokens_sent_total")
                       .Help("token copies dispatched (one per distinct destination rank)")
                       .Register(*registry_)
                       .Add({})),
      tokens_received_(prometheus::BuildCounter()
                           .Name("moe_ep_forward_tokens_received_total")
                           .Help("token copies received by dispatch")
                           .Register(*registry_)
                           .Add({})),
      bytes_sent_(prometheus::BuildCounter()
                      .Name("moe_ep_forward_bytes_sent_total")
                      .Help("dispatch + combine payload bytes sent to other ranks")
                      .Register(*registry_)
                      .Add({})) {}

WorkerMetrics::~WorkerMetrics() = default;

std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>
WorkerMetrics::MakeInterceptorFactory() {
  return std::make_unique<MetricsInterceptorFactory>(this);
}

void WorkerMetrics::RecordRpc(const std::string& method, grpc::StatusCode code, double seconds) {
  const std::string code_name = CodeName(code);
  rpcs_.Add({{"method", method}, {"code", code_name}}).Increment();
  rpc_seconds_.Add({{"method", method}, {"code", code_name}}, RpcBuckets()).Observe(seconds);
  if (absl::StartsWith(method, kWorkerPrefix) && method != kGetStatusMethod &&
      IsGroupBreakingCode(code)) {
    communicator_errors_.Add({{"method", method}, {"code", code_name}}).Increment();
  }
}

void WorkerMetrics::RecordForward(const v1::ForwardResponse& response) {
  dispatch_seconds_.Observe(response.timings().dispatch_us() * 1e-6);
  expert_seconds_.Observe(response.timings().expert_us() * 1e-6);
  combine_seconds_.Observe(response.timings().combine_us() * 1e-6);
  tokens_sent_.Increment(static_cast<double>(response.tokens_sent()));
  tokens_received_.Increment(static_cast<double>(response.tokens_received()));
  bytes_sent_.Increment(static_cast<double>(response.bytes_sent()));
}

MetricsServer::~MetricsServer() = default;

absl::StatusOr<std::unique_ptr<MetricsServer>> MetricsServer::Start(const std::string& listen,
                                                                    const WorkerMetrics& metrics) {
  const size_t colon = listen.rfind(':');
  if (colon == std::string::npos || colon + 1 == listen.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--metrics-listen: expected host:port, got \"", listen, "\""));
  }
  std::unique_ptr<MetricsServer> server(new MetricsServer());
  // civetweb's small thread stacks need the floor (core/thread_stack_floor.h).
  (void)core::EffectiveThreadStackBytes(0);
  try {
    server->exposer_ = std::make_unique<prometheus::Exposer>(listen, 2);
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("--metrics-listen: cannot serve /metrics on ", listen, ": ", e.what()));
  }
  server->exposer_->RegisterCollectable(metrics.registry());
  server->exposer_->RegisterCollectable(metrics.status_collectable_);
  const std::vector<int> ports = server->exposer_->GetListeningPorts();
  if (ports.empty() || ports[0] <= 0) {
    return absl::UnavailableError(absl::StrCat("--metrics-listen: no port bound for ", listen));
  }
  server->port_ = ports[0];
  return server;
}

}  // namespace moe_ep::server
