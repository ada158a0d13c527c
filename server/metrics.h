#pragma once

// Prometheus metrics of one worker (issue 5, "Observability"), served as
// text exposition on http://HOST:PORT/metrics by prometheus-cpp's Exposer on
// a port of its own (--metrics-listen), separate from the gRPC control plane.
//
// Where the values come from:
//   - a gRPC server interceptor (MakeInterceptorFactory) sees every call that
//     reaches a handler (calls refused by TLS or the bearer token never do):
//       moe_ep_rpcs_total{method,code}                    counter
//       moe_ep_rpc_duration_seconds{method,code}          histogram, seconds
//       moe_ep_communicator_errors_total{method,code}     counter: collective
//         RPCs that failed with a code that breaks the group (DEADLINE_EXCEEDED,
//         UNAVAILABLE, CANCELLED, INTERNAL, UNKNOWN, DATA_LOSS), as
//         server/worker_service.cc classifies them
//     and, from each successful ForwardResponse (its timings and counts):
//       moe_ep_forward_phase_seconds{phase=dispatch|expert|combine} histogram
//       moe_ep_forward_tokens_sent_total, moe_ep_forward_tokens_received_total,
//       moe_ep_forward_bytes_sent_total                   counters
//   - the GetStatus snapshot, read at scrape time (gauges):
//       moe_ep_runtime_max_tokens_per_rank (R), moe_ep_capacity_tokens (N),
//       moe_ep_workspace_bytes, moe_ep_expert_bytes, moe_ep_memory_cap_bytes,
//       moe_ep_device_memory_bytes, moe_ep_geometry_epoch, moe_ep_generation,
//       moe_ep_rank, moe_ep_world_size, moe_ep_state{state} (1 for the current
//       state), moe_ep_forwards_total and moe_ep_errors_total (the worker's
//       own counters), and moe_ep_expert_tokens_total{layer,expert} (counter:
//       the load statistics of DESIGN §15, GetStatusResponse.expert_tokens).
//
// Thread-safe. Source: issue 5; prometheus-cpp 1.0 (core + pull).

#include <functional>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "grpcpp/support/server_interceptor.h"
#include "moe_ep/v1/worker.pb.h"
#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace prometheus {
class Exposer;
}

namespace moe_ep::server {

class WorkerMetrics {
 public:
  // `status` returns the worker's current GetStatus snapshot; it is called at
  // scrape time only, never from the interceptor: the interceptor runs under
  // gRPC's per-call locks, and the snapshot takes the worker's state lock,
  // which is held while the worker reports health to gRPC — the lock-order
  // cycle of issue 8.
  explicit WorkerMetrics(std::function<v1::GetStatusResponse()> status);
  ~WorkerMetrics();

  const std::shared_ptr<prometheus::Registry>& registry() const { return registry_; }

  // For grpc::ServerBuilder::experimental().SetInterceptorCreators(). The
  // factory refers to this object, which must outlive the server.
  std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface> MakeInterceptorFactory();

  // What the interceptor records; public so tests can drive them directly.
  // `method` is the full gRPC path ("/moe_ep.v1.Worker/Forward").
  void RecordRpc(const std::string& method, grpc::StatusCode code, double seconds);
  void RecordForward(const v1::ForwardResponse& response);

 private:
  friend class MetricsServer;
  class StatusCollectable;

  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<StatusCollectable> status_collectable_;
  prometheus::Family<prometheus::Counter>& rpcs_;
  prometheus::Family<prometheus::Histogram>& rpc_seconds_;
  prometheus::Family<prometheus::Counter>& communicator_errors_;
  prometheus::Family<prometheus::Histogram>& phase_seconds_;
  prometheus::Histogram& dispatch_seconds_;
  prometheus::Histogram& expert_seconds_;
  prometheus::Histogram& combine_seconds_;
  prometheus::Counter& tokens_sent_;
  prometheus::Counter& tokens_received_;
  prometheus::Counter& bytes_sent_;
};

// The HTTP endpoint serving `metrics` at /metrics.
class MetricsServer {
 public:
  // Binds `listen` ("host:port"; port 0 picks a free port).
  // Errors: kInvalidArgument for an address without a port; kUnavailable when
  // the address cannot be bound (the message names it).
  static absl::StatusOr<std::unique_ptr<MetricsServer>> Start(const std::string& listen,
                                                              const WorkerMetrics& metrics);
  ~MetricsServer();

  int port() const { return port_; }

 private:
  MetricsServer() = default;
  std::unique_ptr<prometheus::Exposer> exposer_;
  int port_ = 0;
};

}  // namespace moe_ep::server
