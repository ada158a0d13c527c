#include "core/engine_call_round.h"

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe_ep::core {
namespace {

constexpr int kTicketWords = 8;
enum Word { kMagic = 0, kCall, kSequence, kCode, kEpoch, kRuntimeMax, kLayer, kValue };

std::string CallName(int64_t call) { return EngineCallName(static_cast<EngineCall>(call)); }

}  // namespace

const char* EngineCallName(EngineCall call) {
  switch (call) {
    case EngineCall::kSyncTokenCounts:
      return "moe_ep_sync_token_counts";
    case EngineCall::kDispatch:
      return "moe_ep_dispatch";
    case EngineCall::kCombine:
      return "moe_ep_combine";
    case EngineCall::kForward:
      return "moe_ep_forward";
    case EngineCall::kDispatchOnly:
      return "moe_ep_dispatch_only";
  }
  return "another call";
}

absl::Status EngineCallRound::Open(ControlCollective& collective, const EngineCallTicket& mine,
                                   const absl::Status& local, std::vector<int64_t>* values) {
  const int size = collective.size();
  const int rank = collective.rank();
  send_.assign(kTicketWords, 0);
  send_[kMagic] = kTicketMagic;
  send_[kCall] = static_cast<int64_t>(mine.call);
  send_[kSequence] = sequence_;
  send_[kCode] = local.ok() ? 0 : static_cast<int64_t>(local.code());
  send_[kEpoch] = mine.epoch;
  send_[kRuntimeMax] = mine.runtime_max_tokens_per_rank;
  send_[kLayer] = mine.layer;
  send_[kValue] = mine.value;
  all_.assign(static_cast<size_t>(size) * kTicketWords, 0);
  absl::Status gathered =
      collective.AllGather(send_.data(), kTicketWords * sizeof(int64_t), all_.data());
  if (!gathered.ok()) return gathered;
  ++sequence_;
  if (!local.ok()) return local;
  const std::string me = EngineCallName(mine.call);
  const std::string tail =
      absl::StrCat("; nothing moved, the group is still usable (this rank is rank ", rank, ")");
  // Every refusing rank with its code (a ticket has no room for the
  // reason: each refusing rank's own error gives it).
  std::vector<std::string> refusals;
  for (int r = 0; r < size; ++r) {
    if (!collective.IsLive(r)) continue;
    const int64_t* t = all_.data() + static_cast<size_t>(r) * kTicketWords;
    if (t[kMagic] != kTicketMagic) {
      return absl::AbortedError(
          absl::StrCat("rank ", r, " is not in an engine data call (", me, " here)", tail));
    }
    if (t[kCall] != send_[kCall] || t[kSequence] != send_[kSequence]) {
      return absl::AbortedError(
          absl::StrCat("rank ", r, " is in ", CallName(t[kCall]), " (engine call ", t[kSequence],
                       "), this rank (", rank, ") in ", me, " (engine call ", send_[kSequence],
                       "): every rank makes the same data calls in the same order", tail));
    }
    if (t[kCode] != 0) {
      refusals.push_back(
          absl::StrCat("rank ", r, " refused its ", me, " (",
                       absl::StatusCodeToString(static_cast<absl::StatusCode>(t[kCode])), ")"));
    }
  }
  if (!refusals.empty()) {
    return absl::AbortedError(absl::StrCat(
        absl::StrJoin(refusals, ", "),
        refusals.size() == 1 ? "; its own error names why" : "; each one's own error names why",
        tail));
  }
  for (int r = 0; r < size; ++r) {
    if (!collective.IsLive(r)) continue;
    const int64_t* t = all_.data() + static_cast<size_t>(r) * kTicketWords;
    if (t[kEpoch] != mine.epoch || t[kRuntimeMax] != mine.runtime_max_tokens_per_rank) {
      return absl::AbortedError(absl::StrCat(
          me, ": geometry mismatch: rank ", r, " has (epoch ", t[kEpoch], ", R ", t[kRuntimeMax],
          "), this rank (", rank, ") has (epoch ", mine.epoch, ", R ",
          mine.runtime_max_tokens_per_rank, "); commit the same geometry on every rank", tail));
    }
    if (t[kLayer] != mine.layer) {
      return absl::AbortedError(absl::StrCat(me, ": rank ", r, " steps layer ", t[kLayer],
                                             ", this rank (", rank, ") layer ", mine.layer, tail));
    }
  }
  if (values != nullptr) {
    values->assign(size, 0);
    for (int r = 0; r < size; ++r) {
      if (collective.IsLive(r)) (*values)[r] = all_[static_cast<size_t>(r) * kTicketWords + kValue];
    }
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::core
