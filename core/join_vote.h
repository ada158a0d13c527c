#pragma once

// Join's cross-rank vote (DESIGN §16 "failure isolation"; issue 12 item 1):
// before a group forms there is no collective to vote on, so the ranks vote
// through the generation's rendezvous store (rank 0's Rendezvous service,
// server/grpc_store.h). Each rank writes its ballot (core/agreement.h: its
// own validation of its Join and the fields every rank must agree on) under
// "gen<G>/join-vote/<rank>", then reads the ballots of ranks 0, 1, ... in
// order and stops at the first that rejected its request or disagrees.
// Reading in order bounds a bad rank's damage even when it disagrees on the
// world size: every rank reads rank 0's ballot first. A rank whose own Join
// is bad writes its ballot and returns its error at once.
//
// A Join too malformed to place a ballot (a rank outside [0, world), a
// generation this worker already used or beyond its limit, a world size over
// the limit) posts a refusal instead, under "gen<G>/join-vote/refused"
// (PostJoinRefusal): while a rank waits for a ballot it also looks for the
// refusal, so the peers fail with kAborted naming the refusing worker (its
// address, the rank it was given) and its error, at once. A Join without a
// rendezvous address (or with generation < 1) cannot reach the store at all:
// its peers learn nothing from it and wait for its ballot until their
// store timeout (the group timeout, bounded by each call's deadline), then
// fail with kDeadlineExceeded naming the rank whose ballot never came. Nor
// can a refusing worker that hosts the store itself and has not opened the
// generation (its Join is the one that would open it): its peers wait too.
//
// Thread-safe as the store; blocks until the verdict, the store's timeout
// or a peer that never votes.

#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/agreement.h"
#include "gloo/rendezvous/store.h"

namespace moe_ep::core {

// The store key of `rank`'s Join ballot in `generation`.
std::string JoinVoteKey(int64_t generation, int rank);
// The store key of a refusal in `generation` (one per generation: the first
// refusing worker's; a later one's set fails and it only answers itself).
std::string JoinRefusalKey(int64_t generation);

// PostJoinRefusal()
//
// Writes the refusal of a Join that cannot place a ballot: `refusal` (the
// worker's own error, kept non-OK) described as "the worker at `self`
// (asked to join as rank R of W) rejected its Join request: CODE: message".
// Returns OK when written; kUnavailable / kDeadlineExceeded when the store
// could not take it (e.g. rank 0 never opened the generation), which the
// caller ignores: it answers with its own error either way.
// REQUIRES: !refusal.ok().
absl::Status PostJoinRefusal(gloo::rendezvous::Store& store, int64_t generation,
                             const absl::Status& refusal, const std::string& self, int rank,
                             int world_size);

// RunJoinVote()
//
// The vote of rank `rank` of `world_size` on `store` (`ballot.rpc` "Join",
// its generation; `ballot.local` this rank's own validation). Returns
// DecideVote's verdict (core/agreement.h): OK when every rank's Join is
// valid and the fields agree; this rank's own error (after writing its
// ballot); kAborted naming the rank that rejected its Join (with its code
// and message) or the field that differs and each rank's value; kAborted
// with a refusal's text when one is posted while this rank waits. Store
// failures: kDeadlineExceeded naming the rank whose ballot never came within
// `timeout`, kUnavailable for another store error; a bad rank whose ballot
// cannot be written returns its own error. A missing ballot and the refusal
// are polled in turn, kJoinVotePoll at a time.
// REQUIRES: 0 <= rank < world_size; timeout > 0.
inline constexpr absl::Duration kJoinVotePoll = absl::Milliseconds(20);
absl::Status RunJoinVote(gloo::rendezvous::Store& store, const Ballot& ballot, int rank,
                         int world_size, absl::Duration timeout);

}  // namespace moe_ep::core
