// WorkerService::Join and Leave (worker.proto; DESIGN §8, §16; issues 12, 13
// and 29): a Join votes through its generation's rendezvous store before the
// group forms (core/join_vote.h), a failed formation leaves the old group
// in force, and only then is the group session replaced
// (server/group_session.h). Kept apart from the step RPCs: they share the
// slot and the reported state, not the formation.

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/agreement.h"
#include "core/join_vote.h"
#include "core/status_macros.h"
#include "server/collective_slot.h"
#include "server/device_info.h"
#include "server/group_formation.h"
#include "server/grpc_store.h"
#include "server/request_limits.h"
#include "server/store_limits.h"
#include "server/worker_service.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {

// --------------------------------------------------------------------- Join

grpc::Status WorkerService::Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                                 v1::JoinResponse* response) {
  return Finish(RunGuarded("Join", [&] { return DoJoin(context, *request, response); }));
}

bool WorkerService::CanVoteOnJoin(const v1::JoinRequest& request) const {
  return !request.rejoin() && request.world_size() > 1 &&
         request.world_size() <= options_.limits.max_world_size && request.rank() >= 0 &&
         request.rank() < request.world_size() && !request.rendezvous_address().empty() &&
         IsSendableSecret(request.rendezvous_secret()) &&
         request.generation() > max_generation_used_ &&
         request.generation() <=
             GenerationLimit(max_generation_used_, options_.limits.max_generation);
}

absl::Status WorkerService::DoJoin(grpc::ServerContext* context, const v1::JoinRequest& request,
                                   v1::JoinResponse* response) {
  const JoinDefaults defaults{options_.default_backend, options_.default_timeout,
                              options_.data_plane_host, options_.device,
                              VisibleGpuCount(),        options_.default_gpu_data_plane};
  const absl::StatusOr<JoinArgs> args = JoinArgsFromRequest(options_.limits, request, defaults);
  absl::Status local = args.status();
  if (local.ok()) local = ValidateLeaseClaim(request.lease(), "lease.");
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(slot.Acquire(context, "Join"));
  bool same_group = false;
  bool votes = false;
  bool lease_refused = false;
  {
    absl::MutexLock lock(&state_mu_);
    if (shutting_down_) return absl::UnavailableError("Join: worker is shutting down");
    if (local.ok()) {
      const JoinedGroup current{state_.phase() != WorkerPhase::kStarted, state_.broken(),
                                state_.broken_reason(), &session_.args()};
      local = CheckJoin(current, max_generation_used_, options_.limits.max_generation, *args,
                        &same_group);
    }
    // A new generation replaces the group: the owner's call (the idempotent
    // re-join of the group in force changes nothing and is not refused).
    if (local.ok() && !same_group) {
      local = lease_.Check("Join", request.lease());
      // Another owner's Join is answered at once and changes nothing (issue
      // 29 item 1): no ballot, no refusal posted (its peers are that
      // owner's), and its generation is not recorded.
      lease_refused = !local.ok();
    }
    // Even a bad Join votes when its ballot has a place (a rank of a group
    // of several, a fresh generation): its peers then fail at once. Its
    // generation counts as used from here (the ballot is a rendezvous key).
    votes = !same_group && !lease_refused && CanVoteOnJoin(request);
    if (votes || (local.ok() && !same_group)) max_generation_used_ = request.generation();
    status_.set_max_generation_seen(max_generation_used_);
  }
  if (local.ok() && same_group) {
    lease_.Apply(request.lease());
    response->set_backend(session_.args().backend);
    response->set_data_plane(session_.formed() ? session_.plane()->data_plane() : "");
    return absl::OkStatus();  // idempotent
  }
  if (votes) {
    // Join's cross-rank vote goes through the generation's store (there is
    // no group yet): core/join_vote.h.
    // With every rank's address, every rank's store may host a rank mask
    // round of this generation (server/rank_mask.h).
    if ((request.rank() == 0 || request.rendezvous_addresses_size() > 0) &&
        options_.rendezvous != nullptr) {
      options_.rendezvous->OpenGeneration(request.generation(), request.rendezvous_secret());
    }
    const absl::Duration timeout = args.ok() ? args->timeout : options_.default_timeout;
    GrpcStore store(request.rendezvous_address(),
                    std::clamp(CallDeadline(context) - absl::Now(), absl::Milliseconds(1), timeout),
                    request.rendezvous_secret());
    core::Ballot ballot;
    ballot.rpc = "Join";
    ballot.generation = request.generation();
    ballot.local = local;
    if (local.ok()) {
      ballot.fields = {{"world_size", args->world_size},
                       {"backend (1 = gloo, 2 = nccl)", args->backend == "nccl" ? 2 : 1},
                       {"gpu_data_plane (0 = none, 1 = auto, 2 = one-sided, 3 = nccl)",
                        args->gpu_data_plane == "auto"        ? 1
                        : args->gpu_data_plane == "one-sided" ? 2
                        : args->gpu_data_plane == "nccl"      ? 3
                                                              : 0}};
    }
    RETURN_IF_ERROR(core::RunJoinVote(
        store, ballot, request.rank(), request.world_size(),
        std::clamp(CallDeadline(context) - absl::Now(), absl::Milliseconds(1), timeout)));
  }
  // A rejoining rank has no peers waiting on its Join.
  if (!local.ok() && !same_group && !votes && !lease_refused && !request.rejoin()) {
    RefuseJoin(context, request, local);
  }
  RETURN_IF_ERROR(local);
  // A new generation: form the new group, and only then drop the old one (a
  // failed formation leaves the old group in force: issue 13 item 5).
  if ((args->rank == 0 || !args->rendezvous_addresses.empty()) && options_.rendezvous != nullptr &&
      !votes) {
    options_.rendezvous->OpenGeneration(args->generation, args->rendezvous_secret);
  }
  ASSIGN_OR_RETURN(std::unique_ptr<DataPlane> formed,
                   FormJoinedGroup(*args, options_.device, options_.onesided_sm_budget,
                                   options_.onesided_receive_buffers, CallDeadline(context)));
  InstallGroup(*args, std::move(formed));
  if (args->rejoin)
    session_.AdoptMask("Join", /*renumber=*/true);  // GetStatus shows it alone until Rejoin
  lease_.Apply(request.lease());
  response->set_backend(args->backend);
  response->set_data_plane(session_.plane()->data_plane());
  spdlog::debug("Join: formed generation {} as rank {} of {} ({} backend, {} data plane{})",
                args->generation, args->rank, args->world_size, args->backend,
                session_.plane()->data_plane(), args->rejoin ? ", rejoining alone" : "");
  return absl::OkStatus();
}

void WorkerService::RefuseJoin(const grpc::ServerContext* context, const v1::JoinRequest& request,
                               const absl::Status& local) {
  if (request.world_size() <= 1 || request.rendezvous_address().empty() ||
      request.generation() < 1 || !IsSendableSecret(request.rendezvous_secret())) {
    return;  // no store to reach: the peers wait their timeout (join_vote.h)
  }
  // Posted from a detached thread, so a store that is slow or gone (a
  // hostile address) delays neither this call's answer nor the slot; at
  // most kMaxRefusalsInFlight at once, each bounded by the call's deadline
  // and kMaxRefusalWait. Process-wide: the thread outlives no state of this
  // service.
  static std::atomic<int> in_flight{0};
  constexpr int kMaxRefusalsInFlight = 4;
  constexpr absl::Duration kMaxRefusalWait = absl::Seconds(30);
  if (in_flight.fetch_add(1) >= kMaxRefusalsInFlight) {
    in_flight.fetch_sub(1);
    spdlog::warn("Join: refusal not posted ({} already in flight)", kMaxRefusalsInFlight);
    return;
  }
  std::string self;
  {
    absl::MutexLock lock(&state_mu_);
    self = status_.listen_address();
  }
  const absl::Duration timeout =
      request.timeout_ms() > 0
          ? absl::Milliseconds(std::min(request.timeout_ms(), options_.limits.max_timeout_ms))
          : options_.default_timeout;
  const absl::Duration wait = std::clamp(CallDeadline(context) - absl::Now(), absl::Milliseconds(1),
                                         std::min(timeout, kMaxRefusalWait));
  std::thread([address = request.rendezvous_address(), secret = request.rendezvous_secret(),
               generation = request.generation(), rank = request.rank(),
               world = request.world_size(), local, self, wait] {
    GrpcStore store(address, wait, secret);
    const absl::Status posted = core::PostJoinRefusal(store, generation, local, self, rank, world);
    if (!posted.ok()) spdlog::warn("Join: refusal not posted: {}", posted.ToString());
    in_flight.fetch_sub(1);
  }).detach();
}

void WorkerService::InstallGroup(const JoinArgs& args, std::unique_ptr<DataPlane> formed) {
  TearDownGroup();
  session_.Install(args, std::move(formed));
  if ((args.rank == 0 || !args.rendezvous_addresses.empty()) && options_.rendezvous != nullptr) {
    options_.rendezvous->DropGenerationsBelow(args.generation);
  }
  {
    absl::MutexLock lock(&state_mu_);
    state_.Joined();
    status_.mutable_counters()->set_consecutive_failed_collectives(0);
    status_.set_rank(args.rank);
    status_.set_world_size(args.world_size);
    status_.set_generation(args.generation);
    status_.set_backend(args.backend);
    status_.set_data_plane(session_.plane()->data_plane());
    SetDeviceLocked(args.backend);
    UpdateHealthLocked();
  }
}

// -------------------------------------------------------------------- Leave

grpc::Status WorkerService::Leave(grpc::ServerContext* context, const v1::LeaveRequest* request,
                                  v1::LeaveResponse* /*response*/) {
  return Finish(RunGuarded("Leave", [&] {
    return Leased("Leave", request->lease(), [&](const absl::Status& refused) {
      RETURN_IF_ERROR(refused);  // not a collective: nobody waits on it
      return DoLeave(context, *request);
    });
  }));
}

absl::Status WorkerService::DoLeave(grpc::ServerContext* context, const v1::LeaveRequest& request) {
  if (request.generation() < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation: expected >= 0, got ", request.generation()));
  }
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(slot.Acquire(context, "Leave"));
  {
    absl::MutexLock lock(&state_mu_);
    if (state_.phase() == WorkerPhase::kStarted) return absl::OkStatus();  // idempotent
    if (request.generation() != 0 && request.generation() != session_.args().generation) {
      return absl::FailedPreconditionError(absl::StrCat("Leave: generation ", request.generation(),
                                                        " does not match the joined generation ",
                                                        session_.args().generation));
    }
  }
  spdlog::info("Leave: tearing down generation {}", session_.args().generation);
  TearDownGroup();
  return absl::OkStatus();
}

}  // namespace moe_ep::server
