#include "core/arrival_board.h"

#include <algorithm>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/time/clock.h"

namespace moe_ep::core {
namespace {

// Longest sleep between looks at `cancelled`.
constexpr absl::Duration kCancelPoll = absl::Milliseconds(50);

}  // namespace

int64_t GenerationOfRound(const std::string& round) {
  absl::string_view rest(round);
  if (!absl::ConsumePrefix(&rest, "gen")) return -1;
  const size_t slash = rest.find('/');
  if (slash == absl::string_view::npos) return -1;
  int64_t generation = 0;
  if (!absl::SimpleAtoi(rest.substr(0, slash), &generation) || generation < 0) return -1;
  return generation;
}

absl::Status ArrivalBoard::OpenRound(const std::string& name, Round** round) {
  auto it = rounds_.find(name);
  if (it == rounds_.end()) {
    if (static_cast<int64_t>(rounds_.size()) >= max_rounds_) Prune(absl::Now());
    if (static_cast<int64_t>(rounds_.size()) >= max_rounds_) {
      return absl::ResourceExhaustedError(absl::StrCat("the arrival board holds ", rounds_.size(),
                                                       " open rounds, its limit; round \"",
                                                       name.substr(0, 64), "\" not opened"));
    }
    it = rounds_.emplace(name, Round{}).first;
  }
  it->second.touched = absl::Now();
  *round = &it->second;
  return absl::OkStatus();
}

ArrivalOutcome ArrivalBoard::Describe(const std::string& name, const Round& round, int rank,
                                      absl::Time now) const {
  ArrivalOutcome out;
  out.complete = round.complete;
  if (round.complete) return out;
  for (int member : round.members) {
    auto it = round.arrived.find(member);
    if (member != rank && (it == round.arrived.end() || it->second <= now)) {
      out.missing.push_back(member);
    }
  }
  std::sort(out.missing.begin(), out.missing.end());
  const auto generation = addresses_.find(GenerationOfRound(name));
  for (int member : out.missing) {
    std::string address;
    if (generation != addresses_.end()) {
      auto it = generation->second.find(member);
      if (it != generation->second.end()) address = it->second;
    }
    out.missing_addresses.push_back(std::move(address));
  }
  return out;
}

void ArrivalBoard::MaybeFree(const std::string& name, absl::Time now) {
  auto it = rounds_.find(name);
  if (it == rounds_.end()) return;
  const Round& round = it->second;
  if (round.complete) {
    for (int member : round.members) {
      if (!round.seen_complete.contains(member)) return;
    }
    rounds_.erase(it);
    return;
  }
  for (const auto& [rank, lapses] : round.arrived) {
    if (lapses > now) return;
  }
  for (const auto& [rank, refusal] : round.refusals) {
    if (refusal.expiry > now) return;
  }
  rounds_.erase(it);
}

void ArrivalBoard::Prune(absl::Time now) {
  for (auto it = rounds_.begin(); it != rounds_.end();) {
    const Round& round = it->second;
    bool refusal_stands = false;
    for (const auto& [rank, refusal] : round.refusals) refusal_stands |= refusal.expiry > now;
    // A round left by a rank that died inside it (complete and never seen,
    // or never completed) goes after kCompletedRoundLifetime untouched.
    const bool stale = now - round.touched > kCompletedRoundLifetime;
    bool arrival_stands = false;
    for (const auto& [rank, lapses] : round.arrived) arrival_stands |= lapses > now;
    const bool empty = !round.complete && !arrival_stands && !refusal_stands;
    if (stale || empty) {
      rounds_.erase(it++);
    } else {
      ++it;
    }
  }
}

absl::StatusOr<ArrivalOutcome> ArrivalBoard::Arrive(const std::string& round_name, int rank,
                                                    absl::Span<const int> members,
                                                    const std::string& address, absl::Time deadline,
                                                    const std::function<bool()>& cancelled,
                                                    absl::Time lapses) {
  if (std::find(members.begin(), members.end(), rank) == members.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("members: expected to contain the arriving rank ", rank, " (", members.size(),
                     " members)"));
  }
  absl::MutexLock lock(&mu_);
  Round* round = nullptr;
  if (absl::Status opened = OpenRound(round_name, &round); !opened.ok()) return opened;
  round->members.insert(members.begin(), members.end());
  if (!address.empty()) addresses_[GenerationOfRound(round_name)][rank] = address;
  round->refusals.erase(rank);  // it comes with a valid call now
  if (!round->complete) {
    const absl::Time now = absl::Now();
    round->arrived[rank] = lapses;
    if (std::all_of(round->members.begin(), round->members.end(), [&](int m) {
          auto it = round->arrived.find(m);
          return it != round->arrived.end() && it->second > now;
        })) {
      round->complete = true;
      round->completed_at = now;
      changed_.SignalAll();
    }
  }
  while (true) {
    // The map may have rehashed while this thread slept: look the round up again.
    auto it = rounds_.find(round_name);
    if (it == rounds_.end()) return ArrivalOutcome{};  // dropped with its generation
    round = &it->second;
    const absl::Time now = absl::Now();
    if (round->complete) {
      round->seen_complete.insert(rank);
      ArrivalOutcome out;
      out.complete = true;
      MaybeFree(round_name, now);
      return out;
    }
    // The first standing refusal of another member that has not ended a
    // call of this rank yet.
    Round::Refusal* standing = nullptr;
    int refuser = -1;
    for (auto& [by, refusal] : round->refusals) {
      if (by != rank && refusal.expiry > now && !refusal.ended.contains(rank) &&
          (refuser < 0 || by < refuser)) {
        standing = &refusal;
        refuser = by;
      }
    }
    const absl::Time refusal_seen = standing != nullptr
                                        ? standing->seen.try_emplace(rank, now).first->second
                                        : absl::InfiniteFuture();
    if (standing != nullptr && now >= refusal_seen + kRefusalGrace) {
      round->arrived.erase(rank);
      standing->ended.insert(rank);
      ArrivalOutcome out = Describe(round_name, *round, rank, now);
      out.refused_rank = refuser;
      out.refusal = standing->text;
      MaybeFree(round_name, now);
      return out;
    }
    if (now >= deadline || (cancelled && cancelled())) {
      return Describe(round_name, *round, rank, now);
    }
    absl::Time wake = std::min(deadline, now + kCancelPoll);
    if (standing != nullptr) wake = std::min(wake, refusal_seen + kRefusalGrace);
    changed_.WaitWithDeadline(&mu_, wake);
  }
}

ArrivalOutcome ArrivalBoard::Withdraw(const std::string& round_name, int rank) {
  absl::MutexLock lock(&mu_);
  auto it = rounds_.find(round_name);
  if (it == rounds_.end()) return ArrivalOutcome{};
  Round& round = it->second;
  const absl::Time now = absl::Now();
  if (round.complete) {
    round.seen_complete.insert(rank);
    MaybeFree(round_name, now);
    ArrivalOutcome out;
    out.complete = true;
    return out;
  }
  round.arrived.erase(rank);
  ArrivalOutcome out = Describe(round_name, round, rank, now);
  MaybeFree(round_name, now);
  return out;
}

absl::Status ArrivalBoard::Refuse(const std::string& round_name, int rank,
                                  const std::string& refusal, absl::Time expiry) {
  absl::MutexLock lock(&mu_);
  Round* round = nullptr;
  if (absl::Status opened = OpenRound(round_name, &round); !opened.ok()) return opened;
  if (!round->complete) round->arrived.erase(rank);  // a refusing rank is not in the call
  round->refusals[rank] = Round::Refusal{refusal, expiry, {}, {}};
  changed_.SignalAll();
  return absl::OkStatus();
}

void ArrivalBoard::DropGenerationsBelow(int64_t generation) {
  absl::MutexLock lock(&mu_);
  for (auto it = rounds_.begin(); it != rounds_.end();) {
    const int64_t g = GenerationOfRound(it->first);
    if (g >= 0 && g < generation) {
      rounds_.erase(it++);
    } else {
      ++it;
    }
  }
  for (auto it = addresses_.begin(); it != addresses_.end();) {
    if (it->first < generation) {
      addresses_.erase(it++);
    } else {
      ++it;
    }
  }
  changed_.SignalAll();
}

int64_t ArrivalBoard::NumRounds() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int64_t>(rounds_.size());
}

}  // namespace moe_ep::core
