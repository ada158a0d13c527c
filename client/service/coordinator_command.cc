#include "client/service/coordinator_command.h"

#include <unistd.h>

#include <chrono>
#include <mutex>
#include <optional>
#include <thread>

#include "CLI/CLI.hpp"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/cli_validators.h"
#include "client/desired_state.h"
#include "client/group_keeper.h"
#include "client/service/coordinator_metrics.h"
#include "client/service/coordinator_service.h"
#include "client/targets.h"
#include "core/logging.h"
#include "core/status_macros.h"
#include "grpcpp/grpcpp.h"
#include "grpcpp/health_check_service_interface.h"
#include "proto/rpc/auth.h"
#include "proto/rpc/health.h"
#include "proto/rpc/probe_server.h"
#include "proto/rpc/rpc_log.h"
#include "proto/rpc/tls_credentials.h"
#include "spdlog/sinks/stdout_color_sinks.h"
#include "spdlog/spdlog.h"

namespace moe_ep::client {
namespace {

constexpr const char kReadinessName[] = "moe_ep.v1.Coordinator";

absl::StatusOr<std::optional<v1::DesiredState>> InitialState(
    const CoordinatorCommandOptions& options) {
  if (!options.state_file.empty() && !options.targets.empty()) {
    return absl::InvalidArgumentError("--state and --targets: give one of them, not both");
  }
  if (!options.state_file.empty()) {
    ASSIGN_OR_RETURN(v1::DesiredState state, ReadDesiredStateFile(options.state_file));
    return std::optional<v1::DesiredState>(state);
  }
  if (options.targets.empty()) return std::optional<v1::DesiredState>();
  ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(options.targets));
  v1::DesiredState state;
  for (const std::string& t : targets) state.add_targets(t);
  state.set_backend(options.backend);
  state.set_model(options.model);
  state.set_layers(options.layers);
  state.set_capacity_tokens(options.capacity_tokens);
  state.mutable_experts()->set_kind(options.experts == "identity" ? v1::EXPERT_KIND_IDENTITY
                                                                  : v1::EXPERT_KIND_SWIGLU);
  state.mutable_experts()->set_seed(options.seed);
  state.set_group_timeout_ms(options.group_timeout_ms);
  return std::optional<v1::DesiredState>(state);
}

constexpr char kLoggerName[] = "moe-ep-coordinator";

// The process's default logger: stderr, --log-level, --log-format without
// the worker's fields (core/logging.h).
absl::Status ConfigureCoordinatorLog(const CoordinatorCommandOptions& options) {
  const spdlog::level::level_enum level = spdlog::level::from_str(options.log_level);
  if (level == spdlog::level::off && options.log_level != "off") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--log-level: expected trace, debug, info, warn, error, critical or off, got \"",
        options.log_level, "\""));
  }
  std::shared_ptr<spdlog::logger> logger = spdlog::get(kLoggerName);
  if (logger == nullptr) logger = spdlog::stderr_color_mt(kLoggerName);
  spdlog::set_default_logger(logger);
  spdlog::set_level(level);
  return core::ConfigureLogFormat(options.log_format, core::LogFields::kPlain);
}

// The level of a group event in the log: losses and failures warn.
spdlog::level::level_enum EventLevel(const std::string& kind) {
  for (const char* warn :
       {"rank_lost", "group_broken", "attempt_failed", "resolve_failed", "readd_failed", "lease"}) {
    if (kind == warn) return spdlog::level::warn;
  }
  return spdlog::level::info;
}

// "host" of "host:port" (port 0 included), brackets of IPv6 kept.
std::string HostOf(const std::string& listen) {
  const size_t colon = listen.rfind(':');
  return colon == std::string::npos ? listen : listen.substr(0, colon);
}

}  // namespace

void AddCoordinatorFlags(CLI::App* cmd, CoordinatorCommandOptions* o) {
  cmd->add_option("--state", o->state_file,
                  "desired state: a moe_ep.v1.DesiredState in JSON (a ConfigMap in Kubernetes)");
  cmd->add_option("--targets", o->targets, "or the desired state from flags: host:port,...");
  cmd->add_option("--backend", o->backend, "with --targets: gloo | nccl | auto")
      ->check(CLI::IsMember({"gloo", "nccl", "auto"}))
      ->capture_default_str();
  cmd->add_option("--model", o->model, "with --targets: config.json path or preset");
  cmd->add_option("--layers", o->layers, "with --targets: sparse layers to load (0 = 3)")
      ->check(NonNegative());
  cmd->add_option("--capacity", o->capacity_tokens,
                  "with --targets: workspace capacity N, tokens per rank (0 = 384)")
      ->check(NonNegative());
  cmd->add_option("--experts", o->experts, "with --targets: swiglu | identity")
      ->check(CLI::IsMember({"swiglu", "identity"}))
      ->capture_default_str();
  cmd->add_option("--seed", o->seed, "with --targets: seed of the expert weights")
      ->capture_default_str();
  cmd->add_option("--group-timeout-ms", o->group_timeout_ms,
                  "with --targets: collective timeout of the group, ms (0 = 30000)")
      ->check(NonNegative());
  cmd->add_option("--listen", o->listen, "host:port of moe_ep.v1.Coordinator and health")
      ->capture_default_str();
  cmd->add_option("--tls-cert", o->tls_cert,
                  "PEM certificate: served, and presented to the workers (mutual TLS)");
  cmd->add_option("--tls-key", o->tls_key, "PEM key of --tls-cert");
  cmd->add_option("--tls-client-ca", o->tls_client_ca,
                  "PEM CA bundle: clients must present a certificate it signed");
  cmd->add_option("--tls-peer-ca", o->tls_peer_ca,
                  "PEM CA bundle of the workers' certificates (default: --tls-client-ca)");
  cmd->add_option("--tls-refresh-s", o->tls_refresh_s, "re-read the TLS files every S seconds")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_flag("--allow-insecure", o->allow_insecure,
                "serve plaintext on a non-loopback --listen (trusted networks only)");
  cmd->add_option("--auth-token-file", o->auth_token_file,
                  "bearer token: required from clients, sent to the workers (needs TLS)");
  cmd->add_option("--health-listen", o->health_listen,
                  "host:port serving grpc.health.v1 only, in plaintext (kubelet probes)");
  cmd->add_option("--metrics-listen", o->metrics_listen, "host:port of Prometheus /metrics");
  cmd->add_option("--probe-interval-ms", o->probe_interval_ms, "GetStatus probe of every rank, ms")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--probe-timeout-ms", o->probe_timeout_ms, "deadline of each GetStatus probe, ms")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--probe-failure-threshold", o->probe_failure_threshold,
                  "a rank whose probes fail this many times in a row is UNRESPONSIVE (missed "
                  "deadlines) or UNREACHABLE, as a kubelet probe's failureThreshold; a broken "
                  "health Watch counts at once")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--log-level", o->log_level, "log level (stderr)")
      ->check(CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"}))
      ->capture_default_str();
  cmd->add_option("--log-format", o->log_format,
                  "text (timestamp, level, message) or json (one object per line)")
      ->check(CLI::IsMember({"text", "json"}))
      ->capture_default_str();
  cmd->add_option("--backoff-initial-ms", o->backoff_initial_ms,
                  "wait after a failed formation, doubled each time, ms")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--backoff-max-ms", o->backoff_max_ms, "longest wait between attempts, ms")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--settle-timeout-ms", o->settle_timeout_ms,
                  "every rank must report health SERVING this soon after a formation, ms")
      ->capture_default_str()
      ->check(Positive());
  cmd->add_option("--on-rank-loss", o->on_rank_loss,
                  "a rank lost from a group with a placement (any backend): mask-covered (keep it "
                  "masked and re-add the rank when restarted, while every expert has a live "
                  "replica), "
                  "mask-always (also when experts are lost), re-form (new generation)")
      ->capture_default_str()
      ->check(CLI::IsMember({"mask-covered", "mask-always", "re-form"}));
  cmd->add_option("--owner", o->owner,
                  "owner id of the workers' lease this coordinator holds and takes over "
                  "(default coordinator@HOST; none = no lease)");
  cmd->add_option("--lease-ttl-ms", o->lease_ttl_ms,
                  "time to live of the lease, renewed every third of it; a dead coordinator's "
                  "lease lapses after it")
      ->capture_default_str()
      ->check(CLI::Range(int64_t{30}, int64_t{3600000}));
  cmd->add_flag("--check", o->check_only,
                "validate the desired state, print its ranks and exit (does not serve)");
}

namespace {

// --check: the desired state's ranks and sizes, without serving.
absl::Status PrintDesiredStateCheck(const std::optional<v1::DesiredState>& initial,
                                    std::ostream& out) {
  if (!initial.has_value()) return absl::InvalidArgumentError("--check needs --state or --targets");
  const v1::DesiredState full = WithDefaults(*initial);
  const std::vector<std::string> targets =
      full.has_headless_service()
          ? HeadlessServiceTargets(full.headless_service())
          : std::vector<std::string>(full.targets().begin(), full.targets().end());
  ASSIGN_OR_RETURN(GroupRequests requests,
                   BuildGroupRequests(full, static_cast<int>(targets.size())));
  out << "desired state OK: " << targets.size() << " ranks (" << absl::StrJoin(targets, ",")
      << "), backend " << full.backend() << ", model " << full.model() << ", "
      << requests.load.size() << " layer(s), capacity " << full.capacity_tokens() << "\n";
  return absl::OkStatus();
}

rpc::ServerSecurityOptions SecurityOf(const CoordinatorCommandOptions& options) {
  rpc::ServerSecurityOptions security;
  security.listen = options.listen;
  security.tls_cert = options.tls_cert;
  security.tls_key = options.tls_key;
  security.tls_client_ca = options.tls_client_ca;
  security.tls_peer_ca = options.tls_peer_ca;
  security.refresh_interval = absl::Seconds(options.tls_refresh_s);
  security.allow_insecure = options.allow_insecure;
  security.auth_token = !options.auth_token_file.empty();
  return security;
}

// The keeper's channel, lease, probe, backoff and rank-loss settings (the
// callbacks are the caller's).
void SetKeeperOptions(const CoordinatorCommandOptions& options, GroupKeeperOptions* keeper) {
  keeper->resolver = options.resolver;
  if (options.owner != "none") {
    char host[256] = {};
    if (gethostname(host, sizeof(host) - 1) != 0) host[0] = '\0';
    keeper->channel.owner_id =
        !options.owner.empty() ? options.owner
                               : absl::StrCat("coordinator@", host[0] != '\0' ? host : "localhost");
    keeper->channel.lease_ttl = absl::Milliseconds(options.lease_ttl_ms);
  }
  keeper->probe_interval = absl::Milliseconds(options.probe_interval_ms);
  keeper->probe_timeout = absl::Milliseconds(options.probe_timeout_ms);
  keeper->probe_failure_threshold = options.probe_failure_threshold;
  keeper->backoff_initial = absl::Milliseconds(options.backoff_initial_ms);
  keeper->backoff_max = absl::Milliseconds(options.backoff_max_ms);
  keeper->settle_timeout = absl::Milliseconds(options.settle_timeout_ms);
  keeper->rank_loss = options.on_rank_loss == "re-form"       ? v1::RANK_LOSS_REFORM
                      : options.on_rank_loss == "mask-always" ? v1::RANK_LOSS_MASK_ALWAYS
                                                              : v1::RANK_LOSS_MASK_COVERED;
}

// Health of the coordinator on every server that serves it: liveness
// always, readiness while the group is ready. SetReady is called under the
// keeper's lock (GroupKeeperOptions::on_ready), never from gRPC's threads.
// Thread-safe.
class CoordinatorHealth {
 public:
  void Add(grpc::HealthCheckServiceInterface* service) {
    std::lock_guard<std::mutex> lock(mu_);
    services_.push_back(service);
    service->SetServingStatus(rpc::kLivenessServiceName, true);
    service->SetServingStatus(kReadinessName, ready_);
  }
  void SetReady(bool ready) {
    std::lock_guard<std::mutex> lock(mu_);
    ready_ = ready;
    for (auto* s : services_) s->SetServingStatus(kReadinessName, ready);
  }
  void Shutdown() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto* s : services_) s->Shutdown();
    services_.clear();
  }

 private:
  std::mutex mu_;
  std::vector<grpc::HealthCheckServiceInterface*> services_;
  bool ready_ = false;
};

// Every call's end in the log (proto/rpc/rpc_log.h): failures of the
// Coordinator service at warn, Apply and Drain at info, the rest debug.
void AddRpcLog(grpc::ServerBuilder* builder) {
  rpc::RpcLogOptions rpc_log;
  rpc_log.warn_prefixes = {"/moe_ep.v1.Coordinator/"};
  rpc_log.info_methods = {"/moe_ep.v1.Coordinator/Apply", "/moe_ep.v1.Coordinator/Drain"};
  std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> creators;
  creators.push_back(rpc::MakeRpcLogInterceptorFactory(std::move(rpc_log)));
  builder->experimental().SetInterceptorCreators(std::move(creators));
}

// --health-listen and --metrics-listen (when given): the plaintext probe
// port and /metrics, each announced on `out` and in the log.
absl::Status ServeProbesAndMetrics(const CoordinatorCommandOptions& options,
                                   CoordinatorHealth& health, CoordinatorMetrics& metrics,
                                   grpc::CallbackGenericService* probe_unimplemented,
                                   std::unique_ptr<grpc::Server>* probe_server, std::ostream& out) {
  if (!options.health_listen.empty()) {
    int probe_port = 0;
    ASSIGN_OR_RETURN(*probe_server, rpc::StartProbeServer(options.health_listen,
                                                          probe_unimplemented, &probe_port));
    health.Add((*probe_server)->GetHealthCheckService());
    out << "moe-ep coordinator: grpc.health.v1 (plaintext) on " << HostOf(options.health_listen)
        << ":" << probe_port << std::endl;
    spdlog::info("grpc.health.v1 (plaintext) on {}:{}", HostOf(options.health_listen), probe_port);
  }
  if (!options.metrics_listen.empty()) {
    RETURN_IF_ERROR(metrics.Serve(options.metrics_listen));
    out << "moe-ep coordinator: metrics on http://" << HostOf(options.metrics_listen) << ":"
        << metrics.port() << "/metrics" << std::endl;
    spdlog::info("metrics on http://{}:{}/metrics", HostOf(options.metrics_listen), metrics.port());
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status RunCoordinatorCommand(const CoordinatorCommandOptions& options, std::ostream& out,
                                   const std::function<bool()>& stop) {
  if (!options.check_only) RETURN_IF_ERROR(ConfigureCoordinatorLog(options));
  ASSIGN_OR_RETURN(std::optional<v1::DesiredState> initial, InitialState(options));
  if (initial.has_value()) RETURN_IF_ERROR(ValidateDesiredState(*initial));
  if (options.check_only) return PrintDesiredStateCheck(initial, out);

  const rpc::ServerSecurityOptions security = SecurityOf(options);
  ASSIGN_OR_RETURN(std::shared_ptr<grpc::ServerCredentials> credentials,
                   rpc::MakeServerCredentials(security));
  std::string token;
  if (security.auth_token) {
    ASSIGN_OR_RETURN(std::shared_ptr<rpc::BearerTokenAuth> auth,
                     rpc::BearerTokenAuth::Create(options.auth_token_file));
    credentials->SetAuthMetadataProcessor(auth);
    token = auth->CurrentToken();
  }
  GroupKeeperOptions keeper_options;
  ASSIGN_OR_RETURN(keeper_options.channel.channel_credentials,
                   rpc::MakePeerChannelCredentials(security, token));
  SetKeeperOptions(options, &keeper_options);
  CoordinatorHealth health;
  keeper_options.on_ready = [&health](bool ready) { health.SetReady(ready); };
  CoordinatorMetrics* metrics_ptr = nullptr;
  keeper_options.on_event = [&metrics_ptr](const v1::GroupEvent& e) {
    if (metrics_ptr != nullptr) metrics_ptr->RecordEvent(e);
    spdlog::log(EventLevel(e.kind()), "generation {}: {}{}: {}", e.generation(), e.kind(),
                e.rank() >= 0 ? absl::StrCat(" rank ", e.rank()) : std::string(), e.message());
  };

  // The metrics object exists before the keeper (events), and is served once
  // the keeper exists (scrapes read its snapshot).
  std::unique_ptr<GroupKeeper> keeper;
  CoordinatorMetrics metrics(
      [&keeper] { return keeper != nullptr ? keeper->Snapshot() : v1::GetGroupResponse(); });
  metrics_ptr = &metrics;
  ASSIGN_OR_RETURN(keeper, GroupKeeper::Start(keeper_options, initial));
  CoordinatorService service(keeper.get());

  rpc::EnableDefaultHealthService();
  grpc::ServerBuilder builder;
  int port = 0;
  builder.AddListeningPort(options.listen, credentials, &port);
  builder.RegisterService(&service);
  AddRpcLog(&builder);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr || port == 0) {
    return absl::UnavailableError(absl::StrCat("--listen: cannot bind ", options.listen));
  }
  health.Add(server->GetHealthCheckService());
  grpc::CallbackGenericService probe_unimplemented;
  std::unique_ptr<grpc::Server> probe_server;
  RETURN_IF_ERROR(
      ServeProbesAndMetrics(options, health, metrics, &probe_unimplemented, &probe_server, out));
  out << "moe-ep coordinator listening on " << HostOf(options.listen) << ":" << port << std::endl;
  spdlog::info(
      "serving moe_ep.v1.Coordinator on {}:{} (owner {}, probes every {} ms, deadline {} "
      "ms, failure threshold {})",
      HostOf(options.listen), port,
      keeper_options.channel.owner_id.empty() ? "none: no lease" : keeper_options.channel.owner_id,
      options.probe_interval_ms, options.probe_timeout_ms, options.probe_failure_threshold);

  while (!(stop && stop())) std::this_thread::sleep_for(std::chrono::milliseconds(100));

  health.Shutdown();
  const auto now = std::chrono::system_clock::now();
  server->Shutdown(now);
  if (probe_server != nullptr) probe_server->Shutdown(now);
  metrics.StopServing();
  keeper.reset();  // no event after this; gives the workers' lease back
  spdlog::info("stopped{}",
               keeper_options.channel.owner_id.empty()
                   ? std::string()
                   : absl::StrCat("; lease of '", keeper_options.channel.owner_id, "' given back"));
  out << "moe-ep coordinator: stopped" << std::endl;
  return absl::OkStatus();
}

}  // namespace moe_ep::client
