#pragma once

// The worker's lifecycle state machine (proto/moe_ep/v1/worker.proto):
//
//   STARTED -(Join)-> JOINED -(ConfigureLayers)-> CONFIGURED
//           -(AllocateWorkspace)-> ALLOCATED
//
// Reconfiguration is allowed when idle: ConfigureLayers in CONFIGURED or
// ALLOCATED keeps the later state (the workspace does not depend on the plan);
// AllocateWorkspace in ALLOCATED re-allocates. Join with a new generation
// re-forms the group from any state and lands in JOINED; Leave returns to
// STARTED from any state.
//
// Separately, the group may be *broken*: a collective failed (timeout, dead
// peer). The lifecycle state is kept for GetStatus, but every collective call
// is refused until a Join with a new generation.
//
// Not thread-safe: the worker guards it with its own mutex.
// Source: DESIGN §8; worker.proto's service comment.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::server {

enum class WorkerPhase { kStarted = 0, kJoined = 1, kConfigured = 2, kAllocated = 3 };

// "STARTED", "JOINED", "CONFIGURED", "ALLOCATED".
absl::string_view WorkerPhaseName(WorkerPhase phase);
// The proto enum of `phase`.
v1::WorkerState ToProto(WorkerPhase phase);

// IsGroupError()
//
// Whether `status`, the result of a collective, leaves the group unusable
// (a peer died or hung, the collective timed out or failed inside): the
// codes DEADLINE_EXCEEDED, UNAVAILABLE, UNKNOWN, INTERNAL, CANCELLED,
// DATA_LOSS, and FAILED_PRECONDITION "group broken ..." of a collective
// already broken. A vote's ABORTED or a request's INVALID_ARGUMENT is not,
// nor a stop all ranks agreed on at a call gate (server/call_gate.h
// IsAgreedStop: DEADLINE_EXCEEDED or CANCELLED with the collective in step).
bool IsGroupError(const absl::Status& status);

class WorkerStateMachine {
 public:
  WorkerPhase phase() const { return phase_; }
  bool broken() const { return !broken_reason_.empty(); }
  const std::string& broken_reason() const { return broken_reason_; }

  // OK when phase() >= `required`. Otherwise kFailedPrecondition:
  //   "<rpc> requires state <REQUIRED> or later; worker is <CURRENT>".
  absl::Status Require(WorkerPhase required, absl::string_view rpc) const;

  // Require(), plus: when the group is broken, kFailedPrecondition
  //   "<rpc>: the group of generation <g> is broken (<reason>); re-join with a
  //    new generation". For calls that run a collective.
  absl::Status RequireGroup(WorkerPhase required, absl::string_view rpc, int64_t generation) const;

  // Transitions. Callers check Require() first; these do not fail.
  // Joined(): from any phase to JOINED, clears broken.
  void Joined();
  // Configured(): JOINED -> CONFIGURED; CONFIGURED and ALLOCATED stay.
  void Configured();
  // Allocated(): -> ALLOCATED.
  void Allocated();
  // Left(): any -> STARTED, clears broken.
  void Left();
  // Marks the group broken with `reason` (the collective's error message).
  void MarkBroken(std::string reason);

 private:
  WorkerPhase phase_ = WorkerPhase::kStarted;
  std::string broken_reason_;
};

}  // namespace moe_ep::server
