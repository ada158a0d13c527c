#include "server/join_vote.h"

#include <exception>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe_ep::server {
namespace {

absl::Status StoreError(const std::string& what, const std::exception& e) {
  const std::string message = absl::StrCat("Join vote: ", what, ": ", e.what());
  return absl::StrContains(e.what(), "Timed out") ? absl::DeadlineExceededError(message)
                                                  : absl::UnavailableError(message);
}

}  // namespace

std::string JoinVoteKey(int64_t generation, int rank) {
  return absl::StrCat("gen", generation, "/join-vote/", rank);
}

absl::Status RunJoinVote(gloo::rendezvous::Store& store, const core::Ballot& ballot, int rank,
                         int world_size) {
  ASSIGN_OR_RETURN(std::string mine, core::EncodeBallot(ballot));
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
      try {
        const std::vector<char> value = store.get(JoinVoteKey(ballot.generation, r));
        wire.emplace_back(value.begin(), value.end());
      } catch (const std::exception& e) {
        return StoreError(absl::StrCat("rank ", r, "'s ballot never came"), e);
      }
    }
    RETURN_IF_ERROR(core::DecideVote(ballot, rank, wire));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::server
