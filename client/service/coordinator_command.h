#pragma once

// `moe-ep coordinator`: the long-running coordinator service (DESIGN §16,
// issue 12 item 5). Holds a desired state (--state FILE, the proto3 JSON of
// moe_ep.v1.DesiredState; or --targets with --model/--layers/...; or none
// until a client calls Apply) and keeps the worker group matching it
// (client/group_keeper.h). Serves on --listen:
//   moe_ep.v1.Coordinator   GetGroup, Apply, Drain
//   grpc.health.v1          "" SERVING while the process serves;
//                           "moe_ep.v1.Coordinator" SERVING only while the
//                           group is formed and matches the desired state
// and optionally grpc.health.v1 alone in plaintext on --health-listen (for
// kubelet probes) and Prometheus /metrics on --metrics-listen
// (client/service/coordinator_metrics.h).
//
// Transport security, with the worker's flags and rules
// (proto/rpc/tls_credentials.h, proto/rpc/auth.h): --tls-cert/--tls-key serve TLS
// and are also the client certificate presented to the workers;
// --tls-client-ca requires clients of the coordinator to present a
// certificate it signed (mutual TLS); the workers' certificates are checked
// against --tls-peer-ca (default: --tls-client-ca); --auth-token-file is
// required from clients and sent to the workers; plaintext only on loopback
// unless --allow-insecure.
//
// Prints "moe-ep coordinator listening on HOST:PORT" once serving. With
// --check it only validates the desired state (deploy/validate runs it on the
// manifests' ConfigMaps) and prints "desired state OK: ..." with its targets.
//
// Logs (issue 31 item 5) go to stderr through spdlog, with a timestamp and a
// level, as text or JSON Lines (--log-format; core/logging.h): every group
// event (GroupEvent: "formed", "adopted", "drained", ... at info; "rank_lost",
// "group_broken", "attempt_failed", "resolve_failed", "readd_failed", "lease"
// at warn), every failed call of moe_ep.v1.Coordinator at warn and every
// Apply and Drain at info (proto/rpc/rpc_log.h), and at debug each step of a
// formation, each rank a Drain left and every other call served.
// SIGTERM / SIGINT (or `stop`): NOT_SERVING, the servers stop, the lease on
// the workers is given back (client/group_keeper.h), exit 0.

#include <functional>
#include <memory>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/target_resolver.h"

namespace CLI {
class App;
}

namespace moe_ep::client {

struct CoordinatorCommandOptions {
  std::string state_file;  // --state: desired state JSON
  // Or the desired state from flags (--targets and the rest).
  std::string targets;
  std::string backend = "gloo";
  std::string model;  // empty = the default (client/desired_state.h)
  int layers = 0;
  int64_t capacity_tokens = 0;
  std::string experts = "swiglu";  // swiglu | identity
  uint64_t seed = 1;
  int64_t group_timeout_ms = 0;

  std::string listen = "127.0.0.1:50070";
  std::string tls_cert, tls_key, tls_client_ca, tls_peer_ca;
  int tls_refresh_s = 10;
  bool allow_insecure = false;
  std::string auth_token_file;
  std::string health_listen;
  std::string metrics_listen;

  int probe_interval_ms = 250;
  int probe_timeout_ms = 1000;
  // --probe-failure-threshold (GroupKeeperOptions::probe_failure_threshold).
  int probe_failure_threshold = 3;
  // The log (stderr; core/logging.h without the worker's fields): --log-level
  // trace | debug | info | warn | error | critical | off, --log-format text | json.
  std::string log_level = "info";
  std::string log_format = "text";
  int backoff_initial_ms = 250;
  int backoff_max_ms = 10000;
  int settle_timeout_ms = 5000;
  // --on-rank-loss (GroupKeeperOptions::rank_loss; coordinator.proto
  // RankLossPolicy): mask-covered (default: keep the group masked and re-add
  // the rank while every expert keeps a live replica), mask-always, re-form.
  std::string on_rank_loss = "mask-covered";
  // The lease on the workers (issue 12 item 4): --owner (empty:
  // "coordinator@<hostname>", stable across restarts on one host) and
  // --lease-ttl-ms; "none" holds no lease.
  std::string owner;
  int64_t lease_ttl_ms = 10000;
  // --check: validate the desired state, print its ranks, exit (no serving).
  bool check_only = false;

  // Null: DefaultTargetResolver (tests inject loopback targets here).
  std::shared_ptr<TargetResolver> resolver;
};

// Adds the flags above to `cmd`.
void AddCoordinatorFlags(CLI::App* cmd, CoordinatorCommandOptions* options);

// Serves until `stop()` returns true (checked every 100 ms), then reports
// NOT_SERVING and shuts down, leaving the workers as they are.
// Errors, before serving: kInvalidArgument for --state with --targets, an
// invalid desired state (ValidateDesiredState's message), bad TLS/token
// options (MakeServerCredentials, MakePeerChannelCredentials); kUnavailable
// when --listen, --health-listen or --metrics-listen cannot be bound.
absl::Status RunCoordinatorCommand(const CoordinatorCommandOptions& options, std::ostream& out,
                                   const std::function<bool()>& stop);

}  // namespace moe_ep::client
