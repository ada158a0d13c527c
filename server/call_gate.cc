#include "server/call_gate.h"

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"

namespace moe_ep::server {
namespace {

// The payload that marks an agreed stop (absl::Status::SetPayload).
constexpr absl::string_view kAgreedStopPayload = "type.moe-ep/moe_ep.server.AgreedStop";

constexpr int64_t kGo = 0;
constexpr int64_t kLate = 1;
constexpr int64_t kCancelled = 2;

// The deadline first: gRPC reports a call whose deadline passed as
// cancelled too. And a client cancels its call itself once its deadline
// passes, which can reach this server before the server's copy of the
// deadline passes: that copy is the timeout counted from the request's
// arrival, later by the request's transit (milliseconds; more on a loaded
// host, where a 752 ms deadline read as a cancel 3 ms early). A cancel
// that close to the deadline is the deadline.
constexpr absl::Duration kDeadlineSkew = absl::Milliseconds(250);

CallBound::Stop CheckNow(const CallBound& call) {
  const absl::Time now = absl::Now();
  if (now >= call.deadline) return CallBound::Stop::kLate;
  if (call.cancelled && call.cancelled()) {
    return now >= call.deadline - kDeadlineSkew ? CallBound::Stop::kLate
                                                : CallBound::Stop::kCancelled;
  }
  return CallBound::Stop::kNone;
}

}  // namespace

bool CallBound::Expired() const {
  if (seen == Stop::kNone) seen = CheckNow(*this);
  return seen != Stop::kNone;
}

absl::Time CollectiveDeadline(const CallBound& call) {
  return call.deadline == absl::InfiniteFuture() ? call.deadline : call.deadline + kCollectiveGrace;
}

absl::Status CallGate(core::ControlCollective& collective, const CallBound& call,
                      absl::string_view where, absl::string_view hint) {
  // A stop Expired() latched (work skipped on this rank) is this rank's
  // vote whatever the checks say now.
  const CallBound::Stop mine = call.seen != CallBound::Stop::kNone ? call.seen : CheckNow(call);
  const int64_t local = mine == CallBound::Stop::kLate        ? kLate
                        : mine == CallBound::Stop::kCancelled ? kCancelled
                                                              : kGo;
  collective.SetCallDeadline(absl::InfiniteFuture());
  absl::StatusOr<std::vector<int64_t>> votes = core::AllGatherInt64(collective, local);
  collective.SetCallDeadline(CollectiveDeadline(call));
  if (!votes.ok()) return votes.status();
  std::vector<int> late;
  std::vector<int> cancelled;
  for (int r = 0; r < static_cast<int>(votes->size()); ++r) {
    if ((*votes)[r] == kLate) late.push_back(r);
    if ((*votes)[r] == kCancelled) cancelled.push_back(r);
  }
  if (late.empty() && cancelled.empty()) return absl::OkStatus();
  std::vector<std::string> why;
  if (!late.empty()) {
    why.push_back(
        absl::StrCat("the call's deadline passed on rank(s) [", absl::StrJoin(late, ", "), "]"));
  }
  if (!cancelled.empty()) {
    why.push_back(absl::StrCat("the client cancelled the call on rank(s) [",
                               absl::StrJoin(cancelled, ", "), "]"));
  }
  absl::Status stop(
      late.empty() ? absl::StatusCode::kCancelled : absl::StatusCode::kDeadlineExceeded,
      absl::StrCat(where, ": stopped on every rank: ", absl::StrJoin(why, "; "),
                   "; nothing was committed and the group stays usable: ", hint));
  stop.SetPayload(kAgreedStopPayload, absl::Cord("1"));
  return stop;
}

std::string BenchmarkGatePoint(int done, int total) {
  return absl::StrCat("Benchmark: after ", done, " of ", total, " iterations (warmup included)");
}

bool IsAgreedStop(const absl::Status& status) {
  return status.GetPayload(kAgreedStopPayload).has_value();
}

}  // namespace moe_ep::server
