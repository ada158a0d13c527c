#pragma once

// Cross-rank agreement (DESIGN §8, §16 "failure isolation"; issue 10 item 4):
// the tree's one fingerprint function, and the vote every collective RPC runs
// before its payload moves.
//
// The vote is one small all-gather of a fixed-size ballot per rank:
//   (rpc, generation, sequence number, this rank's local validation status
//    (code + message), its spec field by field (name, int64 value))
// so that after it every rank knows at once
//   - which ranks rejected their own request, with their code and message;
//   - which spec field differs, and each rank's value of it;
//   - whether the ranks are in the same call at all (rpc, generation,
//     sequence).
// The group stays usable after a failed vote: nothing but the ballot moved.
// Issues 12 and 13 build on this format; changing it is a wire change
// between workers of one group (kBallotVersion).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/collective.h"
#include "core/fingerprint.h"

namespace moe_ep::core {

// One spec field of a ballot. `value` is the field itself for integers, or
// Fingerprint64 of its text (then `is_fingerprint`, shown in hex).
struct BallotField {
  std::string name;
  int64_t value = 0;
  bool is_fingerprint = false;
};

struct Ballot {
  std::string rpc;         // "AllocateWorkspace"
  int64_t generation = 0;  // the joined group's generation
  int64_t sequence = 0;    // this rank's count of votes in the group
  absl::Status local;      // this rank's own validation of its request
  std::vector<BallotField> fields;
};

inline constexpr int kBallotVersion = 1;
inline constexpr int kBallotMaxFields = 24;
inline constexpr int kBallotMessageBytes = 240;

// Runs the vote on `group` (a collective: every rank calls it with its own
// ballot, in the same order of collective calls). Returns:
//   - OK when every rank's local status is OK and every field agrees;
//   - this rank's own `local` error, unchanged, when it rejected its request
//     (after taking part, so its peers learn of it at once);
//   - kAborted on the other ranks, naming each rank that rejected its request
//     with its code and message ("rank 1 rejected its AllocateWorkspace
//     request: INVALID_ARGUMENT: top_k: ...");
//   - kAborted naming the first differing field and every rank's value
//     ("AllocateWorkspace: top_k differs across ranks: rank 0 = 8, rank 1 =
//     4; every rank must get the same request");
//   - kAborted when the ranks are not in the same call (rpc, generation or
//     sequence differ), naming each rank's;
//   - the all-gather's own error (kDeadlineExceeded, kUnavailable: the group
//     is broken).
// kInvalidArgument when the ballot has more than kBallotMaxFields fields.
// Ranks the group reports not live (ControlCollective::IsLive: masked after
// they were lost) do not vote.
absl::Status RunVote(ControlCollective& group, const Ballot& ballot);

// The two halves of RunVote, for a vote gathered by other means (Join's,
// through the rendezvous store: core/join_vote.h).
//
// EncodeBallot(): the fixed-size wire form of `ballot` (what RunVote
// all-gathers). kInvalidArgument beyond kBallotMaxFields fields.
absl::StatusOr<std::string> EncodeBallot(const Ballot& ballot);
// DecideVote(): RunVote's verdict for this rank (`me`, whose `ballot` it is)
// over `wire`, the encoded ballots of ranks 0..wire.size()-1 (this rank's
// own included when me < wire.size()). A prefix of the ranks is allowed: OK
// then means "none of these ranks disagrees or rejected" (a differing field
// then lists this rank's own value after theirs). Returns RunVote's
// codes, and kAborted for a ballot that is not one (wrong size), naming its
// rank.
absl::Status DecideVote(const Ballot& ballot, int me, const std::vector<std::string>& wire);

}  // namespace moe_ep::core
