#pragma once

// `moe-ep status` and the worker table that `moe-ep up` and `moe-ep watch`
// print.

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/coordinator.h"
#include "client/credentials.h"
#include "moe_ep/v1/worker.pb.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {

// "STARTED", "JOINED", "CONFIGURED", "ALLOCATED" or "UNSPECIFIED".
std::string WorkerStateName(moe_ep::v1::WorkerState state);

// What a failed GetStatus says about a worker, and what to do about it.
struct WorkerErrorView {
  // UNAUTHENTICATED (it answered and refused the call's token),
  // PERMISSION_DENIED, or UNREACHABLE (no answer: refused, closed, timed out).
  std::string state;
  std::string hint;  // an action naming the flag; empty when there is none
};

// The view of `error` from a client that connected with `security`:
//   kUnauthenticated -> UNAUTHENTICATED, hint "pass --auth-token-file" (or,
//     when one was passed, that the worker rejected it);
//   a plaintext client whose connection the worker closed ("Socket closed",
//     "Connection reset") -> hint "if the worker serves TLS, pass --tls-ca";
//   a TLS client whose handshake failed -> hint naming --tls-ca (plaintext
//     worker, wrong CA) and --tls-cert/--tls-key (mutual TLS).
// Source: issue 9 item 8.
WorkerErrorView DescribeWorkerError(const absl::Status& error,
                                    const ClientSecurityOptions& security);

// One row per worker: rank (as reported; "-" when unreachable), address,
// state (DescribeWorkerError's for a failed call, with the error in the last
// column), backend, device, device memory, workspace and expert bytes,
// geometry epoch and R, forwards, the lease ("-", or "<owner> (<t> s left)":
// GetStatus lease_owner / lease_remaining_ms; issue 12), errors. Error cells wrap at 60 columns; an
// error that several workers report (the same text once each worker's own
// address is taken out) is printed once below the table with their ranks
// (rank i = the i-th target), its cells saying "error <n> (below)".
// A worker whose group is broken (GetStatus group_broken) shows its state
// with " BROKEN" appended and a note below the table: "rank <r> (<address>):
// group of generation <g> is broken: <broken_reason>; re-join with a new
// generation" (issue 12 item 3).
// REQUIRES: statuses.size() == targets.size().
std::string RenderWorkerTable(
    const std::vector<std::string>& targets,
    const std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>>& statuses,
    const ClientSecurityOptions& security = {});

// The same as JSON, for scripts and dashboards: an array with one object
// per target in order: {"target", "ok"} and, when ok, "rank", "world_size",
// "state", "backend", "device", "device_memory_bytes", "workspace_bytes",
// "expert_bytes", "geometry_epoch", "runtime_max_tokens_per_rank",
// "group_broken", "broken_reason", "forwards", "errors", "lease_owner" (""
// when none), "lease_remaining_ms"; otherwise "state" (UNAUTHENTICATED / ...),
// "code" (e.g. "UNAVAILABLE"), "error" and "hint" (empty when none). Byte counts are integers.
nlohmann::json WorkerStatusJson(
    const std::vector<std::string>& targets,
    const std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>>& statuses,
    const ClientSecurityOptions& security = {});

struct StatusCommandOptions {
  std::string targets;             // host:port,...
  ClientSecurityOptions security;  // how to reach them
  absl::Duration rpc_timeout = absl::Seconds(10);
  bool json = false;  // WorkerStatusJson ({"workers": [...]}) instead of the table
};

// Queries every target and prints the table (or JSON) to `out`.
// Errors: kInvalidArgument for a bad target list; MakeClientChannelCredentials
// errors; kUnavailable when any worker did not answer (the table is printed
// first).
absl::Status RunStatusCommand(const StatusCommandOptions& options, std::ostream& out);
// Plaintext, default timeouts, the table.
absl::Status RunStatusCommand(const std::string& targets, std::ostream& out);

}  // namespace moe_ep::client
