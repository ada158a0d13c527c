#pragma once

// `moe-ep coordinator status|apply|drain [--json]`: a client of a running
// coordinator's moe_ep.v1.Coordinator service (proto/moe_ep/v1/coordinator.proto;
// the service: client/service/coordinator_command.h), for operators and
// scripts (issue 31 item 1):
//
//   moe-ep coordinator status [--target HOST:PORT] [--events N] [--json]
//       GetGroup: the phase, generation, each rank's state and why it is not
//       READY, the mask, the last events. --json: every GetGroupResponse
//       field (client/proto_json.h).
//   moe-ep coordinator apply --state FILE [--target HOST:PORT] [--json]
//       Apply the desired state in FILE (the proto3 JSON of DesiredState, as
//       `moe-ep coordinator --state`); the group is formed anew in the
//       background when it differs from the state in force.
//   moe-ep coordinator drain [--target HOST:PORT] [--json]
//       Drain: every reachable rank leaves, the coordinator gives its lease
//       back and forms nothing until the next apply.
//
// --target defaults to the coordinator's default --listen (127.0.0.1:50070);
// --tls-ca, --tls-cert, --tls-key and --auth-token-file reach a coordinator
// that serves TLS or wants a token (client/credentials.h).

#include <functional>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "client/credentials.h"
#include "moe_ep/v1/coordinator.pb.h"

namespace CLI {
class App;
}

namespace moe_ep::client {

struct CoordinatorClientOptions {
  std::string target = "127.0.0.1:50070";
  ClientSecurityOptions security;
  absl::Duration rpc_timeout = absl::Seconds(10);
  bool json = false;
  int events = 10;         // status: the newest N events (0 = none)
  std::string state_file;  // apply: the desired state JSON
};

// RenderGroupStatus()
//
// The text of `moe-ep coordinator status` for `group` from `target`: a
// summary line (phase, generation, desired version, ranks), formation
// counts and times, the mask when there is one, the last error, a table of
// the ranks (rank, target, state, worker state and generation, since, why
// not READY) and the newest `events` events with their UTC times.
// `now` is for the "since" column. Pure.
std::string RenderGroupStatus(const std::string& target, const v1::GetGroupResponse& group,
                              int events, absl::Time now);

// Each command prints to `out` and returns the call's error.
// Errors: kInvalidArgument (an empty --target, bad security options,
// apply without --state or with a state file that does not parse:
// ReadDesiredStateFile's); the RPC's code with its message (UNAVAILABLE: no
// coordinator there; INVALID_ARGUMENT: Apply refused the state, naming the
// field); kUnimplemented "... serves no moe_ep.v1.Coordinator" for an
// address that does not (a worker: use `moe-ep status --targets`).
absl::Status RunCoordinatorStatus(const CoordinatorClientOptions& options, std::ostream& out);
absl::Status RunCoordinatorApply(const CoordinatorClientOptions& options, std::ostream& out);
absl::Status RunCoordinatorDrain(const CoordinatorClientOptions& options, std::ostream& out);

// Adds the subcommands status, apply and drain to `coordinator` (the
// `moe-ep coordinator` command), filling `options`; the one given sets
// `*action` (the caller's `coordinator` callback must then not set it: it
// checks coordinator->get_subcommands().empty()).
void AddCoordinatorClientCommands(CLI::App* coordinator, CoordinatorClientOptions* options,
                                  std::function<absl::Status()>* action, std::ostream* out);

}  // namespace moe_ep::client
