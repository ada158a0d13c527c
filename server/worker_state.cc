#include "server/worker_state.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "server/call_gate.h"

namespace moe_ep::server {

absl::string_view WorkerPhaseName(WorkerPhase phase) {
  switch (phase) {
    case WorkerPhase::kStarted:
      return "STARTED";
    case WorkerPhase::kJoined:
      return "JOINED";
    case WorkerPhase::kConfigured:
      return "CONFIGURED";
    case WorkerPhase::kAllocated:
      return "ALLOCATED";
  }
  return "UNKNOWN";
}

v1::WorkerState ToProto(WorkerPhase phase) {
  switch (phase) {
    case WorkerPhase::kStarted:
      return v1::WORKER_STATE_STARTED;
    case WorkerPhase::kJoined:
      return v1::WORKER_STATE_JOINED;
    case WorkerPhase::kConfigured:
      return v1::WORKER_STATE_CONFIGURED;
    case WorkerPhase::kAllocated:
      return v1::WORKER_STATE_ALLOCATED;
  }
  return v1::WORKER_STATE_UNSPECIFIED;
}

absl::Status WorkerStateMachine::Require(WorkerPhase required, absl::string_view rpc) const {
  if (phase_ >= required) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(rpc, " requires state ", WorkerPhaseName(required), " or later; worker is ",
                   WorkerPhaseName(phase_)));
}

absl::Status WorkerStateMachine::RequireGroup(WorkerPhase required, absl::string_view rpc,
                                              int64_t generation) const {
  if (absl::Status status = Require(required, rpc); !status.ok()) return status;
  if (broken()) {
    return absl::FailedPreconditionError(absl::StrCat(rpc, ": the group of generation ", generation,
                                                      " is broken (", broken_reason_,
                                                      "); re-join with a new generation"));
  }
  return absl::OkStatus();
}

void WorkerStateMachine::Joined() {
  phase_ = WorkerPhase::kJoined;
  broken_reason_.clear();
}

void WorkerStateMachine::Configured() { phase_ = std::max(phase_, WorkerPhase::kConfigured); }

void WorkerStateMachine::Allocated() { phase_ = WorkerPhase::kAllocated; }

void WorkerStateMachine::Left() {
  phase_ = WorkerPhase::kStarted;
  broken_reason_.clear();
}

void WorkerStateMachine::MarkBroken(std::string reason) {
  broken_reason_ = reason.empty() ? std::string("collective failed") : std::move(reason);
}

bool IsGroupError(const absl::Status& status) {
  if (IsAgreedStop(status)) return false;
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDataLoss:
      return true;
    case absl::StatusCode::kFailedPrecondition:
      return absl::StrContains(status.message(), "group broken");
    default:
      return false;
  }
}

}  // namespace moe_ep::server
