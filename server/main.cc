// moe-ep-worker: one expert-parallel MoE worker (one per rank), serving the
// moe_ep.v1.Worker and moe_ep.v1.Rendezvous services, grpc.health.v1 and
// server reflection (v1alpha and v1). Flags and wiring only (STYLE §1); see
// server/worker_service.h for the behaviour. Source: DESIGN §8.
//
// After binding it prints exactly one line to stdout,
//   moe-ep-worker listening on HOST:PORT
// (the local cluster launcher parses it). SIGTERM / SIGINT: health goes
// NOT_SERVING, new calls get UNAVAILABLE, in-flight calls may finish until
// --drain-timeout-ms (then they are cancelled; one stuck in a collective
// gets 0.5 s more, then the process exits anyway, which drops the
// communicator so that its peers fail instead of hanging); exit 0. An idle
// worker exits at once.

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/auth.h"
#include "server/data_plane_host.h"
#include "server/device_info.h"
#include "server/grpc_store.h"
#include "server/health.h"
#include "server/in_flight_calls.h"
#include "server/logging.h"
#include "server/memory_limit.h"
#include "server/metrics.h"
#include "server/probe_server.h"
#include "server/reflection_v1.h"
#include "server/rendezvous_service.h"
#include "server/tls_credentials.h"
#include "server/worker_flags.h"
#include "server/worker_service.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace {

constexpr int kMaxMessageBytes = 256 << 20;  // Forward carries [T, H] tensors
// After the drain deadline, how long a call stuck in a collective may hold
// the process before it exits anyway.
constexpr absl::Duration kExitGrace = absl::Milliseconds(500);

int g_signal_pipe[2] = {-1, -1};

void OnStopSignal(int signal_number) {
  // write() is async-signal-safe; a full pipe only drops a repeated signal.
  const ssize_t ignored = write(g_signal_pipe[1], &signal_number, sizeof(signal_number));
  (void)ignored;
}

int Fail(const std::string& message) {
  spdlog::error("{}", message);
  std::cerr << "moe-ep-worker: " << message << std::endl;
  return 2;
}

// "host:port" -> host ("[::1]:0" -> "[::1]").
std::string HostOf(const std::string& address) {
  const size_t colon = address.rfind(':');
  return colon == std::string::npos ? address : address.substr(0, colon);
}

}  // namespace

int main(int argc, char** argv) {
  moe_ep::server::WorkerFlags flags;
  if (std::optional<int> exit_code =
          moe_ep::server::ParseWorkerFlags(argc, argv, &flags, std::cout, std::cerr)) {
    return *exit_code;
  }

  // Logs go to stderr: stdout carries only the "listening on" line.
  spdlog::set_default_logger(spdlog::stderr_color_mt("moe-ep-worker"));
  spdlog::set_level(spdlog::level::from_str(flags.log_level));  // checked by the parser
  if (absl::Status format = moe_ep::server::ConfigureLogFormat(flags.log_format); !format.ok()) {
    return Fail(std::string(format.message()));
  }

  moe_ep::server::WorkerOptions options;
  options.default_backend = flags.backend;
  auto data_plane_host =
      moe_ep::server::ResolveDataPlaneHost(flags.data_plane_host, getenv("GLOO_SOCKET_IFNAME"));
  if (!data_plane_host.ok()) return Fail(std::string(data_plane_host.status().message()));
  options.data_plane_host = *data_plane_host;
  options.device = flags.device;
  auto backend = moe_ep::server::ResolveBackend(options.default_backend, "auto");
  if (!backend.ok()) return Fail(absl::StrCat("--backend: ", backend.status().message()));
  if (auto device =
          moe_ep::server::CheckDevice(options.device, moe_ep::server::VisibleGpuCount(), *backend);
      !device.ok()) {
    return Fail(absl::StrCat("--", device.message()));
  }
  // The memory cap (issue 13 items 2 and 10): the flag, or 3/4 of what this
  // process may use (the machine's or cgroup's memory; the GPU's when it is
  // larger and the backend is NCCL). The Rendezvous store's budget is carved
  // out of it, so the store counts in the cap.
  int64_t memory_cap = flags.memory_cap_bytes;
  if (memory_cap == 0) {
    memory_cap = moe_ep::server::DefaultMemoryCapBytes();
    if (*backend == "nccl") {
      if (auto gpu = moe_ep::server::DescribeGpu(options.device); gpu.ok()) {
        memory_cap = std::max(memory_cap, gpu->memory_bytes / 4 * 3);
      }
    }
  }
  moe_ep::server::StoreLimits store_limits = flags.store;
  store_limits.require_open_generation = true;
  store_limits.max_total_bytes =
      std::max<int64_t>(1, std::min(store_limits.max_total_bytes, memory_cap / 16));
  options.memory_cap_bytes = std::max<int64_t>(1, memory_cap - store_limits.max_total_bytes);
  options.limits = flags.limits;
  options.checkpoint_dirs = flags.checkpoint_dirs;
  const int64_t drain_ms = flags.drain_timeout_ms;        // >= 0, checked by the parser
  const int max_message_bytes = flags.max_message_bytes;  // >= 1, checked by the parser

  // Transport security: TLS / mTLS from files, a bearer token, plaintext only
  // on loopback unless --allow-insecure (server/tls_credentials.h).
  moe_ep::server::ServerSecurityOptions security;
  security.listen = flags.listen;
  security.tls_cert = flags.tls_cert;
  security.tls_key = flags.tls_key;
  security.tls_client_ca = flags.tls_client_ca;
  security.tls_peer_ca = flags.tls_peer_ca;
  security.refresh_interval = absl::Seconds(flags.tls_refresh_s);
  security.allow_insecure = flags.allow_insecure;
  const std::string token_file = flags.auth_token_file;
  security.auth_token = !token_file.empty();
  auto credentials = moe_ep::server::MakeServerCredentials(security);
  if (!credentials.ok()) return Fail(std::string(credentials.status().message()));
  std::string peer_token;
  if (security.auth_token) {
    auto auth = moe_ep::server::BearerTokenAuth::Create(token_file);
    if (!auth.ok()) return Fail(std::string(auth.status().message()));
    (*credentials)->SetAuthMetadataProcessor(*auth);
    peer_token = (*auth)->CurrentToken();
  }
  auto peer_credentials = moe_ep::server::MakePeerChannelCredentials(security, peer_token);
  if (!peer_credentials.ok()) return Fail(std::string(peer_credentials.status().message()));
  moe_ep::server::SetPeerChannelCredentials(*peer_credentials);

  // Stop signals: a handler (run on whichever thread gets the signal) writes
  // the signal number into a pipe that this thread reads after start-up.
  if (pipe(g_signal_pipe) != 0) return Fail("cannot create the signal pipe");
  struct sigaction action = {};
  action.sa_handler = OnStopSignal;
  sigemptyset(&action.sa_mask);
  sigaction(SIGTERM, &action, nullptr);
  sigaction(SIGINT, &action, nullptr);

  moe_ep::server::HealthReporter health;
  moe_ep::server::RendezvousService rendezvous(store_limits);
  options.rendezvous = &rendezvous;
  moe_ep::server::WorkerService worker(options, &health);

  moe_ep::server::EnableDefaultHealthService();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string listen = flags.listen;
  int port = 0;
  builder.AddListeningPort(listen, *credentials, &port);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.RegisterService(&worker);
  builder.RegisterService(&rendezvous);
  // grpc.reflection.v1 beside Debian's v1alpha (server/reflection_v1.h); it
  // also answers UNIMPLEMENTED for every unknown method.
  moe_ep::server::ReflectionV1Service reflection_v1;
  builder.RegisterCallbackGenericService(&reflection_v1);
  // RPC metrics (the log fields are the worker service's: server/logging.h).
  auto snapshot = [&worker] {
    moe_ep::v1::GetStatusRequest request;
    moe_ep::v1::GetStatusResponse status;
    worker.GetStatus(nullptr, &request, &status);
    return status;
  };
  moe_ep::server::WorkerMetrics metrics(snapshot);
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> interceptors;
  interceptors.push_back(metrics.MakeInterceptorFactory());
  moe_ep::server::InFlightCalls in_flight;  // the SIGTERM drain waits for these
  interceptors.push_back(in_flight.MakeInterceptorFactory());
  builder.experimental().SetInterceptorCreators(std::move(interceptors));
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return Fail(absl::StrCat("--listen: cannot bind ", listen));
  }
  health.Attach(server->GetHealthCheckService());
  reflection_v1.Attach(server.get());
  // The probe server has no sync service: a callback service (UNIMPLEMENTED
  // for every method but health) makes gRPC poll its completion queue.
  grpc::CallbackGenericService probe_unimplemented;
  std::unique_ptr<grpc::Server> probe_server;
  if (const std::string health_listen = flags.health_listen; !health_listen.empty()) {
    int probe_port = 0;
    auto probe = moe_ep::server::StartProbeServer(health_listen, &probe_unimplemented, &probe_port);
    if (!probe.ok()) return Fail(std::string(probe.status().message()));
    probe_server = std::move(*probe);
    health.Attach(probe_server->GetHealthCheckService());
    if (const std::string file = flags.health_port_file; !file.empty()) {
      std::ofstream out(file);
      out << probe_port << "\n";
      if (!out) return Fail(absl::StrCat("--health-port-file: cannot write ", file));
    }
    spdlog::info("serving grpc.health.v1 only (plaintext, for probes) on {}:{}",
                 HostOf(health_listen), probe_port);
  }

  const std::string bound = absl::StrCat(HostOf(listen), ":", port);
  worker.SetListenAddress(bound);
  const std::string port_file = flags.port_file;
  if (!port_file.empty()) {
    std::ofstream out(port_file);
    out << port << "\n";
    if (!out) return Fail(absl::StrCat("--port-file: cannot write ", port_file));
  }
  std::unique_ptr<moe_ep::server::MetricsServer> metrics_server;
  if (const std::string metrics_listen = flags.metrics_listen; !metrics_listen.empty()) {
    auto started = moe_ep::server::MetricsServer::Start(metrics_listen, metrics);
    if (!started.ok()) return Fail(std::string(started.status().message()));
    metrics_server = std::move(*started);
    spdlog::info("serving Prometheus metrics on http://{}:{}/metrics", HostOf(metrics_listen),
                 metrics_server->port());
    if (const std::string file = flags.metrics_port_file; !file.empty()) {
      std::ofstream out(file);
      out << metrics_server->port() << "\n";
      if (!out) return Fail(absl::StrCat("--metrics-port-file: cannot write ", file));
    }
  }
  std::cout << "moe-ep-worker listening on " << bound << std::endl;
  spdlog::info(
      "serving moe_ep.v1.Worker and moe_ep.v1.Rendezvous on {} (backend flag {} -> {}, "
      "device {}, memory cap {} bytes + {} of Rendezvous store)",
      bound, options.default_backend, *backend, options.device, options.memory_cap_bytes,
      store_limits.max_total_bytes);

  int signal_number = 0;
  while (read(g_signal_pipe[0], &signal_number, sizeof(signal_number)) < 0 && errno == EINTR) {
  }
  const absl::Time drain_deadline = absl::Now() + absl::Milliseconds(drain_ms);
  spdlog::info("signal {}: NOT_SERVING, draining {} in-flight call(s) for up to {} ms",
               signal_number, in_flight.count(), drain_ms);
  health.Shutdown();
  worker.BeginShutdown();  // new calls: UNAVAILABLE "shutting down"
  // A handler stuck in a collective returns only at the group's timeout; do
  // not let it hold the process past the drain deadline plus a short grace.
  // Exiting closes the data plane's sockets (Gloo) or ends the process that
  // holds the communicator (NCCL), so the peers fail with UNAVAILABLE /
  // DEADLINE_EXCEEDED instead of waiting on this rank.
  std::thread([drain_deadline] {
    absl::SleepFor(drain_deadline + kExitGrace - absl::Now());
    spdlog::warn("a call is still stuck {} after the drain deadline; exiting",
                 absl::FormatDuration(kExitGrace));
    std::fflush(stdout);
    std::_Exit(0);
  }).detach();
  // Wait for the calls, not for the connections: Shutdown(deadline) would
  // also wait for every idle client to read our GOAWAY, i.e. the whole drain
  // (server/in_flight_calls.h). Shutdown(now) then cancels whatever still
  // runs and closes the idle connections at once.
  if (!in_flight.WaitIdle(drain_deadline)) {
    spdlog::warn("{} call(s) still running at the drain deadline: cancelling them",
                 in_flight.count());
  }
  const auto now = std::chrono::system_clock::now();
  server->Shutdown(now);
  if (probe_server != nullptr) probe_server->Shutdown(now);
  server->Wait();
  spdlog::info("stopped");
  return 0;
}
