#include "server/worker_process.h"

// The setup moe-ep-worker's main() did inline until issue 16, now shared
// with the embedded worker (server/moe_ep.h).

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "core/logging.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "proto/rpc/auth.h"
#include "proto/rpc/health.h"
#include "proto/rpc/probe_server.h"
#include "proto/rpc/rpc_log.h"
#include "proto/rpc/tls_credentials.h"
#include "server/data_plane_host.h"
#include "server/device_info.h"
#include "server/grpc_store.h"
#include "server/in_flight_calls.h"
#include "server/memory_limit.h"
#include "server/metrics.h"
#include "server/nccl_runtime.h"
#include "server/reflection_v1.h"
#include "server/rendezvous_service.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

constexpr int kMaxMessageBytes = 256 << 20;  // Forward carries [T, H] tensors
constexpr char kLoggerName[] = "moe-ep-worker";

// "host:port" -> host ("[::1]:0" -> "[::1]").
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

absl::Status WritePortFile(const std::string& flag, const std::string& file, int port) {
  if (file.empty()) return absl::OkStatus();
  std::ofstream out(file);
  out << port << "\n";
  if (!out) return absl::InternalError(absl::StrCat("--", flag, ": cannot write ", file));
  return absl::OkStatus();
}

// Logs go to stderr: moe-ep-worker's stdout carries only its "listening on" line.
absl::Status ConfigureLogging(const WorkerFlags& flags) {
  static absl::Mutex mu;
  absl::MutexLock lock(&mu);
  std::shared_ptr<spdlog::logger> logger = spdlog::get(kLoggerName);
  if (logger == nullptr) logger = spdlog::stderr_color_mt(kLoggerName);
  spdlog::set_default_logger(logger);
  spdlog::set_level(spdlog::level::from_str(flags.log_level));  // checked by the parser
  return core::ConfigureLogFormat(flags.log_format);
}

}  // namespace

struct WorkerProcess::Parts {
  // Declared before the servers, which are stopped and destroyed first.
  std::unique_ptr<rpc::HealthReporter> health;
  std::unique_ptr<RendezvousService> rendezvous;
  std::unique_ptr<WorkerService> worker;
  std::unique_ptr<ReflectionV1Service> reflection_v1;
  std::unique_ptr<WorkerMetrics> metrics;
  std::unique_ptr<InFlightCalls> in_flight;
  std::unique_ptr<grpc::CallbackGenericService> probe_unimplemented;
  std::unique_ptr<grpc::Server> server;
  std::unique_ptr<grpc::Server> probe_server;
  std::unique_ptr<MetricsServer> metrics_server;
  std::string address;
  std::string summary;
  absl::Mutex shutdown_mu;
  bool stopped ABSL_GUARDED_BY(shutdown_mu) = false;
};

WorkerProcess::WorkerProcess(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}

WorkerProcess::~WorkerProcess() { Shutdown(absl::Now()); }

const std::string& WorkerProcess::address() const { return parts_->address; }
const std::string& WorkerProcess::summary() const { return parts_->summary; }
WorkerService& WorkerProcess::worker() { return *parts_->worker; }
int64_t WorkerProcess::in_flight() const { return parts_->in_flight->count(); }
bool WorkerProcess::ready() const { return parts_->health->ready(); }

absl::StatusOr<std::unique_ptr<WorkerProcess>> WorkerProcess::Start(const WorkerFlags& flags) {
  if (absl::Status logging = ConfigureLogging(flags); !logging.ok()) return logging;
  if (absl::Status nccl = CheckNcclRuntime(); !nccl.ok()) return nccl;

  WorkerOptions options;
  options.default_backend = flags.backend;
  options.default_gpu_data_plane = flags.gpu_data_plane;
  auto data_plane_host = ResolveDataPlaneHost(flags.data_plane_host, getenv("GLOO_SOCKET_IFNAME"));
  if (!data_plane_host.ok()) return data_plane_host.status();
  options.data_plane_host = *data_plane_host;
  options.device = flags.device;
  options.onesided_sm_budget = flags.onesided_sm_budget;
  options.onesided_receive_buffers = flags.onesided_receive_buffers;
  auto backend = ResolveBackend(options.default_backend, "auto");
  if (!backend.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("--backend: ", backend.status().message()));
  }
  if (auto device = CheckDevice(options.device, VisibleGpuCount(), *backend); !device.ok()) {
    return absl::Status(device.code(), absl::StrCat("--", device.message()));
  }
  // The memory cap (issue 13 items 2 and 10): the flag, or 3/4 of what this
  // process may use (the machine's or cgroup's memory; the GPU's when it is
  // larger and the backend is NCCL). The Rendezvous store's budget is carved
  // out of it, so the store counts in the cap.
  int64_t memory_cap = flags.memory_cap_bytes;
  if (memory_cap == 0) {
    memory_cap = DefaultMemoryCapBytes();
    if (*backend == "nccl") {
      if (auto gpu = DescribeGpu(options.device); gpu.ok()) {
        memory_cap = std::max(memory_cap, gpu->memory_bytes / 4 * 3);
      }
    }
  }
  StoreLimits store_limits = flags.store;
  store_limits.require_open_generation = true;
  store_limits.max_total_bytes =
      std::max<int64_t>(1, std::min(store_limits.max_total_bytes, memory_cap / 16));
  options.memory_cap_bytes = std::max<int64_t>(1, memory_cap - store_limits.max_total_bytes);
  options.limits = flags.limits;
  options.checkpoint_dirs = flags.checkpoint_dirs;
  options.enable_echo = flags.enable_echo;

  // Transport security: TLS / mTLS from files, a bearer token, plaintext only
  // on loopback unless --allow-insecure (proto/rpc/tls_credentials.h).
  rpc::ServerSecurityOptions security;
  security.listen = flags.listen;
  security.tls_cert = flags.tls_cert;
  security.tls_key = flags.tls_key;
  security.tls_client_ca = flags.tls_client_ca;
  security.tls_peer_ca = flags.tls_peer_ca;
  security.refresh_interval = absl::Seconds(flags.tls_refresh_s);
  security.allow_insecure = flags.allow_insecure;
  security.auth_token = !flags.auth_token_file.empty();
  auto credentials = rpc::MakeServerCredentials(security);
  if (!credentials.ok()) return credentials.status();
  std::string peer_token;
  if (security.auth_token) {
    auto auth = rpc::BearerTokenAuth::Create(flags.auth_token_file);
    if (!auth.ok()) return auth.status();
    (*credentials)->SetAuthMetadataProcessor(*auth);
    peer_token = (*auth)->CurrentToken();
  }
  auto peer_credentials = rpc::MakePeerChannelCredentials(security, peer_token);
  if (!peer_credentials.ok()) return peer_credentials.status();
  SetPeerChannelCredentials(*peer_credentials);

  auto parts = std::make_unique<Parts>();
  parts->health = std::make_unique<rpc::HealthReporter>();
  parts->rendezvous = std::make_unique<RendezvousService>(store_limits);
  options.rendezvous = parts->rendezvous.get();
  const std::string default_backend = options.default_backend;
  const int device = options.device;
  const int64_t worker_cap = options.memory_cap_bytes;
  parts->worker = std::make_unique<WorkerService>(std::move(options), parts->health.get());

  rpc::EnableDefaultHealthService();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(flags.listen, *credentials, &port);
  builder.SetMaxReceiveMessageSize(flags.max_message_bytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.RegisterService(parts->worker.get());
  builder.RegisterService(parts->rendezvous.get());
  // grpc.reflection.v1 beside Debian's v1alpha (server/reflection_v1.h); it
  // also answers UNIMPLEMENTED for every unknown method.
  parts->reflection_v1 = std::make_unique<ReflectionV1Service>();
  builder.RegisterCallbackGenericService(parts->reflection_v1.get());
  // RPC metrics (the log fields are the worker service's: core/logging.h).
  WorkerService* worker = parts->worker.get();
  auto snapshot = [worker] {
    v1::GetStatusRequest request;
    v1::GetStatusResponse status;
    worker->GetStatus(nullptr, &request, &status);
    return status;
  };
  parts->metrics = std::make_unique<WorkerMetrics>(snapshot);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(parts->metrics->MakeInterceptorFactory());
  // The drain waits for these; not for open health Watch streams, which
  // Shutdown ends (issue 31 item 3: a coordinator watches every worker).
  parts->in_flight =
      std::make_unique<InFlightCalls>(std::vector<std::string>{rpc::kHealthWatchMethod});
  interceptors.push_back(parts->in_flight->MakeInterceptorFactory());
  // Every call's end in the log: failures at warn (proto/rpc/rpc_log.h).
  interceptors.push_back(rpc::MakeRpcLogInterceptorFactory(rpc::WorkerRpcLogOptions()));
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  parts->server = builder.BuildAndStart();
  if (parts->server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot bind ", flags.listen));
  }
  parts->health->Attach(parts->server->GetHealthCheckService());
  parts->reflection_v1->Attach(parts->server.get());
  // The probe server has no sync service: a callback service (UNIMPLEMENTED
  // for every method but health) makes gRPC poll its completion queue.
  parts->probe_unimplemented = std::make_unique<grpc::CallbackGenericService>();
  if (!flags.health_listen.empty()) {
    int probe_port = 0;
    auto probe =
        rpc::StartProbeServer(flags.health_listen, parts->probe_unimplemented.get(), &probe_port);
    if (!probe.ok()) return probe.status();
    parts->probe_server = std::move(*probe);
    parts->health->Attach(parts->probe_server->GetHealthCheckService());
    if (absl::Status written =
            WritePortFile("health-port-file", flags.health_port_file, probe_port);
        !written.ok()) {
      return written;
    }
    spdlog::info("serving grpc.health.v1 only (plaintext, for probes) on {}:{}",
                 HostOf(flags.health_listen), probe_port);
  }

  parts->address = absl::StrCat(HostOf(flags.listen), ":", port);
  parts->worker->SetListenAddress(parts->address);
  if (absl::Status written = WritePortFile("port-file", flags.port_file, port); !written.ok()) {
    return written;
  }
  if (!flags.metrics_listen.empty()) {
    auto started = MetricsServer::Start(flags.metrics_listen, *parts->metrics);
    if (!started.ok()) return started.status();
    parts->metrics_server = std::move(*started);
    spdlog::info("serving Prometheus metrics on http://{}:{}/metrics", HostOf(flags.metrics_listen),
                 parts->metrics_server->port());
    if (absl::Status written = WritePortFile("metrics-port-file", flags.metrics_port_file,
                                             parts->metrics_server->port());
        !written.ok()) {
      return written;
    }
  }
  parts->summary = absl::StrCat("serving moe_ep.v1.Worker and moe_ep.v1.Rendezvous on ",
                                parts->address, " (backend flag ", default_backend, " -> ",
                                *backend, ", device ", device, ", memory cap ", worker_cap,
                                " bytes + ", store_limits.max_total_bytes, " of Rendezvous store)");
  spdlog::info("{}", parts->summary);
  return std::unique_ptr<WorkerProcess>(new WorkerProcess(std::move(parts)));
}

bool WorkerProcess::Shutdown(absl::Time drain_deadline) {
  Parts& p = *parts_;
  absl::MutexLock lock(&p.shutdown_mu);
  if (p.stopped) return true;
  p.stopped = true;
  p.health->Shutdown();
  p.worker->BeginShutdown();  // new calls: UNAVAILABLE "shutting down"
  // Wait for the calls, not for the connections: Shutdown(deadline) would
  // also wait for every idle client to read our GOAWAY, i.e. the whole drain
  // (server/in_flight_calls.h). Shutdown(now) then cancels whatever still
  // runs and closes the idle connections at once.
  const bool idle = p.in_flight->WaitIdle(drain_deadline);
  if (!idle) {
    spdlog::warn("{} call(s) still running at the drain deadline: cancelling them",
                 p.in_flight->count());
  }
  const auto now = std::chrono::system_clock::now();
  p.server->Shutdown(now);
  if (p.probe_server != nullptr) p.probe_server->Shutdown(now);
  p.server->Wait();
  if (p.probe_server != nullptr) p.probe_server->Wait();
  p.metrics_server.reset();
  return idle;
}

}  // namespace moe_ep::server
