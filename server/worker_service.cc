#include "server/worker_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/agreement.h"
#include "core/expert_source.h"
#include "core/geometry.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "server/benchmark_inputs.h"
#include "server/call_arrival.h"
#include "server/collective_slot.h"
#include "server/device_info.h"
#include "server/group_formation.h"
#include "server/grpc_store.h"
#include "server/join_vote.h"
#include "server/logging.h"
#include "server/percentile.h"
#include "server/request_limits.h"
#include "server/shared_expert_request.h"
#include "server/status_conversion.h"
#include "server/tensor_codec.h"
#include "server/worker_replies.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

// How long before the call's deadline an arrival wait gives up (at most).
constexpr absl::Duration kArrivalReplyMargin = absl::Milliseconds(250);

// What a layer's LoadExperts asked for, as one fingerprint: the fields
// every rank must agree on (the layer excluded), compared by Forward's vote.
int64_t ExpertSpecFingerprint(const std::vector<core::BallotField>& fields) {
  std::string text;
  for (const core::BallotField& field : fields) {
    if (field.name == "layer") continue;
    absl::StrAppend(&text, field.name, "=", field.value, ";");
  }
  return static_cast<int64_t>(core::Fingerprint64(text));
}

}  // namespace

WorkerService::WorkerService(WorkerOptions options, HealthReporter* health)
    : options_(std::move(options)), health_(health) {
  // The default backend's device until a Join (and again after Leave).
  absl::MutexLock lock(&state_mu_);
  SetDeviceLocked(options_.default_backend);
  status_.set_memory_cap_bytes(options_.memory_cap_bytes);
  status_.set_state(ToProto(state_.phase()));
  status_.mutable_counters();
  UpdateHealthLocked();
}

WorkerService::~WorkerService() = default;

void WorkerService::SetListenAddress(const std::string& address) {
  absl::MutexLock lock(&state_mu_);
  status_.set_listen_address(address);
}

void WorkerService::BeginShutdown() {
  absl::MutexLock lock(&state_mu_);
  shutting_down_ = true;
}

grpc::Status WorkerService::Finish(const absl::Status& status) {
  if (!status.ok()) {
    absl::MutexLock lock(&state_mu_);
    status_.mutable_counters()->set_errors(status_.counters().errors() + 1);
  }
  return ToGrpcStatus(CapMessage(status));
}

grpc::Status WorkerService::FinishCollective(const absl::Status& status) {
  {
    absl::MutexLock lock(&state_mu_);
    v1::Counters* counters = status_.mutable_counters();
    if (status.ok()) {
      counters->set_consecutive_failed_collectives(0);
    } else if (IsGroupError(status)) {
      counters->set_consecutive_failed_collectives(counters->consecutive_failed_collectives() + 1);
    }
    UpdateHealthLocked();
  }
  return Finish(status);
}

absl::Status WorkerService::Leased(const char* rpc, const v1::LeaseClaim& claim,
                                   absl::FunctionRef<absl::Status(absl::Status)> fn) {
  absl::Status refused = ValidateLeaseClaim(claim, "lease.");
  if (refused.ok()) refused = lease_.Check(rpc, claim);
  absl::Status status = fn(refused);
  if (status.ok()) lease_.Apply(claim);
  return status;
}

absl::Status WorkerService::EnterLeasedGroup(SlotLease& slot, const grpc::ServerContext* context,
                                             const char* rpc, WorkerPhase phase,
                                             const absl::Status& refused) {
  const absl::Status entered = EnterGroup(slot, context, rpc, phase);
  // Not in a group: there is no vote to take part in; the refusal is the
  // more useful answer.
  if (!entered.ok()) return refused.ok() ? entered : refused;
  return absl::OkStatus();
}

absl::Status WorkerService::GroupResult(const char* rpc, absl::Status status) {
  if (status.ok() || !IsGroupError(status)) return status;
  if (data_plane_ != nullptr && data_plane_->CanMask()) {
    // DESIGN §15: not broken; the survivors agree on a rank mask
    // (server/rank_mask.h). This call's step is lost either way; the round
    // finishes here when every survivor is in it, else at the next call (EnterGroup).
    spdlog::warn("{}: collective failed ({}); agreeing on a rank mask", rpc, status.ToString());
    data_plane_->BeginMaskRound(vote_sequence_);
    mask_pending_ = true;
    absl::StatusOr<bool> done = FinishMask(rpc, MaskGrace());
    if (!done.ok()) return done.status();
    return absl::Status(
        status.code(),
        absl::StrCat(status.message(), "; the step did not complete: ",
                     *done ? "the survivors masked the lost rank(s)"
                           : "the survivors are masking the lost rank(s)",
                     " (GetStatus.masked_ranks); send the step again to the live ranks"));
  }
  return MarkGroupBroken(rpc, std::move(status));
}

absl::Status WorkerService::MarkGroupBroken(const char* rpc, absl::Status status) {
  spdlog::warn("collective failed, group of generation {} is broken: {}", joined_.generation,
               status.ToString());
  absl::MutexLock lock(&state_mu_);
  state_.MarkBroken(
      absl::StrCat(rpc, ": ", absl::StatusCodeToString(status.code()), ": ", status.message()));
  UpdateHealthLocked();
  return status;
}

absl::Status WorkerService::RequireGroup(WorkerPhase phase, const char* rpc) {
  absl::MutexLock lock(&state_mu_);
  if (shutting_down_) return absl::UnavailableError(absl::StrCat(rpc, ": worker is shutting down"));
  return state_.RequireGroup(phase, rpc, joined_.generation);
}

absl::Status WorkerService::EnterGroup(SlotLease& slot, const grpc::ServerContext* context,
                                       const char* rpc, WorkerPhase phase) {
  RETURN_IF_ERROR(slot.Acquire(context, rpc));
  if (!RequireGroup(WorkerPhase::kJoined, rpc).ok()) return RequireGroup(phase, rpc);
  call_ = CallBound{CallDeadline(context), nullptr};  // nothing latched from the last call
  if (context != nullptr) call_.cancelled = [context] { return context->IsCancelled(); };
  data_plane_->SetCall(call_);
  // A pending mask round is applied before the call looks at the plane, so
  // its checks (RequireNoMask) and its collective are the survivors'.
  return FinishPendingMask(rpc);
}

absl::Status WorkerService::FinishPendingMask(const char* rpc) {
  if (!mask_pending_) return absl::OkStatus();
  ASSIGN_OR_RETURN(bool done, FinishMask(rpc, kMaskSettled));
  if (!done) {
    ASSIGN_OR_RETURN(done, FinishMask(rpc, 4 * joined_.timeout));
    if (!done) {
      return MarkGroupBroken(
          rpc, absl::DeadlineExceededError(absl::StrCat(
                   "rank mask: no agreement within ", absl::FormatDuration(4 * joined_.timeout))));
    }
  }
  return absl::OkStatus();
}

absl::Status WorkerService::RequirePhase(WorkerPhase phase, const char* rpc) {
  absl::MutexLock lock(&state_mu_);
  return state_.Require(phase, rpc);
}

MemoryBudget WorkerService::Budget() const {
  return MemoryBudget{options_.memory_cap_bytes,
                      data_plane_ != nullptr ? data_plane_->allocated_bytes() : 0, expert_bytes_};
}

void WorkerService::SetDeviceLocked(const std::string& backend) {
  const DeviceInfo device = DescribeBackendDevice(backend, options_.device);
  status_.set_device_name(device.name);
  status_.set_device_memory_bytes(device.memory_bytes);
}

void WorkerService::UpdateHealthLocked() {
  status_.set_state(ToProto(state_.phase()));
  status_.set_group_broken(state_.broken());
  status_.set_broken_reason(state_.broken_reason());
  const bool joined = state_.phase() != WorkerPhase::kStarted;
  SetLogContext(joined ? status_.rank() : -1, status_.generation(), status_.geometry_epoch());
  if (health_ != nullptr) {
    health_->SetReady(
        state_.phase() == WorkerPhase::kAllocated && !state_.broken() && !shutting_down_ &&
        status_.counters().consecutive_failed_collectives() < kFailedCollectivesNotReady);
  }
}

absl::Duration WorkerService::MaskGrace() const {
  return std::min(joined_.timeout / 2, absl::Seconds(1));
}

absl::Status WorkerService::Vote(const char* rpc, absl::Status local,
                                 std::vector<core::BallotField> fields) {
  // Rank masks (DESIGN §15): every survivor must vote first on the new
  // group in the same call, however the round's end fell among its calls.
  // Calls are counted alike on every rank (vote_sequence_), but survivors
  // can see a loss one call apart: a collective that completed on one rank
  // failed on a peer, and the first learns of the loss only in its next
  // call's vote. Each survivor enters the round with its count, the round
  // agrees on the largest (MaskAgreement::votes), and every call numbered
  // below it is one a later survivor spent on the old group: it returns
  // without a vote, so the first vote on the new group is the call
  // numbered first_mask_vote_ everywhere. (A round pending from an
  // earlier call was applied when this call entered the group.)
  if (vote_sequence_ < first_mask_vote_) {
    ++vote_sequence_;
    return MaskAgreedError(rpc);
  }
  // Local refusals first (issue 29): a rank that rejected its own request
  // answers at once and counts nothing; every live rank must have entered
  // this call before anything moves on the data plane.
  absl::Status status = ArriveForVote(rpc, local);
  if (!local.ok()) return local;
  if (!status.ok() && !IsGroupError(status)) return status;  // nothing moved, nothing counted
  if (status.ok()) {
    core::Ballot ballot;
    ballot.rpc = rpc;
    ballot.generation = joined_.generation;
    ballot.sequence = vote_sequence_++;
    ballot.local = std::move(local);
    ballot.fields = std::move(fields);
    status = core::RunVote(data_plane_->collective(), ballot);
  } else {
    ++vote_sequence_;  // a rank was lost: counted as the failed vote it replaces
  }
  if (IsGroupError(status) && data_plane_->CanMask()) {
    // A rank was lost before this call's payload moved.
    spdlog::warn("{}: vote failed ({}); agreeing on a rank mask", rpc, status.ToString());
    data_plane_->BeginMaskRound(vote_sequence_);
    mask_pending_ = true;
    ASSIGN_OR_RETURN(bool done, FinishMask(rpc, MaskGrace()));
    if (done) return MaskAgreedError(rpc);
    return absl::Status(status.code(),
                        absl::StrCat(status.message(),
                                     "; the survivors are masking the lost rank(s) "
                                     "(GetStatus.masked_ranks); send the call again"));
  }
  return GroupResult(rpc, status);
}

absl::Status WorkerService::ArriveForVote(const char* rpc, const absl::Status& local) {
  const RankMaskState mask = data_plane_->mask();
  CallArrival call;
  call.rpc = rpc;
  call.rank = joined_.rank;
  // The group this call votes in: every rank, or the survivors under a
  // mask (original numbering); a returning rank alone votes by itself.
  const core::ControlCollective& group = data_plane_->collective();
  if (group.size() != joined_.world_size) return local;
  for (int r = 0; r < group.size(); ++r) {
    if (group.IsLive(r)) call.members.push_back(r);
  }
  if (call.members.size() <= 1) return local;
  call.round = ArrivalRoundName(joined_.generation, mask.round, vote_sequence_);
  call.generation = joined_.generation;
  call.addresses = joined_.rendezvous_addresses;
  call.host_rank = mask.round > 0 ? mask.host : 0;
  // The wait ends a little before the call's deadline, so that its answer
  // ("ranks [1] did not enter ...") reaches the client before the client
  // gives up on its own (then it would read a bare DEADLINE_EXCEEDED).
  const absl::Duration left = call_.deadline - absl::Now();
  call.deadline =
      call_.deadline - std::clamp(left / 10, kArrivalReplyMargin / 10, kArrivalReplyMargin);
  call.cancelled = call_.cancelled;
  {
    absl::MutexLock lock(&state_mu_);
    call.self_address = status_.listen_address();
  }
  const std::string host_address =
      mask.round > 0 && mask.host < static_cast<int>(joined_.rendezvous_addresses.size())
          ? joined_.rendezvous_addresses[mask.host]
          : joined_.rendezvous_address;
  if (arrival_host_ == nullptr || arrival_host_->address() != host_address) {
    arrival_host_ =
        std::make_unique<GrpcStore>(host_address, joined_.timeout, joined_.rendezvous_secret);
  }
  if (!local.ok()) {
    RefuseForCall(*arrival_host_, call, local);
    return local;
  }
  return ArriveForCall(*arrival_host_, call);
}

absl::Status WorkerService::MaskAgreedError(const char* rpc) const {
  const RankMaskState mask = data_plane_->mask();
  return absl::UnavailableError(
      absl::StrCat(rpc, ": a rank was lost; the survivors agreed on rank mask round ", mask.round,
                   " (masked ranks [", absl::StrJoin(mask.MaskedRanks(), ","), "], host rank ",
                   mask.host, "); nothing ran, send the call again to the live ranks"));
}

absl::StatusOr<bool> WorkerService::FinishMask(const char* rpc, absl::Duration wait) {
  absl::StatusOr<bool> done = data_plane_->FinishMaskRound(wait);
  if (!done.ok()) {
    mask_pending_ = false;
    return MarkGroupBroken(
        rpc, absl::Status(IsGroupError(done.status()) ? done.status().code()
                                                      : absl::StatusCode::kUnavailable,
                          absl::StrCat("rank mask failed: ", done.status().message())));
  }
  if (!*done) return false;
  mask_pending_ = false;
  AdoptMask(rpc, /*renumber=*/false);
  return true;
}

absl::Status WorkerService::RequireNoMask(const char* call) const {
  if (data_plane_ == nullptr) return absl::OkStatus();
  const RankMaskState mask = data_plane_->mask();
  const std::vector<int> masked = mask.MaskedRanks();
  if (masked.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      call, ": rank(s) [", absl::StrJoin(masked, ","), "] of ", joined_.world_size,
      " are masked out (lost; rank mask round ", mask.round, ", host rank ", mask.host, "); ", call,
      " needs every rank and does not run under a mask: Forward serves the masked group, or "
      "restart the lost rank(s) and re-admit them (Join with rejoin, then Rejoin), or re-form "
      "the group with a new generation"));
}

void WorkerService::AdoptMask(const char* rpc, bool renumber) {
  const RankMaskState mask = data_plane_->mask();
  if (renumber) {
    // Every member numbers its votes from here alike, whatever calls it
    // made before (a returning rank made none).
    vote_sequence_ = static_cast<int64_t>(mask.round) << 40;
    first_mask_vote_ = 0;
  } else {
    first_mask_vote_ = data_plane_->agreed_votes();
  }
  // The survivors' group: the call's deadline, and ForwardLayers' sub-groups
  // are made again on it.
  data_plane_->SetCall(call_);
  layer_stack_.Reset();
  const std::vector<int> masked_ranks = mask.MaskedRanks();
  spdlog::warn("{}: rank mask round {} agreed: masked ranks [{}], host rank {}", rpc, mask.round,
               absl::StrJoin(masked_ranks, ","), mask.host);
  absl::MutexLock lock(&state_mu_);
  status_.mutable_masked_ranks()->Assign(masked_ranks.begin(), masked_ranks.end());
  status_.set_mask_round(mask.round);
  status_.set_mask_host(mask.host);
}

void WorkerService::TearDownGroup() {
  vote_sequence_ = 0;
  first_mask_vote_ = 0;
  mask_pending_ = false;
  layer_stack_.Reset();  // before the data plane its sub-groups point into
  expert_bytes_ = 0;
  expert_specs_.clear();
  arrival_host_.reset();  // the next generation has its own secret (and host)
  allocation_.reset();
  geometry_committed_ = false;
  plan_.clear();
  model_.Clear();
  data_plane_.reset();
  absl::MutexLock lock(&state_mu_);
  state_.Left();
  status_.set_rank(0);
  status_.set_world_size(0);
  status_.set_backend("");
  status_.set_data_plane("");
  status_.set_plan_summary("");
  status_.set_workspace_bytes(0);
  status_.set_geometry_epoch(0);
  status_.set_runtime_max_tokens_per_rank(0);
  status_.set_capacity_tokens(0);
  status_.set_expert_bytes(0);
  status_.clear_expert_tokens();
  status_.clear_masked_ranks();
  status_.set_mask_round(0);
  status_.set_mask_host(0);
  SetDeviceLocked(options_.default_backend);
  UpdateHealthLocked();
}

// ---------------------------------------------------------------- GetStatus

grpc::Status WorkerService::GetStatus(grpc::ServerContext* /*context*/,
                                      const v1::GetStatusRequest* /*request*/,
                                      v1::GetStatusResponse* response) {
  {
    absl::MutexLock lock(&state_mu_);
    *response = status_;
    response->set_state(ToProto(state_.phase()));
  }
  lease_.Fill(response);
  return grpc::Status::OK;
}

// -------------------------------------------------------------------- Lease

grpc::Status WorkerService::Lease(grpc::ServerContext* /*context*/, const v1::LeaseRequest* request,
                                  v1::LeaseResponse* response) {
  return Finish(RunGuarded("Lease", [&]() -> absl::Status {
    {
      absl::MutexLock lock(&state_mu_);
      if (shutting_down_) return absl::UnavailableError("Lease: worker is shutting down");
    }
    ASSIGN_OR_RETURN(*response, lease_.Handle(*request));
    return absl::OkStatus();
  }));
}

// --------------------------------------------------------------------- Join

grpc::Status WorkerService::Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                                 v1::JoinResponse* response) {
  return Finish(RunGuarded("Join", [&] { return DoJoin(context, *request, response); }));
}

bool WorkerService::CanVoteOnJoin(const v1::JoinRequest& request) const {
  return !request.rejoin() && request.world_size() > 1 &&
         request.world_size() <= options_.limits.max_world_size && request.rank() >= 0 &&
         request.rank() < request.world_size() && !request.rendezvous_address().empty() &&
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
                                state_.broken_reason(), &joined_};
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
    response->set_backend(joined_.backend);
    response->set_data_plane(data_plane_ != nullptr ? data_plane_->data_plane() : "");
    return absl::OkStatus();  // idempotent
  }
  if (votes) {
    // Join's cross-rank vote goes through the generation's store (there is
    // no group yet): server/join_vote.h.
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
    RETURN_IF_ERROR(RunJoinVote(
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
                   FormJoinedGroup(*args, options_.device, CallDeadline(context)));
  InstallGroup(*args, std::move(formed));
  if (args->rejoin) AdoptMask("Join", /*renumber=*/true);  // GetStatus shows it alone until Rejoin
  lease_.Apply(request.lease());
  response->set_backend(args->backend);
  response->set_data_plane(data_plane_->data_plane());
  return absl::OkStatus();
}

void WorkerService::RefuseJoin(const grpc::ServerContext* context, const v1::JoinRequest& request,
                               const absl::Status& local) {
  if (request.world_size() <= 1 || request.rendezvous_address().empty() ||
      request.generation() < 1) {
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
    const absl::Status posted = PostJoinRefusal(store, generation, local, self, rank, world);
    if (!posted.ok()) spdlog::warn("Join: refusal not posted: {}", posted.ToString());
    in_flight.fetch_sub(1);
  }).detach();
}

void WorkerService::InstallGroup(const JoinArgs& args, std::unique_ptr<DataPlane> formed) {
  TearDownGroup();
  data_plane_ = std::move(formed);
  if ((args.rank == 0 || !args.rendezvous_addresses.empty()) && options_.rendezvous != nullptr) {
    options_.rendezvous->DropGenerationsBelow(args.generation);
  }
  joined_ = args;
  {
    absl::MutexLock lock(&state_mu_);
    state_.Joined();
    status_.mutable_counters()->set_consecutive_failed_collectives(0);
    status_.set_rank(args.rank);
    status_.set_world_size(args.world_size);
    status_.set_generation(args.generation);
    status_.set_backend(args.backend);
    status_.set_data_plane(data_plane_->data_plane());
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
    if (request.generation() != 0 && request.generation() != joined_.generation) {
      return absl::FailedPreconditionError(absl::StrCat("Leave: generation ", request.generation(),
                                                        " does not match the joined generation ",
                                                        joined_.generation));
    }
  }
  spdlog::info("Leave: tearing down generation {}", joined_.generation);
  TearDownGroup();
  return absl::OkStatus();
}

// ---------------------------------------------------------- ConfigureLayers

grpc::Status WorkerService::ConfigureLayers(grpc::ServerContext* context,
                                            const v1::ConfigureLayersRequest* request,
                                            v1::ConfigureLayersResponse* response) {
  return FinishCollective(RunGuarded("ConfigureLayers", [&] {
    return Leased("ConfigureLayers", request->lease(), [&](const absl::Status& refused) {
      return DoConfigureLayers(context, *request, refused, response);
    });
  }));
}

absl::Status WorkerService::DoConfigureLayers(grpc::ServerContext* context,
                                              const v1::ConfigureLayersRequest& request,
                                              const absl::Status& refused,
                                              v1::ConfigureLayersResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(
      EnterLeasedGroup(slot, context, "ConfigureLayers", WorkerPhase::kJoined, refused));
  // A lease refusal is this rank's own error in the vote: its peers are
  // ABORTED at once, naming it and the owner (issue 12).
  absl::StatusOr<LayerConfig> config =
      refused.ok() ? LayerConfigFromRequest(options_.limits, request, joined_.world_size)
                   : absl::StatusOr<LayerConfig>(refused);
  RETURN_IF_ERROR(Vote("ConfigureLayers", config.status(), LayerConfigFields(request)));

  const int num_sparse = FillPlanReply(config->plan, response);
  response->set_fingerprint(core::Hex64(LayerConfigFingerprint(request, *config)));
  plan_ = std::move(config->plan);
  model_ = request.model();
  layer_stack_.Configure(config->layout, config->sparse, config->a2a_enabled, model_);
  absl::MutexLock lock(&state_mu_);
  state_.Configured();
  status_.set_plan_summary(absl::StrCat(plan_.size(), " layers, ", num_sparse, " sparse"));
  UpdateHealthLocked();
  return absl::OkStatus();
}

// -------------------------------------------------------- AllocateWorkspace

grpc::Status WorkerService::AllocateWorkspace(grpc::ServerContext* context,
                                              const v1::AllocateWorkspaceRequest* request,
                                              v1::AllocateWorkspaceResponse* response) {
  return FinishCollective(RunGuarded("AllocateWorkspace", [&] {
    return Leased("AllocateWorkspace", request->lease(), [&](const absl::Status& refused) {
      return DoAllocateWorkspace(context, *request, refused, response);
    });
  }));
}

absl::StatusOr<core::EpDispatcherOptions> WorkerService::PrepareAllocation(
    const v1::AllocateWorkspaceRequest& request, bool* same_spec) {
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kConfigured, "AllocateWorkspace"));
  ASSIGN_OR_RETURN(core::EpDispatcherOptions options,
                   AllocationFromRequest(options_.limits, request, joined_.world_size, model_));
  RETURN_IF_ERROR(core::ValidateDispatchDType(options.workspace.dtype, data_plane_->limits()));
  *same_spec = allocation_ != nullptr && allocation_->fingerprint == AllocationFingerprint(options);
  ASSIGN_OR_RETURN(core::AllocatedWorkspace allocated,
                   core::ComputeAllocatedWorkspace(options.workspace));
  // The memory cap covers the workspace and the expert weights kept with it
  // (a different spec drops the loaded experts).
  RETURN_IF_ERROR(
      CheckWorkspaceFits(Budget(), allocated.total_bytes, *same_spec ? expert_bytes_ : 0));
  return options;
}

absl::Status WorkerService::DoAllocateWorkspace(grpc::ServerContext* context,
                                                const v1::AllocateWorkspaceRequest& request,
                                                const absl::Status& refused,
                                                v1::AllocateWorkspaceResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(
      EnterLeasedGroup(slot, context, "AllocateWorkspace", WorkerPhase::kConfigured, refused));
  bool same_spec = false;
  absl::StatusOr<core::EpDispatcherOptions> options =
      refused.ok() ? PrepareAllocation(request, &same_spec)
                   : absl::StatusOr<core::EpDispatcherOptions>(refused);
  RETURN_IF_ERROR(
      Vote("AllocateWorkspace", options.status(),
           options.ok() ? AllocationFields(*options) : std::vector<core::BallotField>{}));
  if (!same_spec) RETURN_IF_ERROR(Allocate(*options));
  *response = allocation_->response;
  absl::MutexLock lock(&state_mu_);
  state_.Allocated();
  status_.set_workspace_bytes(allocation_->response.allocated_bytes());
  status_.set_capacity_tokens(options->workspace.capacity_tokens);
  status_.set_expert_bytes(expert_bytes_);
  if (!same_spec) {
    status_.set_geometry_epoch(0);
    status_.set_runtime_max_tokens_per_rank(0);
    status_.clear_expert_tokens();  // the new data plane's load statistics start at zero
  }
  UpdateHealthLocked();
  return absl::OkStatus();
}

absl::Status WorkerService::Allocate(const core::EpDispatcherOptions& options) {
  // Replaces the data plane's workspace and drops its experts.
  ASSIGN_OR_RETURN(
      DataPlaneAllocation held,
      data_plane_->Allocate(options, model_.moe_intermediate_size(), options_.memory_cap_bytes));
  auto allocation = std::make_unique<Allocation>();
  allocation->options = options;
  allocation->fingerprint = AllocationFingerprint(options);
  ASSIGN_OR_RETURN(allocation->response, AllocationReply(options, held));
  allocation_ = std::move(allocation);
  geometry_committed_ = false;
  expert_bytes_ = 0;
  expert_specs_.clear();
  return absl::OkStatus();
}

// -------------------------------------------------------------- LoadExperts

grpc::Status WorkerService::LoadExperts(grpc::ServerContext* context,
                                        const v1::LoadExpertsRequest* request,
                                        v1::LoadExpertsResponse* response) {
  return Finish(RunGuarded("LoadExperts", [&] {
    return Leased("LoadExperts", request->lease(), [&](const absl::Status& refused) {
      return DoLoadExperts(context, *request, refused, response);
    });
  }));
}

absl::StatusOr<ExpertLoad> WorkerService::PrepareExpertLoad(const v1::LoadExpertsRequest& request) {
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "LoadExperts"));
  const int requested_layer = request.layer();
  const std::shared_ptr<const core::PlacementTable> table =
      requested_layer >= 0 ? data_plane_->Placement(requested_layer) : nullptr;
  const ExpertLoadContext state{&plan_,
                                &model_,
                                &allocation_->options,
                                joined_.world_size,
                                joined_.rank,
                                options_.checkpoint_dirs,
                                table.get()};
  ASSIGN_OR_RETURN(ExpertLoad load, ExpertLoadFromRequest(options_.limits, request, state));
  RETURN_IF_ERROR(
      CheckExpertsFit(Budget(), load.layer, load.weight_bytes, data_plane_->ExpertBytes(load.layer))
          .status());
  return load;
}

absl::Status WorkerService::DoLoadExperts(grpc::ServerContext* context,
                                          const v1::LoadExpertsRequest& request,
                                          const absl::Status& refused,
                                          v1::LoadExpertsResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterLeasedGroup(slot, context, "LoadExperts", WorkerPhase::kAllocated, refused));
  absl::StatusOr<ExpertLoad> load =
      refused.ok() ? PrepareExpertLoad(request) : absl::StatusOr<ExpertLoad>(refused);
  // Local only, as worker.proto says (issue 29 item 3): no vote, so a
  // coordinator may load rank by rank and retry one rank. The ranks'
  // agreement on what each layer holds is checked by the next Forward's
  // vote (ExpertSpecField), and a rank without the layer's experts rejects
  // that Forward itself.
  RETURN_IF_ERROR(load.status());
  const int64_t hidden = allocation_->options.workspace.hidden;
  const int64_t old_bytes = data_plane_->ExpertBytes(load->layer);
  ASSIGN_OR_RETURN(int64_t total,
                   CheckExpertsFit(Budget(), load->layer, load->weight_bytes, old_bytes));
  const core::ExpertSource source = MakeExpertSource(*load, request, allocation_->options);
  RETURN_IF_ERROR(core::ValidateExpertSource(source));
  // The shared expert is made (and checked) before anything is replaced.
  const int64_t old_shared = data_plane_->SharedExpertBytes(load->layer);
  ASSIGN_OR_RETURN(std::optional<core::SharedExpert> shared,
                   MakeSharedExpert(request, load->checkpoint, hidden, total - old_shared,
                                    options_.memory_cap_bytes));
  // The plane makes the experts from the source (the GPU plane on its device,
  // without a host copy; core/expert_source.h) and may grow its expert scratch.
  ASSIGN_OR_RETURN(int64_t bytes,
                   data_plane_->LoadExperts(load->layer, source, options_.memory_cap_bytes));
  expert_bytes_ += bytes - old_bytes;
  ASSIGN_OR_RETURN(
      int64_t shared_bytes,
      data_plane_->LoadSharedExpert(load->layer, std::move(shared), options_.memory_cap_bytes));
  expert_bytes_ += shared_bytes - old_shared;
  expert_specs_[load->layer] = ExpertSpecFingerprint(ExpertLoadFields(request, *load));
  response->set_first_expert(load->first_expert);
  response->set_num_local_experts(load->num_local_experts);
  response->set_expert_bytes(bytes);
  response->set_shared_expert_bytes(shared_bytes);
  response->mutable_slot_experts()->Assign(load->slot_experts.begin(), load->slot_experts.end());
  absl::MutexLock lock(&state_mu_);
  status_.set_expert_bytes(expert_bytes_);
  status_.set_workspace_bytes(data_plane_->allocated_bytes());
  return absl::OkStatus();
}

// ---------------------------------------------------------- SyncTokenCounts

grpc::Status WorkerService::SyncTokenCounts(grpc::ServerContext* context,
                                            const v1::SyncTokenCountsRequest* request,
                                            v1::SyncTokenCountsResponse* response) {
  return FinishCollective(RunGuarded(
      "SyncTokenCounts", [&] { return DoSyncTokenCounts(context, *request, response); }));
}

absl::Status WorkerService::DoSyncTokenCounts(grpc::ServerContext* context,
                                              const v1::SyncTokenCountsRequest& request,
                                              v1::SyncTokenCountsResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "SyncTokenCounts", WorkerPhase::kAllocated));
  absl::Status local = RequirePhase(WorkerPhase::kAllocated, "SyncTokenCounts");
  if (local.ok()) local = CheckSyncTokenCounts(request);
  if (local.ok()) local = RequireReadmitted("SyncTokenCounts");
  RETURN_IF_ERROR(Vote("SyncTokenCounts", local, {{"epoch", request.epoch()}}));
  absl::StatusOr<std::vector<int64_t>> counts =
      data_plane_->SyncTokenCounts(request.local_tokens());
  RETURN_IF_ERROR(GroupResult("SyncTokenCounts", counts.status()));
  const core::EpDispatcherOptions& options = allocation_->options;
  ASSIGN_OR_RETURN(int64_t runtime_max,
                   core::ChooseRuntimeMaxTokens(*counts, options.cuda_graph_buckets,
                                                options.workspace.capacity_tokens));
  response->mutable_token_counts()->Assign(counts->begin(), counts->end());
  response->set_max_tokens(*std::max_element(counts->begin(), counts->end()));
  response->set_runtime_max_tokens_per_rank(runtime_max);
  return absl::OkStatus();
}

// ----------------------------------------------------------- CommitGeometry

grpc::Status WorkerService::CommitGeometry(grpc::ServerContext* context,
                                           const v1::CommitGeometryRequest* request,
                                           v1::CommitGeometryResponse* /*response*/) {
  return Finish(RunGuarded("CommitGeometry", [&] { return DoCommitGeometry(context, *request); }));
}

// Not a collective (each rank records its own geometry; the ranks' (epoch,
// R) agreement is checked by the next Forward), so there is no vote.
absl::Status WorkerService::DoCommitGeometry(grpc::ServerContext* context,
                                             const v1::CommitGeometryRequest& request) {
  RETURN_IF_ERROR(CheckCommitGeometry(request));
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "CommitGeometry", WorkerPhase::kAllocated));
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "CommitGeometry"));
  RETURN_IF_ERROR(data_plane_->CommitGeometry(
      request.epoch(), request.runtime_max_tokens_per_rank(), request.local_tokens()));
  geometry_committed_ = true;
  absl::MutexLock lock(&state_mu_);
  status_.set_geometry_epoch(request.epoch());
  status_.set_runtime_max_tokens_per_rank(request.runtime_max_tokens_per_rank());
  UpdateHealthLocked();  // the log fields carry the epoch
  return absl::OkStatus();
}

// ------------------------------------------------------------------ Forward

grpc::Status WorkerService::Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) {
  return FinishCollective(
      RunGuarded("Forward", [&] { return DoForward(context, *request, response); }));
}

absl::Status WorkerService::RequireReadmitted(const char* call) const {
  if (!joined_.rejoin || data_plane_->mask().round != 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(call, ": rank ", joined_.rank,
                   " joined alone to take its masked rank back (JoinRequest.rejoin) and is not "
                   "re-admitted yet; call Rejoin on it and on the live ranks first"));
}

absl::StatusOr<ForwardInputs> WorkerService::PrepareForward(const v1::ForwardRequest& request) {
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "Forward"));
  RETURN_IF_ERROR(RequireReadmitted("Forward"));
  ASSIGN_OR_RETURN(ForwardInputs in,
                   ForwardFromRequest(options_.limits, request, allocation_->options));
  if (!data_plane_->HasExperts(in.layer)) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Forward: layer ", in.layer, " has no loaded experts; call LoadExperts first"));
  }
  if (!geometry_committed_) {
    return absl::FailedPreconditionError(
        "Forward requires a committed geometry; call SyncTokenCounts and CommitGeometry first");
  }
  if (in.epoch != data_plane_->epoch()) {
    return absl::FailedPreconditionError(
        absl::StrCat("Forward: epoch ", in.epoch, " does not match the committed geometry epoch ",
                     data_plane_->epoch(), "; call CommitGeometry for epoch ", in.epoch, " first"));
  }
  return in;
}

absl::Status WorkerService::DoForward(grpc::ServerContext* context,
                                      const v1::ForwardRequest& request,
                                      v1::ForwardResponse* response) {
  const absl::Time start = absl::Now();
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "Forward", WorkerPhase::kAllocated));
  absl::StatusOr<ForwardInputs> in = PrepareForward(request);
  std::vector<core::BallotField> fields;
  if (in.ok()) {
    fields = ForwardFields(*in);
    auto spec = expert_specs_.find(in->layer);
    fields.push_back(
        {"experts of the layer (LoadExperts kind, intermediate_size, seed, "
         "safetensors_path, name_pattern)",
         spec != expert_specs_.end() ? spec->second : 0, /*is_fingerprint=*/true});
  }
  RETURN_IF_ERROR(Vote("Forward", in.status(), std::move(fields)));
  const int64_t hidden = allocation_->options.workspace.hidden;
  // The data plane reads the request's bytes and writes the reply's: one
  // host copy each way (issue 11 item 2).
  v1::Tensor* output = response->mutable_output();
  absl::StatusOr<core::StepStats> stats =
      data_plane_->ForwardBytes(in->layer, in->tensors, in->tokens, output->mutable_data());
  RETURN_IF_ERROR(GroupResult("Forward", stats.status()));
  output->set_dtype(v1::DTYPE_BF16);
  output->add_shape(in->tokens);
  output->add_shape(hidden);
  FillForwardReply(*stats, absl::Now() - start, response);
  const std::vector<int64_t> totals = data_plane_->ExpertTokenTotals(in->layer);
  absl::MutexLock lock(&state_mu_);
  SetExpertTokensLocked(in->layer, totals);
  v1::Counters* counters = status_.mutable_counters();
  counters->set_forwards(counters->forwards() + 1);
  counters->set_tokens_dispatched(counters->tokens_dispatched() + stats->tokens_sent);
  counters->set_bytes_sent(counters->bytes_sent() + stats->bytes_sent_remote);
  return absl::OkStatus();
}

// --------------------------------------------------------------------- Echo

grpc::Status WorkerService::Echo(grpc::ServerContext* /*context*/, const v1::EchoRequest* request,
                                 v1::EchoResponse* response) {
  return Finish(RunGuarded("Echo", [&]() -> absl::Status {
    {
      absl::MutexLock lock(&state_mu_);
      if (shutting_down_) return absl::UnavailableError("Echo: worker is shutting down");
    }
    if (!options_.enable_echo) {
      return absl::UnimplementedError(
          "Echo is a test-only RPC; this worker serves it only when started with --enable-echo");
    }
    const v1::Tensor& tensor = request->tensor();
    RETURN_IF_ERROR(ValidateTensor(tensor, "tensor", tensor.shape_size()));
    *response->mutable_tensor() = tensor;
    return absl::OkStatus();
  }));
}

// ---------------------------------------------------------------- Benchmark

grpc::Status WorkerService::Benchmark(grpc::ServerContext* context,
                                      const v1::BenchmarkRequest* request,
                                      v1::BenchmarkResponse* response) {
  return FinishCollective(
      RunGuarded("Benchmark", [&] { return DoBenchmark(context, *request, response); }));
}

absl::StatusOr<BenchmarkSpec> WorkerService::PrepareBenchmark(const v1::BenchmarkRequest& request) {
  ASSIGN_OR_RETURN(BenchmarkSpec spec,
                   BenchmarkFromRequest(options_.limits, request, joined_.world_size));
  ASSIGN_OR_RETURN(core::AllocatedWorkspace needed,
                   core::ComputeAllocatedWorkspace(spec.options.workspace));
  RETURN_IF_ERROR(CheckBenchmarkFits(
      Budget(), needed.total_bytes,
      BenchmarkInputBytes(request.tokens_per_rank(), request.hidden_size(), request.top_k())));
  return spec;
}

absl::Status WorkerService::DoBenchmark(grpc::ServerContext* context,
                                        const v1::BenchmarkRequest& request,
                                        v1::BenchmarkResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "Benchmark", WorkerPhase::kJoined));
  absl::StatusOr<BenchmarkSpec> spec = PrepareBenchmark(request);
  if (spec.ok()) {
    const absl::Status unmasked = RequireNoMask("Benchmark");
    if (!unmasked.ok()) spec = unmasked;
  }
  RETURN_IF_ERROR(Vote("Benchmark", spec.status(),
                       spec.ok() ? BenchmarkFields(*spec) : std::vector<core::BallotField>{}));
  const core::WorkspaceSpec& ws = spec->options.workspace;
  const BenchmarkInputs inputs =
      GenerateBenchmarkInputs(spec->seed, joined_.rank, ws.capacity_tokens, ws.hidden, ws.top_k,
                              spec->options.num_experts, spec->routing);
  // Identity experts on a scratch dispatcher of the data plane (GPU: timed
  // with CUDA events on the stream; CPU: wall clock).
  absl::StatusOr<BenchmarkTimes> times =
      data_plane_->Benchmark(spec->options, inputs, spec->warmup, spec->iterations,
                             Budget().ScratchCap(), spec->data_plane);
  RETURN_IF_ERROR(GroupResult("Benchmark", times.status()));
  return FillBenchmarkReply(spec->options, std::move(*times), response);
}

// ------------------------------------------------------------ ForwardLayers

grpc::Status WorkerService::ForwardLayers(grpc::ServerContext* context,
                                          const v1::ForwardLayersRequest* request,
                                          v1::ForwardLayersResponse* response) {
  return FinishCollective(
      RunGuarded("ForwardLayers", [&] { return DoForwardLayers(context, *request, response); }));
}

absl::Status WorkerService::DoForwardLayers(grpc::ServerContext* context,
                                            const v1::ForwardLayersRequest& request,
                                            v1::ForwardLayersResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "ForwardLayers", WorkerPhase::kConfigured));
  // The request is checked inside the runner, which votes through `vote`
  // before anything moves (server/layer_stack_runner.h).
  absl::Status local = RequirePhase(WorkerPhase::kConfigured, "ForwardLayers");
  if (local.ok()) local = CheckForwardLayers(options_.limits, request);
  if (local.ok()) local = RequireNoMask("ForwardLayers");
  // Vote handles its own group errors (a mask round, or a broken group):
  // a failed vote's status must not reach GroupResult, which would start
  // another round for it.
  bool vote_failed = false;
  const LayerStackRunner::VoteFn vote = [&](absl::Status runner_local,
                                            std::vector<core::BallotField> fields) {
    absl::Status voted =
        Vote("ForwardLayers", local.ok() ? std::move(runner_local) : local, std::move(fields));
    vote_failed = !voted.ok();
    return voted;
  };
  if (!local.ok()) return vote(local, {});
  const MemoryBudget budget = Budget();
  absl::Status ran = layer_stack_.Run(data_plane_->collective(), joined_.generation, call_, vote,
                                      request, budget.cap_bytes, budget.held(), response);
  if (vote_failed) return ran;
  return GroupResult("ForwardLayers", std::move(ran));
}

}  // namespace moe_ep::server
