// moe-ep-worker: one expert-parallel MoE worker (one per rank), serving the
// moe_ep.v1.Worker and moe_ep.v1.Rendezvous services, grpc.health.v1 and
// server reflection. Flags and wiring only (STYLE §1); see
// server/worker_service.h for the behaviour. Source: DESIGN §8.
//
// After binding it prints exactly one line to stdout,
//   moe-ep-worker listening on HOST:PORT
// (the local cluster launcher parses it). SIGTERM / SIGINT: health goes
// NOT_SERVING, new calls get UNAVAILABLE, in-flight calls may finish until
// --drain_timeout_ms (then they are cancelled; one stuck in a collective
// gets 0.5 s more, then the process exits anyway, which drops the
// communicator so that its peers fail instead of hanging); exit 0. An idle
// worker exits at once.

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/flags/usage_config.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/ext/proto_server_reflection_plugin.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "server/auth.h"
#include "server/device_info.h"
#include "server/grpc_store.h"
#include "server/health.h"
#include "server/in_flight_calls.h"
#include "server/logging.h"
#include "server/metrics.h"
#include "server/rendezvous_service.h"
#include "server/tls_credentials.h"
#include "server/worker_service.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "host:port to serve on; port 0 picks a free port (printed on stdout)");
ABSL_FLAG(std::string, backend, "auto",
          "data-plane backend when Join does not name one: auto (gloo without a GPU), gloo, nccl");
ABSL_FLAG(int64_t, memory_cap_bytes, 0,
          "bytes of workspace + expert weights this worker may hold; 0 = unlimited");
ABSL_FLAG(std::string, log_level, "info",
          "spdlog level: trace, debug, info, warn, error, critical, off");
ABSL_FLAG(std::string, data_plane_host, "127.0.0.1",
          "address the Gloo TCP data plane binds to when Join does not name one");
ABSL_FLAG(std::string, port_file, "", "optional file to write the bound port to");
ABSL_FLAG(int64_t, drain_timeout_ms, 5000,
          "on SIGTERM/SIGINT: health goes NOT_SERVING, new calls are refused, and in-flight "
          "calls may run this long before they are cancelled (an idle worker exits at once)");
// Control-plane security and limits (server/tls_credentials.h, server/auth.h).
ABSL_FLAG(std::string, tls_cert, "", "PEM certificate chain of this worker; TLS when set");
ABSL_FLAG(std::string, tls_key, "", "PEM private key of --tls_cert");
ABSL_FLAG(std::string, tls_client_ca, "",
          "PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)");
ABSL_FLAG(std::string, tls_peer_ca, "",
          "PEM CA bundle that signed the other workers' certificates (rendezvous calls to rank "
          "0); default --tls_client_ca, else the system roots");
ABSL_FLAG(int32_t, tls_refresh_s, 10, "seconds between re-reads of the TLS files (hot reload)");
ABSL_FLAG(bool, allow_insecure, false,
          "serve plaintext on a non-loopback --listen address (plaintext on loopback is always "
          "allowed)");
ABSL_FLAG(std::string, auth_token_file, "",
          "file holding a bearer token every call must send as \"authorization: Bearer <token>\" "
          "(needs TLS; re-read when it changes)");
ABSL_FLAG(int32_t, max_message_bytes, 256 << 20,
          "largest request this worker accepts, bytes (Forward carries [T, H] tensors)");
// Observability (server/metrics.h, server/logging.h).
ABSL_FLAG(std::string, metrics_listen, "",
          "host:port of the Prometheus /metrics endpoint (plain HTTP); empty = off; port 0 picks "
          "a free port (logged, and written to --metrics_port_file)");
ABSL_FLAG(std::string, metrics_port_file, "", "optional file to write the metrics port to");
ABSL_FLAG(std::string, health_listen, "",
          "host:port of a plaintext port serving only grpc.health.v1, for probes that cannot "
          "do TLS or send a token (Kubernetes gRPC probes); empty = off");
ABSL_FLAG(std::string, health_port_file, "",
          "optional file to write the bound --health_listen port to");
ABSL_FLAG(std::string, log_format, "text",
          "text, or json (one JSON object per line with rank, generation and epoch)");
ABSL_FLAG(int32_t, device, 0,
          "CUDA device ordinal the NCCL backend runs on (one worker per GPU: 0, 1, ...); "
          "ignored by gloo");

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
  // --help / --helpshort list this file's flags (absl's default matches only
  // files named like the program, "moe-ep-worker.cc", and found none).
  absl::FlagsUsageConfig usage;
  usage.contains_help_flags = [](absl::string_view file) {
    return absl::EndsWith(file, "server/main.cc");
  };
  usage.contains_helpshort_flags = usage.contains_help_flags;
  absl::SetFlagsUsageConfig(usage);
  absl::SetProgramUsageMessage(
      "moe-ep-worker [--listen HOST:PORT] [--backend auto|gloo|nccl] [--device ORDINAL] "
      "[--tls_cert PEM --tls_key PEM [--tls_client_ca PEM]] [--health_listen HOST:PORT] ... "
      "(--help lists every flag)");
  absl::ParseCommandLine(argc, argv);

  // Logs go to stderr: stdout carries only the "listening on" line.
  spdlog::set_default_logger(spdlog::stderr_color_mt("moe-ep-worker"));
  const std::string level_name = absl::GetFlag(FLAGS_log_level);
  const spdlog::level::level_enum level = spdlog::level::from_str(level_name);
  if (level == spdlog::level::off && level_name != "off") {
    return Fail(absl::StrCat("--log_level: unknown level \"", level_name,
                             "\" (trace, debug, info, warn, error, critical, off)"));
  }
  spdlog::set_level(level);
  if (absl::Status format = moe_ep::server::ConfigureLogFormat(absl::GetFlag(FLAGS_log_format));
      !format.ok()) {
    return Fail(std::string(format.message()));
  }

  moe_ep::server::WorkerOptions options;
  options.memory_cap_bytes = absl::GetFlag(FLAGS_memory_cap_bytes);
  options.default_backend = absl::GetFlag(FLAGS_backend);
  options.data_plane_host = absl::GetFlag(FLAGS_data_plane_host);
  options.device = absl::GetFlag(FLAGS_device);
  if (options.memory_cap_bytes < 0) {
    return Fail(absl::StrCat("--memory_cap_bytes: expected >= 0, got ", options.memory_cap_bytes));
  }
  auto backend = moe_ep::server::ResolveBackend(options.default_backend, "auto");
  if (!backend.ok()) return Fail(absl::StrCat("--backend: ", backend.status().message()));
  if (auto device =
          moe_ep::server::CheckDevice(options.device, moe_ep::server::VisibleGpuCount(), *backend);
      !device.ok()) {
    return Fail(absl::StrCat("--", device.message()));
  }
  const int64_t drain_ms = absl::GetFlag(FLAGS_drain_timeout_ms);
  if (drain_ms < 0) return Fail(absl::StrCat("--drain_timeout_ms: expected >= 0, got ", drain_ms));
  const int max_message_bytes = absl::GetFlag(FLAGS_max_message_bytes);
  if (max_message_bytes < 1) {
    return Fail(absl::StrCat("--max_message_bytes: expected >= 1, got ", max_message_bytes));
  }

  // Transport security: TLS / mTLS from files, a bearer token, plaintext only
  // on loopback unless --allow_insecure (server/tls_credentials.h).
  moe_ep::server::ServerSecurityOptions security;
  security.listen = absl::GetFlag(FLAGS_listen);
  security.tls_cert = absl::GetFlag(FLAGS_tls_cert);
  security.tls_key = absl::GetFlag(FLAGS_tls_key);
  security.tls_client_ca = absl::GetFlag(FLAGS_tls_client_ca);
  security.tls_peer_ca = absl::GetFlag(FLAGS_tls_peer_ca);
  security.refresh_interval = absl::Seconds(absl::GetFlag(FLAGS_tls_refresh_s));
  security.allow_insecure = absl::GetFlag(FLAGS_allow_insecure);
  const std::string token_file = absl::GetFlag(FLAGS_auth_token_file);
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
  moe_ep::server::WorkerService worker(options, &health);
  moe_ep::server::RendezvousService rendezvous;

  moe_ep::server::EnableDefaultHealthService();
  grpc::reflection::InitProtoReflectionServerBuilderPlugin();
  grpc::ServerBuilder builder;
  const std::string listen = absl::GetFlag(FLAGS_listen);
  int port = 0;
  builder.AddListeningPort(listen, *credentials, &port);
  builder.SetMaxReceiveMessageSize(max_message_bytes);
  builder.SetMaxSendMessageSize(kMaxMessageBytes);
  builder.RegisterService(&worker);
  builder.RegisterService(&rendezvous);
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
  // The probe server has no sync service: a callback service (UNIMPLEMENTED
  // for every method but health) makes gRPC poll its completion queue.
  grpc::CallbackGenericService probe_unimplemented;
  std::unique_ptr<grpc::Server> probe_server;
  if (const std::string health_listen = absl::GetFlag(FLAGS_health_listen);
      !health_listen.empty()) {
    grpc::ServerBuilder probe_builder;
    int probe_port = 0;
    probe_builder.AddListeningPort(health_listen, grpc::InsecureServerCredentials(), &probe_port);
    probe_builder.RegisterCallbackGenericService(&probe_unimplemented);
    probe_server = probe_builder.BuildAndStart();
    if (probe_server == nullptr || probe_port == 0) {
      return Fail(absl::StrCat("--health_listen: cannot bind ", health_listen));
    }
    health.Attach(probe_server->GetHealthCheckService());
    if (const std::string file = absl::GetFlag(FLAGS_health_port_file); !file.empty()) {
      std::ofstream out(file);
      out << probe_port << "\n";
      if (!out) return Fail(absl::StrCat("--health_port_file: cannot write ", file));
    }
    spdlog::info("serving grpc.health.v1 only (plaintext, for probes) on {}:{}",
                 HostOf(health_listen), probe_port);
  }

  const std::string bound = absl::StrCat(HostOf(listen), ":", port);
  worker.SetListenAddress(bound);
  const std::string port_file = absl::GetFlag(FLAGS_port_file);
  if (!port_file.empty()) {
    std::ofstream out(port_file);
    out << port << "\n";
    if (!out) return Fail(absl::StrCat("--port_file: cannot write ", port_file));
  }
  std::unique_ptr<moe_ep::server::MetricsServer> metrics_server;
  if (const std::string metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
      !metrics_listen.empty()) {
    auto started = moe_ep::server::MetricsServer::Start(metrics_listen, metrics);
    if (!started.ok()) return Fail(std::string(started.status().message()));
    metrics_server = std::move(*started);
    spdlog::info("serving Prometheus metrics on http://{}:{}/metrics", HostOf(metrics_listen),
                 metrics_server->port());
    if (const std::string file = absl::GetFlag(FLAGS_metrics_port_file); !file.empty()) {
      std::ofstream out(file);
      out << metrics_server->port() << "\n";
      if (!out) return Fail(absl::StrCat("--metrics_port_file: cannot write ", file));
    }
  }
  std::cout << "moe-ep-worker listening on " << bound << std::endl;
  spdlog::info(
      "serving moe_ep.v1.Worker and moe_ep.v1.Rendezvous on {} (backend flag {} -> {}, "
      "device {}, memory cap {} bytes)",
      bound, options.default_backend, *backend, options.device, options.memory_cap_bytes);

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
