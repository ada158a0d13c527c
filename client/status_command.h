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
#include "moe_ep/v1/coordinator.pb.h"
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

// What GetStatus says of the worker's group (issue 31 item 1):
//   "none"     not joined (STARTED);
//   "forming"  joined, not allocated yet (JOINED, CONFIGURED);
//   "ready"    ALLOCATED, not broken, no rank masked (health SERVING);
//   "masked"   ALLOCATED and serving with masked_ranks left out (DESIGN §15);
//   "broken"   group_broken (a collective failed: re-join with a new generation).
std::string GroupState(const moe_ep::v1::GetStatusResponse& status);

// The group column: "-" (none), else "gen <G> <state>", with the masked
// ranks for "masked": "gen 3 ready", "gen 3 masked [2]", "gen 3 BROKEN".
std::string GroupCell(const moe_ep::v1::GetStatusResponse& status);

// The memory column: what the worker holds against its own cap
// (workspace_bytes + expert_bytes, the budget --memory-cap-bytes checks), not
// the machine's memory: "12.0 MiB / 18.0 GiB"; "12.0 MiB / uncapped" for a
// cap of 0.
std::string MemoryCell(const moe_ep::v1::GetStatusResponse& status);

// What a GetStatus that answered UNIMPLEMENTED says (issue 31 item 1): the
// address serves no moe_ep.v1.Worker. When `group` is a moe_ep.v1.Coordinator
// GetGroup answer from the same address, it is a coordinator:
//   UNIMPLEMENTED "this is a coordinator (moe_ep.v1.Coordinator: phase READY,
//   generation 3, 4 ranks), not a worker: use `moe-ep coordinator status
//   --target <target>`"
// otherwise UNIMPLEMENTED "... serves no moe_ep.v1.Worker (not a moe-ep worker,
// or one of an older release): <the original message>".
// `group` null: no coordinator answered there.
absl::Status ExplainUnimplemented(const absl::Status& error, const std::string& target,
                                  const moe_ep::v1::GetGroupResponse* group);

// StatusEach() of `coordinator`, each UNIMPLEMENTED answer replaced by
// ExplainUnimplemented's after a GetGroup of moe_ep.v1.Coordinator on the
// same address (with the coordinator's channel options). For `status` and
// `watch`.
std::vector<absl::StatusOr<moe_ep::v1::GetStatusResponse>> StatusEachExplained(
    Coordinator& coordinator);

// One row per worker: rank (as reported; "-" when unreachable), address,
// state (DescribeWorkerError's for a failed call, with the error in the last
// column), group (GroupCell: generation and ready / masked / BROKEN),
// backend, device, memory (MemoryCell: held / the worker's cap), workspace
// and expert bytes, geometry epoch and R, forwards, the lease ("-", or
// "<owner> (<t> s left)": GetStatus lease_owner / lease_remaining_ms; issue
// 12), errors. Error cells wrap at 60 columns; an
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
// per target in order: {"target", "ok"} and, when ok, every field of
// GetStatusResponse under its proto name (client/proto_json.h: generation,
// capacity_tokens, memory_cap_bytes, masked_ranks, counters, ... ; enums by
// value name) with "state" the short name ("ALLOCATED"), plus "group" (GroupState),
// "memory_used_bytes" (workspace + experts), "device" (= device_name),
// "forwards" and "errors" (from counters); otherwise "state"
// (UNAUTHENTICATED / ...), "code" (e.g. "UNAVAILABLE"), "error" and "hint"
// (empty when none). Byte counts are integers.
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
