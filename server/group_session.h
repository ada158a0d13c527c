#pragma once

// The group a worker is a member of, as a session (DESIGN §1 "the group
// session ... its own class beside the service"; DESIGN §8, §15, §16; issues
// 17, 29 and 34 item 3): the formed data plane and the Join arguments it was
// formed with, the numbering of the group's votes, each call's bound, the
// arrival round before every vote (server/call_arrival.h), and the rank
// mask protocol (a group error starts a round; the survivors' group is
// adopted when it ends). server/worker_service.h owns the reported state
// (phase, GetStatus); the session tells it what changed through Observer.
//
// Vote numbering under a mask (DESIGN §15): survivors can see a loss one
// call apart (a collective that completed on one rank failed on a peer), so
// each enters the mask round with its count, the round agrees on the
// largest (DataPlane::agreed_votes), and a call numbered below it returns
// without a vote: the first vote on the survivors' group is the same call
// on every member.
//
// Not thread-safe: every call but the constructor needs the worker's
// collective slot (server/collective_slot.h).

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/agreement.h"
#include "grpcpp/server_context.h"
#include "server/call_gate.h"
#include "server/data_plane.h"
#include "server/grpc_store.h"
#include "server/layer_stack_runner.h"
#include "server/request_options.h"

namespace moe_ep::server {

class GroupSession {
 public:
  // What the session reports to the worker's state (server/worker_service.h).
  // Called with the slot held, never under the session's own lock (it has
  // none), so an implementation may take its state mutex.
  class Observer {
   public:
    virtual ~Observer() = default;
    // The group is broken; `reason` is "<rpc>: <CODE>: <message>"
    // (GetStatus.broken_reason).
    virtual void OnGroupBroken(const std::string& reason) = 0;
    // A rank mask round ended: GetStatus shows `mask` from now on.
    virtual void OnMaskAdopted(const RankMaskState& mask) = 0;
    // The address this worker listens on (arrival rounds name it).
    virtual std::string SelfAddress() = 0;
  };

  // `observer` must outlive the session.
  explicit GroupSession(Observer* observer);
  ~GroupSession();
  GroupSession(const GroupSession&) = delete;
  GroupSession& operator=(const GroupSession&) = delete;

  // Install()
  //
  // Replaces the group in force (TearDown) by `formed`, joined with `args`;
  // votes are numbered from 0.
  void Install(const JoinArgs& args, std::unique_ptr<DataPlane> formed);
  // Drops the group: ForwardLayers' stack first (its sub-groups point into
  // the plane), then the plane; counters and the arrival host go with it.
  void TearDown();

  // Whether a group is installed.
  bool formed() const { return plane_ != nullptr; }
  // The group's data plane; null when !formed().
  DataPlane* plane() const { return plane_.get(); }
  // The Join arguments of the group in force (the last group's after
  // TearDown, default ones before any Install).
  const JoinArgs& args() const { return args_; }
  // ForwardLayers' stack (server/layer_stack_runner.h), built on the
  // plane's collective.
  LayerStackRunner& layer_stack() { return layer_stack_; }
  // The bound of the call holding the slot (BeginCall).
  const CallBound& call() const { return call_; }

  // BeginCall()
  //
  // A call of `rpc` enters the formed group: its collective waits end by the
  // call's deadline (plus server/call_gate.h's grace) and watch its
  // cancellation (`context` may be null: no deadline), and a mask round a
  // failed earlier call left running is applied first (up to 4 group
  // timeouts; then the group is broken), so the call's checks and its
  // collective are the survivors'. Errors: those of the mask round
  // (MarkBroken's). Needs formed().
  absl::Status BeginCall(const grpc::ServerContext* context, const char* rpc);

  // Vote()
  //
  // The cross-rank vote (core/agreement.h) of a collective `rpc`, before its
  // payload moves: first the arrival round (every live rank entered this
  // call, issue 29; a `local` error is posted as this rank's refusal and
  // returned at once, counting nothing), then the ballot (rpc, generation,
  // sequence, `local`, `fields`). A rank lost before the payload moved
  // starts a mask round where the group can mask, else breaks it
  // (GroupResult). Errors: `local`; kFailedPrecondition naming the ranks
  // that did not enter; kAborted naming the rank or field that differs; the
  // group errors of GroupResult.
  absl::Status Vote(const char* rpc, absl::Status local, std::vector<core::BallotField> fields);

  // GroupResult()
  //
  // `status` of a collective operation of `rpc`: returned as is unless it is
  // a group error (server/data_plane.h IsGroupError); then, where the group
  // can mask (DataPlane::CanMask), a mask round starts (finished here when
  // every survivor is in it, else by the next BeginCall) and the message
  // says so; otherwise the group is broken (MarkBroken).
  absl::Status GroupResult(const char* rpc, absl::Status status);
  // Marks the group broken with "<rpc>: <CODE>: <message>" (Observer);
  // returns `status`.
  absl::Status MarkBroken(const char* rpc, absl::Status status);

  // kFailedPrecondition naming `call`, the masked ranks and the round while
  // a rank is masked (ForwardLayers, Benchmark and the engine calls route by
  // the unmasked placement, issue 17); OK otherwise or when !formed().
  absl::Status RequireNoMask(const char* call) const;

  // AdoptMask()
  //
  // The plane serves a new mask (a round ended): the call's bound is set on
  // it again, ForwardLayers' sub-groups are made again and the Observer
  // shows the mask. `renumber` (a re-admission, whose returning rank counted
  // no votes): every member numbers its votes from the round on. Otherwise
  // (a survivors' round) the count goes on and the first vote on the new
  // group is the call numbered DataPlane::agreed_votes().
  void AdoptMask(const char* rpc, bool renumber);

  // The sequence number of the next vote, counted (Rejoin's member-state
  // ballot, which is not a Vote).
  int64_t TakeVoteSequence() { return vote_sequence_++; }

 private:
  // How long a call that finds a round pending waits before it counts the
  // round as not ended yet (one that ended during its peers' last call).
  static constexpr absl::Duration kMaskSettled = absl::Milliseconds(100);

  // The arrival round of the call Vote is about to vote on
  // (server/call_arrival.h): OK at once in a group of one live rank.
  absl::Status ArriveForVote(const char* rpc, const absl::Status& local);
  // Waits up to `wait` for the mask round (DataPlane::FinishMaskRound):
  // true once adopted, false while it runs; a failed round breaks the group.
  absl::StatusOr<bool> FinishMask(const char* rpc, absl::Duration wait);
  // Starts a mask round after `rpc` failed with the group error `status`,
  // waiting MaskGrace() for it.
  absl::StatusOr<bool> StartMask(const char* rpc, const absl::Status& status);
  // How long a failed call waits for the round before it returns: half the
  // group's timeout, at most 1 s.
  absl::Duration MaskGrace() const;
  // The error of a call in which the mask round ended (nothing ran):
  // kUnavailable naming the masked ranks when the round masked a rank, and
  // kAborted when it found every rank alive (the mask is the one in force
  // before it; issue 29 item 4): not a group error, so the call counts no
  // failed collective and the next call serves as before.
  absl::Status MaskAgreedError(const char* rpc) const;

  Observer* const observer_;
  std::unique_ptr<DataPlane> plane_;
  JoinArgs args_;
  int64_t vote_sequence_ = 0;    // calls voted (or skipped by a mask) in the group
  int64_t first_mask_vote_ = 0;  // the first call that votes on the survivors' group
  bool mask_pending_ = false;    // a collective failed: mask at the next call
  // The ranks masked when the last round started: a round that ends with the
  // same ones found every rank alive.
  std::vector<int> masked_before_round_;
  // When the calls' arrival rounds began to find ranks that do not answer
  // (InfiniteFuture while they do): past the group timeout they are lost.
  absl::Time silent_since_ = absl::InfiniteFuture();
  // The store that hosts the calls' arrival rounds: rank 0's, or the last
  // mask round's host; made again when that changes.
  std::unique_ptr<GrpcStore> arrival_host_;
  CallBound call_;
  // Built on the plane's collective: declared after plane_, reset before it.
  LayerStackRunner layer_stack_;
};

}  // namespace moe_ep::server
