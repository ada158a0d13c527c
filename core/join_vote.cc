#include "core/join_vote.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

bool IsTimeout(const std::exception& e) {
  // GrpcStore says "Timed out ..."; Gloo's HashStore "Wait timeout ...".
  return absl::StrContains(e.what(), "Timed out") || absl::StrContains(e.what(), "timeout");
}

absl::Status StoreError(const std::string& what, const std::exception& e) {
  const std::string message = absl::StrCat("Join vote: ", what, ": ", e.what());
  return IsTimeout(e) ? absl::DeadlineExceededError(message) : absl::UnavailableError(message);
}

std::chrono::milliseconds Millis(absl::Duration d) {
  return std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(d)));
}

// Whether `key` is set within `wait`. Throws the store's non-timeout errors.
bool Present(gloo::rendezvous::Store& store, const std::string& key, absl::Duration wait) {
  try {
    store.wait({key}, Millis(wait));
    return true;
  } catch (const std::exception& e) {
    if (IsTimeout(e)) return false;
    throw;
  }
}

// Rank `r`'s ballot, watching for a refusal while it is missing.
absl::StatusOr<std::string> ReadBallot(gloo::rendezvous::Store& store, int64_t generation, int r,
                                       absl::Time deadline, absl::Duration timeout) {
  const std::string key = JoinVoteKey(generation, r);
  const std::string refused = JoinRefusalKey(generation);
  try {
    while (true) {
      const absl::Duration left = deadline - absl::Now();
      if (Present(store, key, std::min(left, kJoinVotePoll))) {
        const std::vector<char> value = store.get(key);
        return std::string(value.begin(), value.end());
      }
      if (Present(store, refused, absl::Milliseconds(1))) {
        const std::vector<char> value = store.get(refused);
        return absl::AbortedError(std::string(value.begin(), value.end()));
      }
      if (absl::Now() >= deadline) {
        return absl::DeadlineExceededError(
            absl::StrCat("Join vote: rank ", r, "'s ballot never came within ",
                         absl::FormatDuration(timeout), " (store key \"", key, "\")"));
      }
    }
  } catch (const std::exception& e) {
    return StoreError(absl::StrCat("rank ", r, "'s ballot never came"), e);
  }
}

}  // namespace

std::string JoinVoteKey(int64_t generation, int rank) {
  return absl::StrCat("gen", generation, "/join-vote/", rank);
}

std::string JoinRefusalKey(int64_t generation) {
  return absl::StrCat("gen", generation, "/join-vote/refused");
}

absl::Status PostJoinRefusal(gloo::rendezvous::Store& store, int64_t generation,
                             const absl::Status& refusal, const std::string& self, int rank,
                             int world_size) {
  std::string text = absl::StrCat(
      "Join: the worker at ", self.empty() ? "?" : self, " (asked to join as rank ", rank, " of ",
      world_size, ") rejected its Join request: ", absl::StatusCodeToString(refusal.code()), ": ",
      refusal.message());
  if (text.size() > core::kBallotMessageBytes * 2) text.resize(core::kBallotMessageBytes * 2);
  try {
    store.set(JoinRefusalKey(generation), std::vector<char>(text.begin(), text.end()));
  } catch (const std::exception& e) {
    return StoreError("posting a refusal", e);
  }
  return absl::OkStatus();
}

absl::Status RunJoinVote(gloo::rendezvous::Store& store, const Ballot& ballot, int rank,
                         int world_size, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  ASSIGN_OR_RETURN(std::string mine, EncodeBallot(ballot));
  try {
    store.set(JoinVoteKey(ballot.generation, rank), std::vector<char>(mine.begin(), mine.end()));
  } catch (const std::exception& e) {
    if (!ballot.local.ok()) return ballot.local;
    return StoreError(absl::StrCat("writing rank ", rank, "'s ballot"), e);
  }
  if (!ballot.local.ok()) return ballot.local;
  std::vector<std::string> wire;
  wire.reserve(world_size);
  for (int r = 0; r < world_size; ++r) {
    if (r == rank) {
      wire.push_back(mine);
    } else {
      ASSIGN_OR_RETURN(std::string value,
                       ReadBallot(store, ballot.generation, r, deadline, timeout));
      wire.push_back(std::move(value));
    }
    RETURN_IF_ERROR(DecideVote(ballot, rank, wire));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::core
