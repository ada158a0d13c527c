#pragma once

// The arrival round of one collective call, the worker's side (issue 29
// items 1-2; the host's side is core/arrival_board.h behind
// Rendezvous.Arrive). A collective RPC that passed its own checks enters
// the round on the group's store host before it votes on the data plane; a
// rank that rejected its own request posts a refusal there and answers at
// once. So a call sent to only some of the ranks moves nothing and breaks
// nothing: the ranks that came take their arrival back at their deadline.
//
// Round names are "gen<N>/arrive/<mask round>/<call number>": ranks number
// their collective calls alike, and a rank counts a call only once its
// round completed (the host decides that under one lock), so a call that
// did not complete leaves every rank's number as it was.
//
// While it waits, a rank probes the members that have not arrived (their
// addresses from the Join, else as the board last saw them): a worker whose
// port refuses, or that answers but is no longer a member of this
// generation (it left, re-joined another group, restarted, or its group is
// broken: GetStatus), is lost, which is the data plane's business
// (kUnavailable: the caller starts a rank-mask round or marks the group
// broken, as for a failed collective); a member that answers did not get
// the call, and the wait ends at the call's deadline with nothing moved.
//
// Blocking (bounded by `deadline` plus one probe); thread-safe (no state).
// Source: DESIGN §8, §16 "failure isolation"; issue 29.

#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "server/grpc_store.h"

namespace moe_ep::server {

struct CallArrival {
  std::string rpc;           // "SyncTokenCounts", for messages
  std::string round;         // ArrivalRoundName()
  int64_t generation = 0;    // the group's
  int rank = 0;              // this rank (original numbering)
  std::vector<int> members;  // the live ranks, this one included
  std::string self_address;  // this worker's address ("" unknown)
  // [world] or empty: each rank's worker address, from the Join.
  std::vector<std::string> addresses;
  int host_rank = 0;                // the rank whose store hosts the round
  absl::Time deadline;              // the call's
  std::function<bool()> cancelled;  // the caller gave up (may be null)
};

// The round name of call `call_number` of `generation` in mask round
// `mask_round` (0 before any mask). The rpc is not part of it: ranks in
// different collective calls at once complete the round and the vote then
// answers ABORTED on every rank (the calls differ), which also frees a rank
// still waiting in a stray call when its peers' next call comes.
std::string ArrivalRoundName(int64_t generation, int mask_round, int64_t call_number);

// ArriveForCall()
//
// Enters `call`'s round on `host` and waits. Returns:
//   OK                  every member arrived: go on with the vote;
//   kAborted            a member refused its own request of this call:
//                       "rank R rejected its <rpc> request: CODE: message;
//                       nothing moved, the group is still usable ...";
//                       also when the caller cancelled (nothing moved);
//   kFailedPrecondition the deadline passed with members missing that
//                       answer their probe: "ranks [1] did not enter <rpc>
//                       within 1.0 s ...; nothing moved, the group is
//                       unchanged"; a missing member that had entered and
//                       withdrew at its own earlier deadline is named apart
//                       ("ranks [2] entered and took their arrival back at
//                       their own, earlier deadline");
//   kDeadlineExceeded   ... and some missing member never answered its probe
//                       (stopped or overloaded);
//   kUnavailable        a missing member's worker refuses connections (it is
//                       lost), or the host does not answer: a group error.
//   another code        the host refused the RPC (e.g. FAILED_PRECONDITION:
//                       the generation is closed there).
// REQUIRES: call.members contains call.rank.
absl::Status ArriveForCall(GrpcStore& host, const CallArrival& call);

// RefuseForCall()
//
// Posts this rank's refusal `local` (its own error, non-OK) of `call` on
// `host`, standing until the call's deadline (at most kMaxRefusalLifetime),
// so that the peers in the same call answer kAborted naming this rank at
// once. Bounded by kRefusalPostTimeout; its own failure is only logged (the
// caller answers with `local` either way).
inline constexpr absl::Duration kMaxRefusalLifetime = absl::Seconds(2);
inline constexpr absl::Duration kRefusalPostTimeout = absl::Milliseconds(500);
void RefuseForCall(GrpcStore& host, const CallArrival& call, const absl::Status& local);

}  // namespace moe_ep::server
