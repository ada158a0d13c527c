#pragma once

// The opening of every command that drives workers (`run`, `stack`, `bench`,
// `up`): a coordinator connected to the attached workers, every worker
// answering, and the group formed.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/coordinator.h"
#include "client/lease_renewer.h"
#include "client/worker_selection.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::client {

struct GroupSession {
  // The lease on --targets workers (null for a local cluster); given back
  // when the session ends.
  std::unique_ptr<LeaseRenewer> lease;
  std::unique_ptr<Coordinator> coordinator;
  std::vector<v1::JoinResponse> joined;  // [world], rank order
};

// CheckNoGroupWithExperts()
//
// The guard of a command that would re-form `targets` (issue 31 item 2):
// kFailedPrecondition, one message naming the ranks, their generation and
// expert bytes and what to do (--take-over, `run --attach`), when some rank
// (status[r] is rank r's GetStatus) is ALLOCATED in a group that is not
// broken, holds experts (expert_bytes > 0) and has no live lease, so that
// a new group would drop the experts of one an earlier client left (`up
// --targets`, `run --targets`). OK when no rank holds experts, when
// `owner_id` holds the lease, or when another owner holds a live lease on
// some rank (the lease then refuses, naming the owner). Pure.
absl::Status CheckNoGroupWithExperts(const std::vector<v1::GetStatusResponse>& status,
                                     const std::vector<std::string>& targets,
                                     const std::string& owner_id);

// FormWorkerGroup()
//
// Connects a Coordinator to `workers.targets` with `options`, whose backend
// and channel credentials are replaced by `workers.backend` and
// `workers.channel_credentials`; waits up to 30 s for every worker to answer
// GetStatus (Coordinator::WaitReady); with workers.lease.owner_id, takes the
// workers' lease (client/lease_renewer.h: refused, changing nothing, when
// another owner holds it and not workers.lease.take_over) and claims it in
// every leased call; forms a new group (Coordinator::FormGroup). Unless
// workers.lease.take_over, it first refuses to re-form a group that holds
// experts and that no client leases (CheckNoGroupWithExperts).
// Returns the coordinator and each rank's JoinResponse.
//
// Errors: those of Coordinator::Connect (kInvalidArgument: no or malformed
// targets), WaitReady (kDeadlineExceeded naming the silent ranks) and
// FormGroup (aggregated per rank); kFailedPrecondition "the workers are
// leased by another client ..." naming the owner and its time left (one
// message for every rank), or CheckNoGroupWithExperts's.
//
// Not thread-safe with other users of the same workers.
absl::StatusOr<GroupSession> FormWorkerGroup(const AttachedWorkers& workers,
                                             CoordinatorOptions options = {});

// AttachFormedGroup()
//
// Connects a Coordinator to `workers.targets` (credentials as above) for the
// group they already form, e.g. `moe-ep coordinator`'s (issue 12 item 6: a
// client drives the steps; step calls are not leased): no Lease, Join or
// other state-changing call. Waits up to 30 s for every worker to answer,
// then checks every GetStatus: ALLOCATED, not group_broken, rank i =
// targets[i], world_size = the number of targets, one generation, and a
// workspace capacity of at least `min_capacity_tokens`. `joined` stays
// empty; the returned coordinator's generation() is 0 (it formed nothing).
// Returns each rank's GetStatus.
//
// Errors: Connect's and WaitReady's; kFailedPrecondition naming the first
// rank (and its target) that is not as required, with what was expected and
// what it reports.
absl::StatusOr<std::vector<v1::GetStatusResponse>> AttachFormedGroup(
    const AttachedWorkers& workers, CoordinatorOptions options, int64_t min_capacity_tokens,
    std::unique_ptr<Coordinator>* coordinator);

}  // namespace moe_ep::client
