// WorkerService::Rejoin (worker.proto; DESIGN §15 "a restarted rank rejoins
// at a step boundary and the mask clears"; issue 17 item 3): the survivors
// and the returning ranks run one mask round that re-admits them, then vote
// on their state before the group serves again. Kept apart from the step
// RPCs: it shares the slot, the vote and the mask bookkeeping with them.

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/fingerprint.h"
#include "core/status_macros.h"
#include "server/worker_service.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

std::string RankList(const std::vector<int>& ranks) { return absl::StrJoin(ranks, ","); }

// The digest a vote compares of a rank list.
int64_t RanksDigest(const std::vector<int>& ranks) {
  return static_cast<int64_t>(core::Fingerprint64(RankList(ranks)));
}

}  // namespace

grpc::Status WorkerService::Rejoin(grpc::ServerContext* context, const v1::RejoinRequest* request,
                                   v1::RejoinResponse* response) {
  return FinishCollective(RunGuarded("Rejoin", [&] {
    return Leased("Rejoin", request->lease(), [&](const absl::Status& refused) {
      return DoRejoin(context, *request, refused, response);
    });
  }));
}

absl::Status WorkerService::CheckRejoin(const v1::RejoinRequest& request, bool* returning) const {
  const int world = session_.args().world_size;
  const std::vector<int> masked(request.masked_ranks().begin(), request.masked_ranks().end());
  const std::vector<int> ranks(request.ranks().begin(), request.ranks().end());
  for (size_t i = 0; i < masked.size(); ++i) {
    if (masked[i] < 0 || masked[i] >= world || (i > 0 && masked[i] <= masked[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("masked_ranks: expected ascending distinct ranks in [0, ", world, "), got [",
                       RankList(masked), "]"));
    }
  }
  if (ranks.empty()) return absl::InvalidArgumentError("ranks: expected at least one rank");
  if (request.mask_round() < 1 || request.mask_round() > (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "mask_round: expected the survivors' round (>= 1, <= 2^30), got ", request.mask_round()));
  }
  for (size_t i = 0; i < ranks.size(); ++i) {
    if (ranks[i] < 0 || ranks[i] >= world || (i > 0 && ranks[i] <= ranks[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranks: expected ascending distinct ranks in [0, ", world, "), got [",
                       RankList(ranks), "]"));
    }
    if (!std::binary_search(masked.begin(), masked.end(), ranks[i])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "ranks: rank ", ranks[i], " is not among masked_ranks [", RankList(masked), "]"));
    }
  }
  if (request.generation() != session_.args().generation) {
    return absl::FailedPreconditionError(absl::StrCat("Rejoin: generation ", request.generation(),
                                                      " is not the joined generation ",
                                                      session_.args().generation));
  }
  const RankMaskState mask = session_.plane()->mask();
  *returning = std::binary_search(ranks.begin(), ranks.end(), session_.args().rank);
  if (*returning) {
    // A restarted worker set up alone: only its own rank is live.
    if (!session_.args().rejoin || mask.round != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "Rejoin: rank ", session_.args().rank,
          " is listed as returning but did not join alone (JoinRequest.rejoin), or was already "
          "re-admitted (mask round ",
          mask.round, ")"));
    }
    return absl::OkStatus();
  }
  if (mask.round != request.mask_round() || mask.MaskedRanks() != masked) {
    return absl::FailedPreconditionError(
        absl::StrCat("Rejoin: rank ", session_.args().rank, " is at mask round ", mask.round,
                     " with masked ranks [", RankList(mask.MaskedRanks()),
                     "], the request says round ", request.mask_round(), " with [",
                     RankList(masked), "]; read GetStatus.mask_round and masked_ranks again"));
  }
  return absl::OkStatus();
}

std::vector<core::BallotField> WorkerService::MemberStateFields() const {
  std::vector<core::BallotField> fields;
  fields.push_back({"allocation", static_cast<int64_t>(allocation_->fingerprint), true});
  fields.push_back(
      {"model", static_cast<int64_t>(core::Fingerprint64(model_.SerializeAsString())), true});
  std::string tables;
  std::string loaded;
  for (const core::LayerPlan& layer : plan_) {
    if (!layer.sparse) continue;
    const std::shared_ptr<const core::PlacementTable> table =
        session_.plane()->Placement(layer.layer);
    absl::StrAppend(&tables, layer.layer, "=", table != nullptr ? table->CanonicalText() : "", ";");
    if (session_.plane()->HasExperts(layer.layer)) absl::StrAppend(&loaded, layer.layer, ",");
  }
  fields.push_back({"placement tables (every MoE layer)",
                    static_cast<int64_t>(core::Fingerprint64(tables)), true});
  fields.push_back(
      {"layers with loaded experts", static_cast<int64_t>(core::Fingerprint64(loaded)), true});
  return fields;
}

absl::Status WorkerService::DoRejoin(grpc::ServerContext* context, const v1::RejoinRequest& request,
                                     const absl::Status& refused, v1::RejoinResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterLeasedGroup(slot, context, "Rejoin", WorkerPhase::kAllocated, refused));
  bool returning = false;
  absl::Status local = refused;
  if (local.ok()) local = RequirePhase(WorkerPhase::kAllocated, "Rejoin");
  if (local.ok() && !session_.plane()->CanMask()) {
    local = absl::UnimplementedError(
        "Rejoin: this group cannot re-admit a rank (Gloo joined with rendezvous_addresses "
        "only); re-form it with a new generation");
  }
  if (local.ok()) local = CheckRejoin(request, &returning);
  // The survivors agree on the request in their group (a returning rank
  // votes alone in its own).
  const std::vector<int> masked_ranks(request.masked_ranks().begin(), request.masked_ranks().end());
  const std::vector<int> ranks(request.ranks().begin(), request.ranks().end());
  RETURN_IF_ERROR(session_.Vote("Rejoin", local,
                                {{"mask_round", request.mask_round()},
                                 {"masked_ranks", RanksDigest(masked_ranks), true},
                                 {"ranks", RanksDigest(ranks), true}}));
  const int world = session_.args().world_size;
  std::vector<bool> live_before(world, true);
  for (int r : masked_ranks) live_before[r] = false;
  std::vector<bool> joining(world, false);
  for (int r : ranks) joining[r] = true;
  const int round = request.mask_round() + 1;
  absl::Status readmitted = session_.plane()->Readmit(round, live_before, joining);
  if (!readmitted.ok()) {
    // A returning rank left out keeps its plane (it stays alone and may be
    // sent Rejoin again); a survivor whose round failed has no usable group.
    if (returning) return readmitted;
    return session_.MarkBroken(
        "Rejoin",
        absl::Status(readmitted.code(),
                     absl::StrCat("rank mask round ", round, " (Rejoin): ", readmitted.message())));
  }
  session_.AdoptMask("Rejoin", /*renumber=*/true);
  // The members check that they serve the same state before any step.
  const absl::Status same = core::RunVote(
      session_.plane()->collective(),
      core::Ballot{"Rejoin (member state)", session_.args().generation, session_.TakeVoteSequence(),
                   absl::OkStatus(), MemberStateFields()});
  if (!same.ok()) {
    return session_.MarkBroken(
        "Rejoin", absl::Status(same.code(), absl::StrCat(same.message(),
                                                         "; the re-admitted group is unusable: "
                                                         "re-form it with a new generation")));
  }
  // A step needs its geometry again (the returning rank has none).
  geometry_committed_ = geometry_committed_ && !returning;
  const RankMaskState mask = session_.plane()->mask();
  spdlog::warn("Rejoin: rank mask round {} re-admitted ranks [{}]; masked now [{}]", mask.round,
               absl::StrJoin(request.ranks(), ","), RankList(mask.MaskedRanks()));
  response->set_mask_round(mask.round);
  const std::vector<int> masked_now = mask.MaskedRanks();
  response->mutable_masked_ranks()->Assign(masked_now.begin(), masked_now.end());
  response->set_mask_host(mask.host);
  return absl::OkStatus();
}

}  // namespace moe_ep::server
