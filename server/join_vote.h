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
// Thread-safe as the store; blocks until the verdict, the store's timeout
// or a peer that never votes.

#include <string>

#include "absl/status/status.h"
#include "core/agreement.h"
#include "gloo/rendezvous/store.h"

namespace moe_ep::server {

// The store key of `rank`'s Join ballot in `generation`.
std::string JoinVoteKey(int64_t generation, int rank);

// RunJoinVote()
//
// The vote of rank `rank` of `world_size` on `store` (`ballot.rpc` "Join",
// its generation; `ballot.local` this rank's own validation). Returns
// DecideVote's verdict (core/agreement.h): OK when every rank's Join is
// valid and the fields agree; this rank's own error (after writing its
// ballot); kAborted naming the rank that rejected its Join (with its code
// and message) or the field that differs and each rank's value. Store
// failures: kDeadlineExceeded naming the rank whose ballot never came
// (store timeout), kUnavailable for another store error; a bad rank whose
// ballot cannot be written returns its own error.
// REQUIRES: 0 <= rank < world_size.
absl::Status RunJoinVote(gloo::rendezvous::Store& store, const core::Ballot& ballot, int rank,
                         int world_size);

}  // namespace moe_ep::server
