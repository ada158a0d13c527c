#include "client/group_session.h"

#include <algorithm>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "client/targets.h"
#include "client/text_table.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::Status CheckNoGroupWithExperts(const std::vector<v1::GetStatusResponse>& status,
                                     const std::vector<std::string>& targets,
                                     const std::string& owner_id) {
  std::vector<int> holding;
  int64_t expert_bytes = 0;
  int64_t generation = 0;
  for (size_t r = 0; r < status.size(); ++r) {
    const v1::GetStatusResponse& s = status[r];
    const std::string& owner = s.lease_owner();
    // Another owner's live lease: the lease refuses, naming it.
    if (!owner.empty() && owner != owner_id) return absl::OkStatus();
    if (s.state() == v1::WORKER_STATE_ALLOCATED && !s.group_broken() && s.expert_bytes() > 0 &&
        owner.empty()) {
      holding.push_back(static_cast<int>(r));
      expert_bytes += s.expert_bytes();
      generation = std::max(generation, s.generation());
    }
  }
  if (holding.empty()) return absl::OkStatus();
  const int n = static_cast<int>(status.size());
  return absl::FailedPreconditionError(absl::StrCat(
      "the workers hold a formed group with experts loaded and no live lease: ",
      holding.size() > 1 ? "ranks " : "rank ", FormatRankList(holding), " of ", n, " (",
      targets[holding.front()], holding.size() > 1 ? ", ..." : "", ") in generation ", generation,
      holding.size() > 1 ? " hold " : " holds ", FormatBytes(static_cast<double>(expert_bytes)),
      " of experts; no client holds their lease (the one that formed it has exited or gave it "
      "back). Nothing was changed: forming a new group would drop them. Pass --take-over to "
      "re-form it anyway, or drive steps on it as it is with `moe-ep run --attach`"));
}

absl::StatusOr<GroupSession> FormWorkerGroup(const AttachedWorkers& workers,
                                             CoordinatorOptions options) {
  options.backend = workers.backend;
  options.channel_credentials = workers.channel_credentials;
  if (!workers.lease.owner_id.empty()) {
    options.owner_id = workers.lease.owner_id;
    options.lease_ttl = absl::Milliseconds(workers.lease.ttl_ms);
  }
  GroupSession session;
  ASSIGN_OR_RETURN(session.coordinator, Coordinator::Connect(workers.targets, options));
  RETURN_IF_ERROR(session.coordinator->WaitReady(absl::Seconds(30)));
  if (!workers.lease.take_over) {
    ASSIGN_OR_RETURN(std::vector<v1::GetStatusResponse> status, session.coordinator->Status());
    RETURN_IF_ERROR(CheckNoGroupWithExperts(status, workers.targets, options.owner_id));
  }
  if (!options.owner_id.empty()) {
    absl::StatusOr<std::unique_ptr<LeaseRenewer>> lease =
        LeaseRenewer::Start(workers.targets, options, workers.lease.take_over);
    if (absl::IsFailedPrecondition(lease.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          "the workers are leased by another client; nothing was changed (wait for its lease to "
          "expire, or pass --take-over to take it over: the group is then re-formed and its "
          "experts dropped): ",
          lease.status().message()));
    }
    RETURN_IF_ERROR(lease.status());
    session.lease = *std::move(lease);
  }
  ASSIGN_OR_RETURN(session.joined, session.coordinator->FormGroup());
  return session;
}

absl::StatusOr<std::vector<v1::GetStatusResponse>> AttachFormedGroup(
    const AttachedWorkers& workers, CoordinatorOptions options, int64_t min_capacity_tokens,
    std::unique_ptr<Coordinator>* coordinator) {
  options.backend = workers.backend;
  options.channel_credentials = workers.channel_credentials;
  ASSIGN_OR_RETURN(*coordinator, Coordinator::Connect(workers.targets, options));
  RETURN_IF_ERROR((*coordinator)->WaitReady(absl::Seconds(30)));
  ASSIGN_OR_RETURN(std::vector<v1::GetStatusResponse> status, (*coordinator)->Status());
  const int world = static_cast<int>(status.size());
  for (int r = 0; r < world; ++r) {
    const v1::GetStatusResponse& s = status[r];
    const std::string who = absl::StrCat("--attach: rank ", r, " (", workers.targets[r], ") ");
    if (s.state() != v1::WORKER_STATE_ALLOCATED || s.group_broken()) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, "is ", v1::WorkerState_Name(s.state()),
          s.group_broken() ? absl::StrCat(" in a broken group (", s.broken_reason(), ")") : "",
          "; expected ALLOCATED in a formed group (wait until the coordinator reports READY)"));
    }
    if (s.rank() != r || s.world_size() != world || s.generation() != status[0].generation()) {
      return absl::FailedPreconditionError(
          absl::StrCat(who, "is rank ", s.rank(), " of ", s.world_size(), " in generation ",
                       s.generation(), "; expected rank ", r, " of ", world, " in generation ",
                       status[0].generation(), " (rank 0's): list --targets in rank order"));
    }
    if (s.capacity_tokens() < min_capacity_tokens) {
      return absl::FailedPreconditionError(absl::StrCat(
          who, "has a workspace of ", s.capacity_tokens(), " tokens per rank; the run needs ",
          min_capacity_tokens, " (lower --tokens, or use --even-tokens)"));
    }
  }
  return status;
}

}  // namespace moe_ep::client
