#pragma once

// The survivors' agreement on a rank mask (DESIGN §15 rank masks, §16; issue
// 17 item 3): after a collective of a group failed, the ranks still alive
// agree on who is left and form a survivors-only Gloo context on a fresh
// store prefix, without a coordinator and without a new generation (the GPU
// planes then rebuild their communicator or peer windows on the survivors).
//
// Round k of generation N (every survivor counts rounds the same way):
//  1. The host is the lowest rank, of those live before the round, whose
//     Rendezvous service answers (GrpcStore::Answers): rank 0 while it
//     lives, else the next. Every worker serves the store and opened
//     generation N on it at Join, so the store does not die with rank 0.
//     A returning rank (MaskRound::joining; the Rejoin RPC) is never the
//     host: it finds the host as the survivors do and is a candidate of
//     step 3 like them, so a round of re-admission is an ordinary round.
//  2. Each survivor sets "gen<N>/mask<k>/alive/<rank>" = its vote count
//     (MaskRound::votes, decimal) on the host.
//  3. The host probes the other ranks live before; it waits (up to the
//     timeout plus min(timeout / 2, 2 s): a rank that answers may still be
//     in the failed collective until its own timeout) for the alive keys
//     of those that answer, then sets
//     "gen<N>/mask<k>/members" = the ranks whose key arrived ("0,1,3"), and
//     before it "gen<N>/mask<k>/votes" = the largest vote count the
//     members' keys carry (MaskRound::votes).
//  4. Every survivor reads the members (waiting up to twice the timeout:
//     the host may enter its round later); one not listed is out
//     (kFailedPrecondition naming the members: the group goes on without it).
//  5. The members form a Gloo context under "gen<N>/mask<k>" on the host's
//     store, member i being the i-th listed rank.
// A killed worker's port refuses at once, so a round takes milliseconds plus
// Gloo's connect; a peer that answers but never arrives costs one timeout
// and the grace.
//
// A round can be stopped (MaskRound::stop; what a data plane that goes away
// mid-round does, server/mask_round_task.h): every store wait of the round
// looks at the flag at least every few hundred ms; the Gloo connect and the
// liveness probes do not and run to their own bounds (the round's timeout,
// 500 ms a probe), so a stop returns within at most one group timeout.
//
// Errors name the round, the host and the ranks. Blocking; thread-safe (no
// shared state but the stop flag). Source: DESIGN §15, §16; issue 17 item 3.

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "core/gloo_collective.h"

namespace moe_ep::server {

struct MaskRound {
  std::vector<std::string> addresses;  // [world]: each rank's Rendezvous (worker) address
  std::string secret;                  // the generation's rendezvous secret ("" = none)
  int64_t generation = 0;
  int round = 1;                  // k >= 1
  int rank = 0;                   // this rank (original numbering)
  std::vector<bool> live_before;  // [world]: live when the round began
  // [world] or empty: masked ranks that come back (the Rejoin RPC): the
  // host counts them among the candidates; one of them may be `rank`.
  std::vector<bool> joining;
  absl::Duration timeout = absl::Seconds(30);
  std::string data_plane_host = "127.0.0.1";
  // The votes this rank took part in on the old group, the one of the call
  // that began the round included (WorkerService's vote count; 0 for a
  // Rejoin). Survivors can see a lost rank one call apart (a collective
  // that completed on one rank failed on another); the host agrees on the
  // largest count, so every member knows which call votes first on the new
  // group (MaskAgreement::votes).
  int64_t votes = 0;
  // Null, or a flag another thread may set: the round then gives up at its
  // next check (kCancelled) instead of waiting out its timeouts.
  std::shared_ptr<const std::atomic<bool>> stop;
};

struct MaskAgreement {
  std::vector<bool> live;                       // [world]: the members
  int host = 0;                                 // the rank whose store hosted the round
  std::unique_ptr<core::GlooCollective> group;  // the members' context
  // The largest MaskRound::votes among the members: a member whose own
  // count is lower skips that many more calls' votes (they are the calls
  // in which a later member saw the loss), so all vote first alike.
  int64_t votes = 0;
};

// MaskKeyPrefix(): "gen<N>/mask<k>".
std::string MaskKeyPrefix(int64_t generation, int round);

// AgreeRankMask()
//
// Runs round `round` for this rank (see the file comment). Errors:
// kInvalidArgument (addresses not one per rank, rank out of range or
// neither live before nor joining), kUnavailable (a joining rank that
// finds no live rank's store), kFailedPrecondition (this rank is not among the members),
// kDeadlineExceeded (no members list within twice the timeout), kCancelled
// (round.stop was set), and Gloo's errors forming the context.
absl::StatusOr<MaskAgreement> AgreeRankMask(const MaskRound& round);

}  // namespace moe_ep::server
