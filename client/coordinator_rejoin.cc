// Coordinator::RejoinRank and LiveRanks (client/coordinator.h; DESIGN §15;
// issue 17): re-admitting a restarted rank into a masked group. Kept apart
// from the group-wide fan-outs: the returning rank is set up alone first.

#include <algorithm>
#include <chrono>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/coordinator.h"
#include "client/grpc_status.h"
#include "client/unsent_retry.h"
#include "core/status_macros.h"
#include "grpcpp/grpcpp.h"

namespace moe_ep::client {
namespace {

std::chrono::system_clock::time_point DeadlineIn(absl::Duration timeout) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             absl::ToChronoNanoseconds(timeout));
}

// The answering rank of the group whose view of the mask is the latest (the
// highest mask round; a rank that joined alone reports round 0).
const v1::GetStatusResponse* LatestView(
    const std::vector<absl::StatusOr<v1::GetStatusResponse>>& statuses, int64_t generation) {
  const v1::GetStatusResponse* best = nullptr;
  for (const auto& s : statuses) {
    if (!s.ok() || s->generation() != generation || s->group_broken()) continue;
    if (best == nullptr || s->mask_round() > best->mask_round()) best = &*s;
  }
  return best;
}

}  // namespace

absl::StatusOr<std::vector<int>> Coordinator::LiveRanks() {
  const std::vector<absl::StatusOr<v1::GetStatusResponse>> statuses = StatusEach();
  const v1::GetStatusResponse* view = LatestView(statuses, generation_);
  if (view == nullptr) {
    return absl::UnavailableError(absl::StrCat("no rank of generation ", generation_,
                                               " answers GetStatus with a usable group"));
  }
  std::vector<int> live;
  for (int r = 0; r < world_size(); ++r) {
    if (std::find(view->masked_ranks().begin(), view->masked_ranks().end(), r) ==
        view->masked_ranks().end()) {
      live.push_back(r);
    }
  }
  return live;
}

absl::StatusOr<v1::RejoinResponse> Coordinator::RejoinRank(int rank, const RankSetup& setup) {
  return RejoinRanks({rank}, setup);
}

absl::StatusOr<v1::RejoinResponse> Coordinator::RejoinRanks(std::vector<int> ranks,
                                                            const RankSetup& setup) {
  std::sort(ranks.begin(), ranks.end());
  if (ranks.empty() || std::adjacent_find(ranks.begin(), ranks.end()) != ranks.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("RejoinRanks: expected distinct ranks, at least one, got [",
                     absl::StrJoin(ranks, ","), "]"));
  }
  for (int rank : ranks) {
    if (rank < 0 || rank >= world_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("RejoinRank: rank ", rank, " outside [0, ", world_size(), ")"));
    }
  }
  if (generation_ == 0 || !options_.rank_masks) {
    return absl::FailedPreconditionError(
        "RejoinRank: needs a group this coordinator formed with rank_masks");
  }
  v1::GetStatusResponse view;
  ASSIGN_OR_RETURN(std::vector<int> survivors, RejoinSurvivors(ranks, &view));

  // Each returning rank alone: Join, then the group's set-up.
  for (int rank : ranks) RETURN_IF_ERROR(SetUpReturningRank(rank, setup));

  // Rejoin on the survivors and the returning ranks at once.
  v1::RejoinRequest request;
  request.set_generation(generation_);
  request.set_mask_round(view.mask_round());
  *request.mutable_masked_ranks() = view.masked_ranks();
  for (int rank : ranks) request.add_ranks(rank);
  *request.mutable_lease() = Claim();
  std::vector<int> members = survivors;
  members.insert(members.end(), ranks.begin(), ranks.end());
  return RejoinMembers(members, request, ranks.front());
}

absl::StatusOr<std::vector<int>> Coordinator::RejoinSurvivors(const std::vector<int>& ranks,
                                                              v1::GetStatusResponse* latest) {
  // The survivors' mask: every live rank must report the same one.
  const std::vector<absl::StatusOr<v1::GetStatusResponse>> statuses = StatusEach();
  const v1::GetStatusResponse* view = LatestView(statuses, generation_);
  const auto masked = [&](int r) {
    return std::find(view->masked_ranks().begin(), view->masked_ranks().end(), r) !=
           view->masked_ranks().end();
  };
  for (int rank : ranks) {
    if (view == nullptr || !masked(rank)) {
      return absl::FailedPreconditionError(absl::StrCat(
          "RejoinRank: rank ", rank, " is not masked in generation ", generation_,
          view == nullptr
              ? " (no live rank answers)"
              : absl::StrCat(" (masked ranks [", absl::StrJoin(view->masked_ranks(), ","), "])")));
    }
  }
  std::vector<int> survivors;
  for (int r = 0; r < world_size(); ++r) {
    if (masked(r)) continue;
    survivors.push_back(r);
    const auto& s = statuses[r];
    if (!s.ok() || s->mask_round() != view->mask_round() ||
        !std::equal(s->masked_ranks().begin(), s->masked_ranks().end(),
                    view->masked_ranks().begin(), view->masked_ranks().end())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "RejoinRank: live rank ", r, " (", targets_[r], ") does not report mask round ",
          view->mask_round(), " with masked ranks [", absl::StrJoin(view->masked_ranks(), ","),
          "]: ", s.ok() ? absl::StrCat("round ", s->mask_round()) : s.status().ToString(),
          "; try again once the survivors agree"));
    }
  }
  *latest = *view;
  return survivors;
}

absl::Status Coordinator::SetUpReturningRank(int rank, const RankSetup& setup) {
  const bool leased = !options_.owner_id.empty();
  const auto on_rank = [&](const char* op, auto call) -> absl::Status {
    // A call gRPC failed before sending it is sent once more
    // (client/unsent_retry.h).
    absl::Status status = ToAbslStatus(
        CallRetryingUnsent(*channels_[rank], DeadlineIn(options_.rpc_timeout), connect_grace_,
                           [&](grpc::ClientContext* context) { return call(context); }));
    if (status.ok()) return status;
    return absl::Status(status.code(), absl::StrCat(op, " on rank ", rank, " (", targets_[rank],
                                                    "): ", status.message()));
  };
  v1::JoinRequest join;
  join.set_world_size(world_size());
  join.set_rank(rank);
  join.set_backend(options_.backend);
  join.set_rendezvous_address(targets_[0]);
  join.set_generation(generation_);
  join.set_timeout_ms(absl::ToInt64Milliseconds(options_.group_timeout));
  if (rank < static_cast<int>(join_hosts_.size())) join.set_data_plane_host(join_hosts_[rank]);
  join.set_rendezvous_secret(secret_);
  for (const std::string& t : targets_) join.add_rendezvous_addresses(t);
  join.set_rejoin(true);
  *join.mutable_lease() = Claim();
  v1::JoinResponse joined;
  RETURN_IF_ERROR(on_rank("Join (rejoin)", [&](grpc::ClientContext* c) {
    return stubs_[rank]->Join(c, join, &joined);
  }));
  v1::ConfigureLayersRequest configure = setup.configure;
  if (leased) *configure.mutable_lease() = Claim();
  v1::ConfigureLayersResponse configured;
  RETURN_IF_ERROR(on_rank("ConfigureLayers", [&](grpc::ClientContext* c) {
    return stubs_[rank]->ConfigureLayers(c, configure, &configured);
  }));
  v1::AllocateWorkspaceRequest allocate = setup.allocate;
  if (leased) *allocate.mutable_lease() = Claim();
  v1::AllocateWorkspaceResponse allocated;
  RETURN_IF_ERROR(on_rank("AllocateWorkspace", [&](grpc::ClientContext* c) {
    return stubs_[rank]->AllocateWorkspace(c, allocate, &allocated);
  }));
  for (v1::InstallPlacementRequest placement : setup.placements) {
    if (leased) *placement.mutable_lease() = Claim();
    v1::InstallPlacementResponse installed;
    RETURN_IF_ERROR(on_rank("InstallPlacement", [&](grpc::ClientContext* c) {
      return stubs_[rank]->InstallPlacement(c, placement, &installed);
    }));
  }
  for (v1::LoadExpertsRequest load : setup.loads) {
    if (leased) *load.mutable_lease() = Claim();
    v1::LoadExpertsResponse loaded;
    RETURN_IF_ERROR(on_rank("LoadExperts", [&](grpc::ClientContext* c) {
      return stubs_[rank]->LoadExperts(c, load, &loaded);
    }));
  }
  return absl::OkStatus();
}

absl::StatusOr<v1::RejoinResponse> Coordinator::RejoinMembers(const std::vector<int>& members,
                                                              const v1::RejoinRequest& request,
                                                              int rank) {
  std::vector<absl::Status> per_rank(world_size());
  std::vector<v1::RejoinResponse> responses(world_size());
  std::vector<std::thread> threads;
  threads.reserve(members.size());
  for (int r : members) {
    threads.emplace_back([&, r] {
      // Bounded by the round: a few group timeouts. A call gRPC failed
      // before sending it is sent once more (client/unsent_retry.h).
      per_rank[r] = ToAbslStatus(CallRetryingUnsent(
          *channels_[r], DeadlineIn(4 * options_.group_timeout + options_.rpc_timeout),
          connect_grace_, [&](grpc::ClientContext* context) {
            return stubs_[r]->Rejoin(context, request, &responses[r]);
          }));
    });
  }
  for (auto& t : threads) t.join();
  RETURN_IF_ERROR(AggregateRankErrors("Rejoin", targets_, per_rank));
  return responses[rank];
}

}  // namespace moe_ep::client
