#include "server/group_session.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"
#include "server/call_arrival.h"
#include "server/collective_slot.h"
#include "server/worker_state.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

// How long before the call's deadline an arrival wait gives up (at most).
constexpr absl::Duration kArrivalReplyMargin = absl::Milliseconds(250);

}  // namespace

GroupSession::GroupSession(Observer* observer) : observer_(observer) {}

GroupSession::~GroupSession() = default;

void GroupSession::Install(const JoinArgs& args, std::unique_ptr<DataPlane> formed) {
  TearDown();
  plane_ = std::move(formed);
  args_ = args;
}

void GroupSession::TearDown() {
  vote_sequence_ = 0;
  first_mask_vote_ = 0;
  mask_pending_ = false;
  masked_before_round_.clear();
  silent_since_ = absl::InfiniteFuture();
  layer_stack_.Reset();   // before the data plane its sub-groups point into
  arrival_host_.reset();  // the next generation has its own secret (and host)
  plane_.reset();
}

absl::Status GroupSession::BeginCall(const grpc::ServerContext* context, const char* rpc) {
  call_ = CallBound{CallDeadline(context), nullptr};  // nothing latched from the last call
  if (context != nullptr) call_.cancelled = [context] { return context->IsCancelled(); };
  plane_->SetCall(call_);
  if (!mask_pending_) return absl::OkStatus();
  ASSIGN_OR_RETURN(bool done, FinishMask(rpc, kMaskSettled));
  if (!done) {
    ASSIGN_OR_RETURN(done, FinishMask(rpc, 4 * args_.timeout));
    if (!done) {
      return MarkBroken(
          rpc, absl::DeadlineExceededError(absl::StrCat("rank mask: no agreement within ",
                                                        absl::FormatDuration(4 * args_.timeout))));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<bool> GroupSession::StartMask(const char* rpc, const absl::Status& status) {
  spdlog::warn("{}: collective failed ({}); agreeing on a rank mask", rpc, status.ToString());
  masked_before_round_ = plane_->mask().MaskedRanks();
  plane_->BeginMaskRound(vote_sequence_);
  mask_pending_ = true;
  return FinishMask(rpc, MaskGrace());
}

absl::Status GroupSession::GroupResult(const char* rpc, absl::Status status) {
  if (status.ok() || !IsGroupError(status)) return status;
  if (plane_ != nullptr && plane_->CanMask()) {
    // DESIGN §15: not broken; the survivors agree on a rank mask
    // (server/rank_mask.h). This call's step is lost either way.
    ASSIGN_OR_RETURN(const bool done, StartMask(rpc, status));
    return absl::Status(
        status.code(),
        absl::StrCat(status.message(), "; the step did not complete: ",
                     done ? "the survivors masked the lost rank(s)"
                          : "the survivors are masking the lost rank(s)",
                     " (GetStatus.masked_ranks); send the step again to the live ranks"));
  }
  return MarkBroken(rpc, std::move(status));
}

absl::Status GroupSession::MarkBroken(const char* rpc, absl::Status status) {
  spdlog::warn("collective failed, group of generation {} is broken: {}", args_.generation,
               status.ToString());
  observer_->OnGroupBroken(
      absl::StrCat(rpc, ": ", absl::StatusCodeToString(status.code()), ": ", status.message()));
  return status;
}

absl::Duration GroupSession::MaskGrace() const {
  return std::min(args_.timeout / 2, absl::Seconds(1));
}

absl::Status GroupSession::Vote(const char* rpc, absl::Status local,
                                std::vector<core::BallotField> fields) {
  // A call numbered below the round's agreed count was spent by a later
  // survivor on the old group (see the file comment): no vote.
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
  // Ranks that did not enter and do not answer their probe (stopped or
  // overloaded, not gone): nothing moved, so no vote is counted and no mask
  // round starts (issue 29 items 2 and 4); the caller sees
  // DEADLINE_EXCEEDED naming them, the failed collective is counted, and
  // readiness goes NOT_SERVING from the third in a row, which the
  // coordinator acts on. A rank that refuses connections or left the
  // generation is a loss (UNAVAILABLE below).
  if (status.code() == absl::StatusCode::kDeadlineExceeded) {
    // Silent for longer than the group timeout (over this and earlier
    // calls): a node that is gone without a reset looks like this too, so
    // it is taken for lost from then on (DESIGN §15 masks it).
    const absl::Time now = absl::Now();
    if (silent_since_ == absl::InfiniteFuture()) silent_since_ = now;
    if (now - silent_since_ < args_.timeout) return status;
    status = absl::UnavailableError(
        absl::StrCat(status.message(), "; silent for ", absl::FormatDuration(now - silent_since_),
                     ", longer than the group timeout ", absl::FormatDuration(args_.timeout),
                     ": taken for lost"));
  }
  silent_since_ = absl::InfiniteFuture();
  if (status.ok()) {
    core::Ballot ballot;
    ballot.rpc = rpc;
    ballot.generation = args_.generation;
    ballot.sequence = vote_sequence_++;
    ballot.local = std::move(local);
    ballot.fields = std::move(fields);
    status = core::RunVote(plane_->collective(), ballot);
  } else {
    ++vote_sequence_;  // a rank was lost: counted as the failed vote it replaces
  }
  if (IsGroupError(status) && plane_->CanMask()) {
    // A rank was lost before this call's payload moved.
    ASSIGN_OR_RETURN(const bool done, StartMask(rpc, status));
    if (done) return MaskAgreedError(rpc);
    return absl::Status(status.code(),
                        absl::StrCat(status.message(),
                                     "; the survivors are masking the lost rank(s) "
                                     "(GetStatus.masked_ranks); send the call again"));
  }
  return GroupResult(rpc, status);
}

absl::Status GroupSession::ArriveForVote(const char* rpc, const absl::Status& local) {
  const RankMaskState mask = plane_->mask();
  CallArrival call;
  call.rpc = rpc;
  call.rank = args_.rank;
  // The group this call votes in: every rank, or the survivors under a
  // mask (original numbering); a returning rank alone votes by itself.
  const core::ControlCollective& group = plane_->collective();
  if (group.size() != args_.world_size) return local;
  for (int r = 0; r < group.size(); ++r) {
    if (group.IsLive(r)) call.members.push_back(r);
  }
  if (call.members.size() <= 1) return local;
  call.round = ArrivalRoundName(args_.generation, mask.round, vote_sequence_);
  call.generation = args_.generation;
  call.addresses = args_.rendezvous_addresses;
  call.host_rank = mask.round > 0 ? mask.host : 0;
  // The wait ends a little before the call's deadline, so that its answer
  // ("ranks [1] did not enter ...") reaches the client before the client
  // gives up on its own (then it would read a bare DEADLINE_EXCEEDED). A
  // quarter of what is left: the deadline the server sees starts when the
  // request arrives, and on a loaded 2-core CI machine arrival lagged the
  // client's clock by more than the 10% this once kept (issue 29 item 2).
  const absl::Duration left = call_.deadline - absl::Now();
  call.deadline =
      call_.deadline - std::clamp(left / 4, kArrivalReplyMargin / 10, kArrivalReplyMargin);
  call.cancelled = call_.cancelled;
  call.self_address = observer_->SelfAddress();
  const std::string host_address =
      mask.round > 0 && mask.host < static_cast<int>(args_.rendezvous_addresses.size())
          ? args_.rendezvous_addresses[mask.host]
          : args_.rendezvous_address;
  if (arrival_host_ == nullptr || arrival_host_->address() != host_address) {
    arrival_host_ =
        std::make_unique<GrpcStore>(host_address, args_.timeout, args_.rendezvous_secret);
  }
  if (!local.ok()) {
    RefuseForCall(*arrival_host_, call, local);
    return local;
  }
  return ArriveForCall(*arrival_host_, call);
}

absl::Status GroupSession::MaskAgreedError(const char* rpc) const {
  const RankMaskState mask = plane_->mask();
  if (mask.MaskedRanks() == masked_before_round_) {
    return absl::AbortedError(absl::StrCat(
        rpc, ": a collective failed and rank mask round ", mask.round,
        " found every rank alive (masked ranks [", absl::StrJoin(mask.MaskedRanks(), ","),
        "] as before): nothing ran and the group is unchanged; send the call again"));
  }
  return absl::UnavailableError(
      absl::StrCat(rpc, ": a rank was lost; the survivors agreed on rank mask round ", mask.round,
                   " (masked ranks [", absl::StrJoin(mask.MaskedRanks(), ","), "], host rank ",
                   mask.host, "); nothing ran, send the call again to the live ranks"));
}

absl::StatusOr<bool> GroupSession::FinishMask(const char* rpc, absl::Duration wait) {
  absl::StatusOr<bool> done = plane_->FinishMaskRound(wait);
  if (!done.ok()) {
    mask_pending_ = false;
    return MarkBroken(rpc,
                      absl::Status(IsGroupError(done.status()) ? done.status().code()
                                                               : absl::StatusCode::kUnavailable,
                                   absl::StrCat("rank mask failed: ", done.status().message())));
  }
  if (!*done) return false;
  mask_pending_ = false;
  AdoptMask(rpc, /*renumber=*/false);
  return true;
}

absl::Status GroupSession::RequireNoMask(const char* call) const {
  if (plane_ == nullptr) return absl::OkStatus();
  const RankMaskState mask = plane_->mask();
  const std::vector<int> masked = mask.MaskedRanks();
  if (masked.empty()) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      call, ": rank(s) [", absl::StrJoin(masked, ","), "] of ", args_.world_size,
      " are masked out (lost; rank mask round ", mask.round, ", host rank ", mask.host, "); ", call,
      " needs every rank and does not run under a mask: Forward serves the masked group, or "
      "restart the lost rank(s) and re-admit them (Join with rejoin, then Rejoin), or re-form "
      "the group with a new generation"));
}

void GroupSession::AdoptMask(const char* rpc, bool renumber) {
  const RankMaskState mask = plane_->mask();
  if (renumber) {
    // Every member numbers its votes from here alike, whatever calls it
    // made before (a returning rank made none).
    vote_sequence_ = static_cast<int64_t>(mask.round) << 40;
    first_mask_vote_ = 0;
  } else {
    first_mask_vote_ = plane_->agreed_votes();
  }
  plane_->SetCall(call_);
  layer_stack_.Reset();
  spdlog::warn("{}: rank mask round {} agreed: masked ranks [{}], host rank {}", rpc, mask.round,
               absl::StrJoin(mask.MaskedRanks(), ","), mask.host);
  observer_->OnMaskAdopted(mask);
}

}  // namespace moe_ep::server
