#pragma once

// The arrival board: before a collective call votes on the data plane, every
// member rank enters the call's round on one host (DESIGN §8, §16; issue 29).
// A call sent to only some ranks then ends with nothing moved (the ranks
// that came withdraw at their deadline) instead of a data-plane collective
// that times out and breaks the group; a rank that refuses its own request
// answers at once and its refusal ends the round for its peers.
//
// One lock decides every round, so a round is complete for every member or
// for none: a rank that withdraws after the last member arrived is told the
// round completed and goes on with the call like the others. That is what
// keeps the ranks' call numbers (the round names) equal: a rank counts a
// call only when its round completed.
//
// Rounds are named by the caller ("gen<N>/arrive/<mask round>/<call>");
// members are original rank numbers. A completed round is freed once every
// member has seen it complete, or kCompletedRoundLifetime after it
// completed (a member that died before seeing it); a round nobody is in is
// freed at once (its refusals with it, once they expire).
//
// Thread-safe: all state under one absl::Mutex; Arrive blocks on a CondVar.
// Source: DESIGN §16 "failure isolation"; issue 29 items 1-2.

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace moe_ep::core {

// What a rank learns from the board about its round.
struct ArrivalOutcome {
  bool complete = false;
  // Not complete: the members not arrived yet, ascending, and the last
  // address each gave the board of this generation ("" unknown).
  std::vector<int> missing;
  std::vector<std::string> missing_addresses;
  // -1, or the member whose refusal ended the round, and its text.
  int refused_rank = -1;
  std::string refusal;
};

class ArrivalBoard {
 public:
  static constexpr absl::Duration kCompletedRoundLifetime = absl::Seconds(60);
  // How long a peer that finds a refusal waits for the refusing rank to
  // arrive with a valid call after all, which clears it: a call sent to the
  // refusing rank alone (a stray) and a valid call of every rank right after
  // it have the same round name, and the peers of the valid call may reach
  // the board before the refusing rank does.
  static constexpr absl::Duration kRefusalGrace = absl::Milliseconds(100);

  // `max_rounds`: open rounds held at most (RESOURCE_EXHAUSTED beyond).
  explicit ArrivalBoard(int64_t max_rounds = 4096) : max_rounds_(max_rounds) {}

  // Arrive()
  //
  // Adds `rank` to `round` (idempotent) with `members` (the ranks that must
  // come; the union over the members' calls counts), then waits until the
  // round is complete, another member's refusal stands (then this rank's
  // arrival is taken back; each member is ended by one refusal once, and
  // only after kRefusalGrace), `deadline` passes or `cancelled()` returns true
  // (both leave the arrival in: the caller arrives again or withdraws).
  // `address` non-empty is recorded as the rank's address in the round's
  // generation (the "gen<N>/" prefix), for peers that probe it. A refusal
  // by `rank` itself in this round is cleared (it comes with a valid call
  // now).
  // Errors: kInvalidArgument (members empty or not containing `rank`),
  // kResourceExhausted (max_rounds open rounds).
  // `lapses`: when this arrival stops counting (the call's own deadline;
  // each Arrive of the call may move it).
  absl::StatusOr<ArrivalOutcome> Arrive(const std::string& round, int rank,
                                        absl::Span<const int> members, const std::string& address,
                                        absl::Time deadline,
                                        const std::function<bool()>& cancelled = nullptr,
                                        absl::Time lapses = absl::InfiniteFuture());

  // Withdraw(): takes `rank`'s arrival back unless the round is complete
  // (then complete is answered and the caller goes on). Never blocks.
  ArrivalOutcome Withdraw(const std::string& round, int rank);

  // Refuse(): records `rank`'s refusal of its request in `round` until
  // `expiry`, and wakes the round's waiters. Never blocks.
  // Errors: kResourceExhausted as Arrive.
  absl::Status Refuse(const std::string& round, int rank, const std::string& refusal,
                      absl::Time expiry);

  // Frees the rounds and addresses of every generation < `generation`.
  void DropGenerationsBelow(int64_t generation);

  // Rounds held (for tests and status).
  int64_t NumRounds() const;

 private:
  struct Round {
    absl::flat_hash_set<int> members;
    // rank -> when its arrival lapses (its call's deadline): a lapsed
    // arrival neither counts nor completes a round, so a call whose worker
    // was slow to withdraw cannot be joined to its peers' next call.
    absl::flat_hash_map<int, absl::Time> arrived;
    absl::flat_hash_set<int> seen_complete;
    bool complete = false;
    absl::Time completed_at;
    absl::Time touched;  // last Arrive, Withdraw or Refuse
    struct Refusal {
      std::string text;
      absl::Time expiry;
      absl::flat_hash_set<int> ended;  // members it ended a call of
      // When each member first found it (the grace counts from there, across
      // the member's Arrive calls of one wait).
      absl::flat_hash_map<int, absl::Time> seen;
    };
    absl::flat_hash_map<int, Refusal> refusals;  // by refusing rank
  };

  absl::Status OpenRound(const std::string& name, Round** round) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  ArrivalOutcome Describe(const std::string& name, const Round& round, int rank,
                          absl::Time now) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Frees `name` when nothing holds it any more (see the file comment).
  void MaybeFree(const std::string& name, absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void Prune(absl::Time now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const int64_t max_rounds_;
  mutable absl::Mutex mu_;
  absl::CondVar changed_;
  absl::flat_hash_map<std::string, Round> rounds_ ABSL_GUARDED_BY(mu_);
  // generation -> rank -> address
  absl::flat_hash_map<int64_t, absl::flat_hash_map<int, std::string>> addresses_
      ABSL_GUARDED_BY(mu_);
};

// The generation N of a round name "gen<N>/...", or -1.
int64_t GenerationOfRound(const std::string& round);

}  // namespace moe_ep::core
