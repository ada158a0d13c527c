#include "server/worker_flags.h"

#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "core/command_line.h"

namespace moe_ep::server {
namespace {

// Readable range checks (core/command_line.h) as CLI11 validators.
CLI::Validator AtLeastZero(bool strict) {
  return CLI::Validator(
      [strict](std::string& value) { return core::CheckAtLeast(value, 0, strict); },
      strict ? "POSITIVE" : "NONNEGATIVE");
}

// A flag's two spellings (recorded only for a name with a '-').
struct Spellings {
  std::string name;  // kebab-case, without "--"
  CLI::Option* kebab;
  CLI::Option* old;
};

// Adds `--name` (kebab-case, shown in --help with its default) and, when the
// name has a '-', its hidden underscore alias of earlier releases; records
// both in `spellings`.
template <typename T>
void AddFlag(CLI::App& app, const std::string& name, T* value, const std::string& help,
             const std::vector<CLI::Validator>& checks, std::ostream& err,
             std::vector<Spellings>& spellings) {
  CLI::Option* option;
  if constexpr (std::is_same_v<T, bool>) {
    option = app.add_flag("--" + name, *value, help);
  } else {
    option = app.add_option("--" + name, *value, help)->capture_default_str();
  }
  for (const CLI::Validator& check : checks) option->check(check);
  const std::string alias = core::UnderscoreSpelling(name);
  if (alias == name) return;
  CLI::Option* old;
  if constexpr (std::is_same_v<T, bool>) {
    old = app.add_flag("--" + alias, *value);
  } else {
    old = app.add_option("--" + alias, *value);
  }
  for (const CLI::Validator& check : checks) old->check(check);
  old->group("");  // hidden from --help
  old->each([&err, name, alias](const std::string&) {
    err << "moe-ep-worker: --" << alias << " is deprecated, use --" << name << "\n";
  });
  spellings.push_back({name, option, old});
}

}  // namespace

std::optional<int> ParseWorkerFlags(int argc, const char* const* argv, WorkerFlags* f,
                                    std::ostream& out, std::ostream& err) {
  CLI::App app{
      "moe-ep-worker: one expert-parallel MoE worker (one per GPU rank or CPU slot), serving "
      "moe_ep.v1.Worker, moe_ep.v1.Rendezvous, grpc.health.v1 and server reflection. Flags "
      "are kebab-case; the underscore spellings of earlier releases (--log_level) still work "
      "for this release.",
      "moe-ep-worker"};
  app.set_version_flag("--version", "moe-ep-worker " + std::string(core::Version()),
                       "print the version and exit");
  app.get_formatter()->column_width(34);
  const CLI::Validator non_negative = AtLeastZero(/*strict=*/false);
  const CLI::Validator positive = AtLeastZero(/*strict=*/true);
  std::vector<Spellings> spellings;

  AddFlag(app, "listen", &f->listen,
          "host:port to serve on; port 0 picks a free port (printed on stdout)", {}, err,
          spellings);
  AddFlag(app, "backend", &f->backend,
          "data-plane backend when Join does not name one: auto (nccl when this worker sees a "
          "GPU, else gloo), gloo, nccl",
          {CLI::IsMember({"auto", "gloo", "nccl"})}, err, spellings);
  AddFlag(app, "gpu-data-plane", &f->gpu_data_plane,
          "GPU data plane when Join does not name one (backend nccl): auto (one-sided where every "
          "rank is on this host with GPUs that reach each other, else nccl), one-sided (CUDA "
          "IPC peer windows; ranks may share a GPU), nccl (grouped send/recv)",
          {CLI::IsMember({"auto", "one-sided", "nccl"})}, err, spellings);
  AddFlag(app, "device", &f->device,
          "CUDA device ordinal the NCCL backend runs on (one worker per GPU: 0, 1, ...); "
          "ignored by gloo",
          {non_negative}, err, spellings);
  AddFlag(app, "onesided-sm-budget", &f->onesided_sm_budget,
          "blocks (one per multiprocessor at most) of each one-sided plane kernel, as DeepEP's "
          "num_sms; the other multiprocessors run the experts. Workers sharing one GPU need "
          "workers x budget <= its multiprocessors",
          {positive}, err, spellings);
  AddFlag(app, "onesided-receive-buffers", &f->onesided_receive_buffers,
          "one-sided plane: also hold an engine's dispatch receive buffers in every window "
          "(E x N x (2H + 8K) bytes more), so that moe_ep_receive_buffers can hand them out and "
          "peers store their rows into them directly at R <= 512 (no copy after the flag "
          "round). Give it to every worker of the group or to none",
          {}, err, spellings);
  AddFlag(app, "memory-cap-bytes", &f->memory_cap_bytes,
          "bytes of workspace + expert weights + Rendezvous store this worker may hold; 0 = 3/4 "
          "of the machine's memory or its cgroup's limit (the larger GPU memory for nccl)",
          {non_negative}, err, spellings);
  AddFlag(app, "checkpoint-dir", &f->checkpoint_dirs,
          "directory LoadExperts may read safetensors checkpoints from (repeatable); a path "
          "outside every one is PERMISSION_DENIED; none = no checkpoints",
          {}, err, spellings);
  // Bounds on request sizes (server/request_limits.h; issue 13).
  RequestLimits& l = f->limits;
  AddFlag(app, "max-world-size", &l.max_world_size, "largest Join.world_size", {positive}, err,
          spellings);
  AddFlag(app, "max-generation", &l.max_generation,
          "largest Join.generation (clients form each group above the highest one seen)",
          {positive}, err, spellings);
  AddFlag(app, "max-top-k", &l.max_top_k, "largest top_k of any request", {positive}, err,
          spellings);
  AddFlag(app, "max-experts", &l.max_experts, "largest num_experts of any request", {positive}, err,
          spellings);
  AddFlag(app, "max-hidden", &l.max_hidden,
          "largest hidden or intermediate size of any request, elements", {positive}, err,
          spellings);
  AddFlag(app, "max-tokens", &l.max_tokens,
          "largest token count per rank of any request (capacity, tokens_per_rank, rows)",
          {positive}, err, spellings);
  AddFlag(app, "max-layers", &l.max_layers, "largest layer count or layer index of any request",
          {positive}, err, spellings);
  AddFlag(app, "max-iterations", &l.max_iterations, "largest Benchmark iterations and warmup",
          {positive}, err, spellings);
  AddFlag(app, "max-benchmark-draws", &l.max_benchmark_draws,
          "largest Benchmark tokens_per_rank * top_k * num_experts (routing sampler work)",
          {positive}, err, spellings);
  AddFlag(app, "max-file-bytes", &l.max_file_bytes, "largest checkpoint file LoadExperts opens",
          {positive}, err, spellings);
  // Rendezvous store limits (server/store_limits.h).
  AddFlag(app, "store-max-key-bytes", &f->store.max_key_bytes, "largest Rendezvous key, bytes",
          {positive}, err, spellings);
  AddFlag(app, "store-max-value-bytes", &f->store.max_value_bytes,
          "largest Rendezvous value, bytes", {positive}, err, spellings);
  AddFlag(app, "store-max-keys", &f->store.max_keys, "most keys the Rendezvous store holds",
          {positive}, err, spellings);
  AddFlag(app, "store-max-bytes", &f->store.max_total_bytes,
          "most bytes (keys + values) the Rendezvous store holds; at most 1/16 of the memory "
          "cap, carved out of it",
          {positive}, err, spellings);
  AddFlag(app, "store-max-wait-keys", &f->store.max_wait_keys,
          "most keys one Rendezvous Wait names", {positive}, err, spellings);
  AddFlag(app, "data-plane-host", &f->data_plane_host,
          "address the Gloo TCP data plane binds to when Join does not name one; default: the "
          "IPv4 address of the interface GLOO_SOCKET_IFNAME names, else 127.0.0.1",
          {}, err, spellings);
  AddFlag(app, "log-level", &f->log_level,
          "spdlog level: trace, debug, info, warn, error, critical, off",
          {CLI::IsMember({"trace", "debug", "info", "warn", "error", "critical", "off"})}, err,
          spellings);
  AddFlag(app, "log-format", &f->log_format,
          "text, or json (one JSON object per line with rank, generation and epoch)",
          {CLI::IsMember({"text", "json"})}, err, spellings);
  AddFlag(app, "port-file", &f->port_file, "optional file to write the bound port to", {}, err,
          spellings);
  AddFlag(app, "drain-timeout-ms", &f->drain_timeout_ms,
          "on SIGTERM/SIGINT: health goes NOT_SERVING, new calls are refused, and in-flight "
          "calls may run this long before they are cancelled (an idle worker exits at once)",
          {non_negative}, err, spellings);
  // Control-plane security and limits (proto/rpc/tls_credentials.h, proto/rpc/auth.h).
  AddFlag(app, "tls-cert", &f->tls_cert, "PEM certificate chain of this worker; TLS when set", {},
          err, spellings);
  AddFlag(app, "tls-key", &f->tls_key, "PEM private key of --tls-cert", {}, err, spellings);
  AddFlag(app, "tls-client-ca", &f->tls_client_ca,
          "PEM CA bundle: when set, clients must present a certificate it signed (mutual TLS)", {},
          err, spellings);
  AddFlag(app, "tls-peer-ca", &f->tls_peer_ca,
          "PEM CA bundle that signed the other workers' certificates (rendezvous calls to rank "
          "0); default --tls-client-ca, else the system roots",
          {}, err, spellings);
  AddFlag(app, "tls-refresh-s", &f->tls_refresh_s,
          "seconds between re-reads of the TLS files (hot reload)", {positive}, err, spellings);
  AddFlag(app, "allow-insecure", &f->allow_insecure,
          "serve plaintext on a non-loopback --listen address (plaintext on loopback is always "
          "allowed)",
          {}, err, spellings);
  AddFlag(app, "auth-token-file", &f->auth_token_file,
          "file holding a bearer token every call must send as \"authorization: Bearer "
          "<token>\" (needs TLS; re-read when it changes)",
          {}, err, spellings);
  AddFlag(app, "max-message-bytes", &f->max_message_bytes,
          "largest request this worker accepts, bytes (Forward carries [T, H] tensors)", {positive},
          err, spellings);
  // Observability (server/metrics.h, core/logging.h).
  AddFlag(app, "metrics-listen", &f->metrics_listen,
          "host:port of the Prometheus /metrics endpoint (plain HTTP); empty = off; port 0 "
          "picks a free port (logged, and written to --metrics-port-file)",
          {}, err, spellings);
  AddFlag(app, "metrics-port-file", &f->metrics_port_file,
          "optional file to write the metrics port to", {}, err, spellings);
  AddFlag(app, "health-listen", &f->health_listen,
          "host:port of a plaintext port serving only grpc.health.v1, for probes that cannot "
          "do TLS or send a token (Kubernetes gRPC probes); empty = off",
          {}, err, spellings);
  AddFlag(app, "health-port-file", &f->health_port_file,
          "optional file to write the bound --health-listen port to", {}, err, spellings);
  AddFlag(app, "enable-echo", &f->enable_echo,
          "serve the test-only Echo RPC (returns its request's tensor; for measuring the gRPC "
          "transport of a tensor); off = Echo is UNIMPLEMENTED",
          {}, err, spellings);

  try {
    app.parse(argc, argv);
  } catch (const CLI::Success& e) {  // --help, --version
    return app.exit(e, out, err);
  } catch (const CLI::ParseError& e) {
    app.exit(e, out, err);
    return core::kExitBadCommandLine;
  }
  for (const Spellings& s : spellings) {
    if (s.old != nullptr && s.kebab->count() > 0 && s.old->count() > 0) {
      err << "--" << s.name << " and --" << core::UnderscoreSpelling(s.name)
          << " are one flag: give it once\nRun with --help for more information.\n";
      return core::kExitBadCommandLine;
    }
  }
  return std::nullopt;
}

}  // namespace moe_ep::server
