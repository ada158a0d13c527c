#include "server/rank_mask.h"

#include <algorithm>
#include <exception>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "server/grpc_store.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

// How long a probe waits for an answer (loopback refuses at once; a remote
// host that is gone may need the whole of it).
constexpr absl::Duration kProbeTimeout = absl::Milliseconds(500);
constexpr absl::Duration kPollInterval = absl::Milliseconds(2);
// How long past the group timeout the host waits for a candidate (above).
constexpr absl::Duration kLateCollectiveGrace = absl::Seconds(2);

std::string ListRanks(const std::vector<bool>& live) {
  std::vector<int> ranks;
  for (size_t r = 0; r < live.size(); ++r) {
    if (live[r]) ranks.push_back(static_cast<int>(r));
  }
  return absl::StrJoin(ranks, ",");
}

bool Stopped(const MaskRound& round) { return round.stop != nullptr && round.stop->load(); }

absl::Status StoppedError(const MaskRound& round) {
  return absl::CancelledError(absl::StrCat("rank mask round ", round.round, ": stopped on rank ",
                                           round.rank, " (its data plane is going away)"));
}

}  // namespace

std::string MaskKeyPrefix(int64_t generation, int round) {
  return absl::StrCat("gen", generation, "/mask", round);
}

absl::StatusOr<MaskAgreement> AgreeRankMask(const MaskRound& round) {
  const int world = static_cast<int>(round.live_before.size());
  if (static_cast<int>(round.addresses.size()) != world || world < 1) {
    return absl::InvalidArgumentError(absl::StrCat("rank mask round ", round.round,
                                                   ": expected one Rendezvous address per rank (",
                                                   world, "), got ", round.addresses.size()));
  }
  if (!round.joining.empty() && static_cast<int>(round.joining.size()) != world) {
    return absl::InvalidArgumentError(absl::StrCat("rank mask round ", round.round,
                                                   ": expected joining for ", world, " ranks, got ",
                                                   round.joining.size()));
  }
  const auto joins = [&](int r) { return !round.joining.empty() && round.joining[r]; };
  if (round.rank < 0 || round.rank >= world ||
      (!round.live_before[round.rank] && !joins(round.rank))) {
    return absl::InvalidArgumentError(
        absl::StrCat("rank mask round ", round.round, ": rank ", round.rank,
                     " was neither live before the round nor joining"));
  }
  const std::string prefix = MaskKeyPrefix(round.generation, round.round);
  const absl::Time start = absl::Now();

  // 1. The host: the lowest previously live rank that answers (a live rank
  // finds itself at the latest; a joining one may find none).
  int host = -1;
  for (int r = 0; r < world && host < 0; ++r) {
    if (Stopped(round)) return StoppedError(round);
    if (!round.live_before[r]) continue;
    if (r == round.rank) {
      host = r;
      break;
    }
    GrpcStore probe(round.addresses[r], kProbeTimeout, round.secret);
    if (probe.Answers(kProbeTimeout)) host = r;
  }
  if (host < 0) {
    return absl::UnavailableError(absl::StrCat(
        "rank mask round ", round.round, ": rank ", round.rank,
        " is rejoining but no live rank's Rendezvous store answers (live before: ranks ",
        ListRanks(round.live_before), ")"));
  }
  // The round's stores look at the stop flag between short waits (server/grpc_store.h).
  auto store =
      std::make_shared<GrpcStore>(round.addresses[host], round.timeout, round.secret, round.stop);

  try {
    // 2. This rank is alive.
    const std::string own_votes = absl::StrCat(round.votes);
    store->set(absl::StrCat(prefix, "/alive/", round.rank),
               std::vector<char>(own_votes.begin(), own_votes.end()));

    // 3. The host decides.
    const std::string members_key = absl::StrCat(prefix, "/members");
    const std::string votes_key = absl::StrCat(prefix, "/votes");
    if (host == round.rank) {
      std::vector<bool> candidate(world, false);
      candidate[round.rank] = true;
      for (int r = 0; r < world; ++r) {
        // Live ranks below the host did not answer; joining ones may be anywhere.
        if (r == round.rank || !((round.live_before[r] && r > round.rank) || joins(r))) continue;
        GrpcStore probe(round.addresses[r], kProbeTimeout, round.secret);
        candidate[r] = probe.Answers(kProbeTimeout);
      }
      std::vector<bool> arrived(world, false);
      arrived[round.rank] = true;
      int64_t most_votes = round.votes;
      // A candidate that answered the probe may still sit in the collective
      // that failed here: it comes once that collective's own deadline (the
      // group timeout, which began before this round did) has passed, so
      // the wait is the timeout plus a grace for its way here; with the
      // timeout alone a rank in the all-gather arrived 20 ms too late.
      const absl::Duration grace = std::min(round.timeout / 2, kLateCollectiveGrace);
      const absl::Time deadline = absl::Now() + round.timeout + grace;
      while (true) {
        if (Stopped(round)) return StoppedError(round);
        bool all = true;
        for (int r = 0; r < world; ++r) {
          if (!candidate[r] || arrived[r]) continue;
          std::string value;
          arrived[r] = store->Poll(absl::StrCat(prefix, "/alive/", r), kProbeTimeout, &value);
          int64_t votes = 0;
          if (arrived[r] && absl::SimpleAtoi(value, &votes))
            most_votes = std::max(most_votes, votes);
          all = all && arrived[r];
        }
        if (all || absl::Now() >= deadline) break;
        absl::SleepFor(kPollInterval);
      }
      const std::string members = ListRanks(arrived);
      const std::string votes = absl::StrCat(most_votes);
      // Before the members: a member that reads the list finds the count.
      store->set(votes_key, std::vector<char>(votes.begin(), votes.end()));
      store->set(members_key, std::vector<char>(members.begin(), members.end()));
    }

    // 4. Everybody reads the members.
    GrpcStore reader(round.addresses[host], 2 * round.timeout, round.secret, round.stop);
    const std::vector<char> value = reader.get(members_key);
    const std::vector<char> votes_value = reader.get(votes_key);
    MaskAgreement out;
    out.host = host;
    if (!absl::SimpleAtoi(absl::string_view(votes_value.data(), votes_value.size()), &out.votes)) {
      return absl::InternalError(absl::StrCat(
          "rank mask round ", round.round, ": host rank ", host, " set vote count \"",
          absl::string_view(votes_value.data(), votes_value.size()), "\", not a number"));
    }
    out.live.assign(world, false);
    for (absl::string_view part :
         absl::StrSplit(absl::string_view(value.data(), value.size()), ',', absl::SkipEmpty())) {
      int r = -1;
      if (!absl::SimpleAtoi(part, &r) || r < 0 || r >= world) {
        return absl::InternalError(absl::StrCat("rank mask round ", round.round, ": host rank ",
                                                host, " listed member \"", part,
                                                "\", not a rank of ", world));
      }
      out.live[r] = true;
    }
    if (!out.live[round.rank]) {
      return absl::FailedPreconditionError(absl::StrCat(
          "rank mask round ", round.round, ": rank ", round.rank,
          " arrived too late; the survivors are ranks ", ListRanks(out.live), " (host rank ", host,
          "); ",
          joins(round.rank) ? "it stays masked: send Rejoin again" : "join a new generation"));
    }
    int index = 0;
    int size = 0;
    for (int r = 0; r < world; ++r) {
      if (r == round.rank) index = size;
      if (out.live[r]) ++size;
    }
    spdlog::warn("rank mask round {} of generation {}: survivors {} (host rank {}), agreed in {}",
                 round.round, round.generation, ListRanks(out.live), host,
                 absl::FormatDuration(absl::Now() - start));

    // 5. The members' context on a fresh prefix.
    if (Stopped(round)) return StoppedError(round);
    absl::StatusOr<std::unique_ptr<core::GlooCollective>> group = core::GlooCollective::Create(
        store, prefix, index, size, round.data_plane_host, round.timeout);
    if (!group.ok()) {
      if (Stopped(round)) return StoppedError(round);
      return absl::Status(
          group.status().code(),
          absl::StrCat("rank mask round ", round.round, " (survivors ", ListRanks(out.live),
                       ", host rank ", host, "): ", group.status().message()));
    }
    out.group = std::move(*group);
    return out;
  } catch (const std::exception& e) {
    if (Stopped(round)) return StoppedError(round);
    // GrpcStore throws on its deadline ("Timed out") and on RPC errors.
    const bool timed_out = absl::StrContains(e.what(), "Timed out");
    const std::string message = absl::StrCat(
        "rank mask round ", round.round, " of generation ", round.generation, " (rank ", round.rank,
        ", host rank ", host, " at ", round.addresses[host], "): ", e.what());
    return timed_out ? absl::DeadlineExceededError(message) : absl::UnavailableError(message);
  }
}

}  // namespace moe_ep::server
