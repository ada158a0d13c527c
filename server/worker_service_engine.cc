// WorkerService::RunOnDataPlane and WaitReadyForSteps (server/worker_service.h):
// the entry of the embedded worker's in-process data calls (server/moe_ep.h,
// DESIGN §14) and their readiness contract (issue 30 item 1). Kept apart
// from the RPC handlers: they share only the collective slot, the group
// checks and the arrival rounds with them.
//
// Readiness: an engine's first step must not race the orchestrator's set-up
// of any rank (a peer still in LoadExperts holds its slot, so a step's
// collective would wait on it, up to the group's timeout). Each rank waits
// until its own state is complete, then every rank enters one arrival round
// on the group's store named by the fingerprint of what must agree
// (generation, workspace, mask round, the layers and what LoadExperts put
// there): the round completes for every rank or for none (core/arrival_board.h),
// so all ranks become ready together, and nothing waits on a data-plane
// collective meanwhile (an engine that is not ready yet breaks nothing).

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/fingerprint.h"
#include "core/status_macros.h"
#include "server/call_arrival.h"
#include "server/grpc_store.h"
#include "server/worker_service.h"

namespace moe_ep::server {
namespace {

constexpr const char* kWaitCall = "moe_ep_worker_wait_ready_for_steps";
// How often a rank that is not ready yet looks at its state again.
constexpr absl::Duration kReadyPoll = absl::Milliseconds(10);
// How long one arrival attempt waits for the peers before this rank looks
// at its own state again (a LoadExperts may have changed it).
constexpr absl::Duration kReadySlice = absl::Milliseconds(500);

}  // namespace

absl::Status WorkerService::RunOnDataPlane(
    const char* call, absl::Time deadline, bool needs_steps,
    absl::FunctionRef<absl::Status(DataPlane&, const core::EpDispatcherOptions&)> fn) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(slot.AcquireUntil(deadline, nullptr, call));
  RETURN_IF_ERROR(RequireGroup(WorkerPhase::kAllocated, call));
  // Every rank's engine sees the same agreed mask, so every rank fails here
  // alike: no route to a lost rank, no wait on it.
  RETURN_IF_ERROR(session_.RequireNoMask(call));
  if (needs_steps) RETURN_IF_ERROR(RequireReadyForSteps(call));
  // `deadline` bounded the wait for the slot only (server/moe_ep.h): the
  // call's collectives are bounded by the group's timeout, so a peer later
  // than the caller's timeout is waited for rather than breaking the group.
  session_.plane()->SetCall(CallBound{absl::InfiniteFuture(), nullptr});
  return session_.GroupResult(call, fn(*session_.plane(), allocation_->options));
}

absl::Status WorkerService::RequireReadyForSteps(const char* call) const {
  const int64_t generation = session_.args().generation;
  std::string why;
  if (!step_ready_.ready || step_ready_.generation != generation) {
    why = step_ready_.ready
              ? absl::StrCat("the group re-formed (generation ", generation,
                             ") since the last wait (generation ", step_ready_.generation, ")")
              : absl::StrCat(
                    "no wait for readiness has completed in the group of "
                    "generation ",
                    generation);
  } else if (allocation_ == nullptr || step_ready_.allocation != allocation_->fingerprint) {
    why = "the workspace was re-allocated since the last wait";
  } else if (step_ready_.mask_round != session_.plane()->mask().round) {
    why = "a rank mask was agreed since the last wait";
  } else {
    return absl::OkStatus();
  }
  return absl::FailedPreconditionError(absl::StrCat(
      call, ": rank ", session_.args().rank, " is not ready for steps: ", why,
      "; call moe_ep_worker_wait_ready_for_steps (Python: Worker.wait_ready) on every rank "
      "first"));
}

absl::Status WorkerService::LocalStepReadiness(bool worker_experts, std::string* fingerprint) {
  {
    absl::MutexLock lock(&state_mu_);
    if (shutting_down_) {
      return absl::UnavailableError(absl::StrCat(kWaitCall, ": worker is shutting down"));
    }
    RETURN_IF_ERROR(state_.Require(WorkerPhase::kAllocated, kWaitCall));
    if (state_.broken()) {
      return absl::FailedPreconditionError(
          absl::StrCat("the group of generation ", session_.args().generation, " is broken (",
                       state_.broken_reason(), "); the orchestrator must re-form it"));
    }
  }
  RETURN_IF_ERROR(session_.RequireNoMask(kWaitCall));
  RETURN_IF_ERROR(RequireReadmitted(kWaitCall));
  std::string text = absl::StrCat("generation=", session_.args().generation,
                                  ";workspace=", core::Hex64(allocation_->fingerprint),
                                  ";mask=", session_.plane()->mask().round,
                                  ";experts=", worker_experts ? "worker" : "own");
  if (worker_experts) {
    std::vector<int> missing;
    for (const core::LayerPlan& layer : plan_) {
      if (!layer.sparse) continue;
      auto spec = expert_specs_.find(layer.layer);
      if (!session_.plane()->HasExperts(layer.layer) || spec == expert_specs_.end()) {
        missing.push_back(layer.layer);
        continue;
      }
      absl::StrAppend(&text, ";", layer.layer, ":", spec->second);
    }
    if (!missing.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "sparse layers [", absl::StrJoin(missing, ","), "] of the plan have no ",
          "experts loaded on rank ", session_.args().rank, " (LoadExperts still to come or ",
          "running; an engine that runs its own experts waits with "
          "MOE_EP_STEPS_OWN_EXPERTS)"));
    }
  }
  *fingerprint = std::move(text);
  return absl::OkStatus();
}

absl::Status WorkerService::WaitReadyForSteps(bool worker_experts, absl::Time deadline) {
  const absl::Time start = absl::Now();
  std::string why = "not checked yet";
  int rank = -1;  // session_.args().rank as last seen under the slot
  while (true) {
    std::string fingerprint;
    CallArrival arrival;
    std::string host_address;
    std::string secret;
    absl::Duration store_timeout;
    int64_t generation = 0;
    int64_t round_number = 0;
    {
      SlotLease slot(&slot_);
      const absl::Status took =
          slot.AcquireUntil(std::min(deadline, absl::Now() + kReadyPoll), nullptr, kWaitCall);
      if (took.ok()) {
        absl::Status local = LocalStepReadiness(worker_experts, &fingerprint);
        if (absl::IsUnavailable(local)) return local;
        if (!local.ok()) why = std::string(local.message());
      } else if (absl::Now() < deadline || why == "not checked yet") {
        // (At the deadline the reason of the last look stands.)
        why =
            "a control-plane call holds the worker (a set-up call such as LoadExperts is "
            "still running)";
      }
      if (took.ok()) rank = session_.args().rank;
      if (!fingerprint.empty()) {
        generation = session_.args().generation;
        round_number = step_ready_.generation == generation ? step_ready_.rounds : 0;
        if (session_.args().world_size == 1) {
          step_ready_ = StepReadiness{true, generation, allocation_->fingerprint,
                                      session_.plane()->mask().round, round_number + 1};
          return absl::OkStatus();
        }
        arrival.rpc = kWaitCall;
        arrival.round =
            absl::StrCat("gen", generation, "/engine-ready/", session_.plane()->mask().round, "/",
                         round_number, "/", core::Hex64(core::Fingerprint64(fingerprint)));
        arrival.rank = session_.args().rank;
        for (int r = 0; r < session_.args().world_size; ++r) arrival.members.push_back(r);
        arrival.addresses = session_.args().rendezvous_addresses;
        arrival.host_rank = 0;
        host_address = session_.args().rendezvous_address;
        secret = session_.args().rendezvous_secret;
        store_timeout = session_.args().timeout;
        absl::MutexLock lock(&state_mu_);
        arrival.self_address = status_.listen_address();
      }
    }
    if (!fingerprint.empty()) {
      arrival.deadline = std::min(deadline, absl::Now() + kReadySlice);
      GrpcStore host(host_address, store_timeout, secret);
      const absl::Status arrived = ArriveForCall(host, arrival);
      if (arrived.ok()) {
        // The round completed for every rank: this one counts it whatever
        // happens next, so the ranks' round numbers stay equal.
        SlotLease slot(&slot_);
        RETURN_IF_ERROR(slot.AcquireUntil(
            deadline == absl::InfiniteFuture() ? deadline : deadline + store_timeout, nullptr,
            kWaitCall));
        std::string now_fingerprint;
        const absl::Status local = LocalStepReadiness(worker_experts, &now_fingerprint);
        if (session_.args().generation == generation) {
          step_ready_.generation = generation;
          step_ready_.rounds = round_number + 1;
          step_ready_.ready = false;
        }
        if (local.ok() && now_fingerprint == fingerprint) {
          step_ready_.ready = true;
          step_ready_.allocation = allocation_->fingerprint;
          step_ready_.mask_round = session_.plane()->mask().round;
          return absl::OkStatus();
        }
        why =
            "this rank's state changed while the ranks agreed (a new Join, allocation or "
            "load)";
      } else {
        why = std::string(arrived.message());
      }
    }
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          kWaitCall, ": rank ", rank, " not ready for steps after ",
          absl::FormatDuration(absl::Trunc(absl::Now() - start, absl::Milliseconds(1))), ": ",
          why));
    }
    if (fingerprint.empty()) absl::SleepFor(kReadyPoll);
  }
}

}  // namespace moe_ep::server
