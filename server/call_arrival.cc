#include "server/call_arrival.h"

#include <algorithm>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

// One Arrive RPC waits at most this long on the host, so the missing
// members are probed between waits.
constexpr absl::Duration kArriveSlice = absl::Milliseconds(100);
constexpr absl::Duration kProbeTimeout = absl::Milliseconds(200);
constexpr absl::Duration kProbeInterval = absl::Milliseconds(250);

std::string Seconds(absl::Duration d) {
  return absl::StrFormat("%.1f s", absl::ToDoubleSeconds(d));
}

v1::ArriveRequest BaseRequest(const CallArrival& call) {
  v1::ArriveRequest request;
  request.set_round(call.round);
  request.set_rank(call.rank);
  request.mutable_members()->Assign(call.members.begin(), call.members.end());
  request.set_address(call.self_address);
  return request;
}

absl::Status HostError(const CallArrival& call, const GrpcStore& host, const grpc::Status& status) {
  const std::string what = absl::StrCat(call.rpc, ": the arrival round on the store of rank ",
                                        call.host_rank, " (", host.address(), ") failed: gRPC ",
                                        status.error_code(), ": ", status.error_message());
  // A host that takes the connection and says nothing is stopped or
  // overloaded, as a silent probe (server/grpc_store.h): not lost yet.
  if (status.error_code() == grpc::StatusCode::DEADLINE_EXCEEDED || IsUnansweredHandshake(status)) {
    return absl::DeadlineExceededError(absl::StrCat(
        what, " (the host rank does not answer: stopped or overloaded); nothing moved"));
  }
  if (status.error_code() == grpc::StatusCode::UNAVAILABLE) {
    return absl::UnavailableError(absl::StrCat(what, " (the host rank is lost)"));
  }
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), what);
}

// Takes this rank's arrival back; true in *complete when the round completed
// meanwhile (then the call goes on).
absl::Status Withdraw(GrpcStore& host, const CallArrival& call, bool* complete) {
  v1::ArriveRequest request = BaseRequest(call);
  request.set_action(v1::ArriveRequest::ACTION_WITHDRAW);
  v1::ArriveResponse response;
  const grpc::Status status = host.Arrive(request, &response);
  if (!status.ok()) return HostError(call, host, status);
  *complete = response.complete();
  return absl::OkStatus();
}

}  // namespace

std::string ArrivalRoundName(int64_t generation, int mask_round, int64_t call_number) {
  return absl::StrCat("gen", generation, "/arrive/", mask_round, "/", call_number);
}

absl::Status ArriveForCall(GrpcStore& host, const CallArrival& call) {
  const absl::Time start = absl::Now();
  v1::ArriveRequest request = BaseRequest(call);
  request.set_action(v1::ArriveRequest::ACTION_ARRIVE);
  absl::flat_hash_map<int, absl::Time> probed;
  absl::flat_hash_set<int> silent;
  // Members that answered a probe during this call: alive, even if a later
  // probe times out on a loaded machine (a stopped process never answers).
  absl::flat_hash_set<int> answered;
  // Members a look saw arrived: one missing at the end entered and took its
  // arrival back at its own (earlier) deadline, not absent.
  absl::flat_hash_set<int> came;
  std::vector<int> missing;
  bool cancelled = false;
  while (true) {
    const absl::Time now = absl::Now();
    if (call.cancelled && call.cancelled()) {
      cancelled = true;
      break;
    }
    if (now >= call.deadline) break;
    request.set_timeout_ms(std::max<int64_t>(
        0, absl::ToInt64Milliseconds(std::min(call.deadline - now, kArriveSlice))));
    // The arrival lapses at this call's deadline even if this worker is
    // slow to withdraw it (core/arrival_board.h).
    request.set_lapses_in_ms(std::max<int64_t>(1, absl::ToInt64Milliseconds(call.deadline - now)));
    v1::ArriveResponse response;
    const grpc::Status status = host.Arrive(request, &response);
    if (!status.ok()) return HostError(call, host, status);
    if (response.complete()) return absl::OkStatus();
    if (response.refused_rank() >= 0) {
      return absl::AbortedError(absl::StrCat(
          "rank ", response.refused_rank(), " rejected its ", call.rpc,
          " request: ", response.refusal(),
          "; nothing moved, the group is still usable (this rank is rank ", call.rank, ")"));
    }
    // A look that finds nobody missing yet no completion (the round lapsed
    // on the host as this call's deadline came) keeps what the last look
    // saw, so the answer still names the ranks that never came.
    if (response.missing_size() > 0 || missing.empty()) {
      missing.assign(response.missing().begin(), response.missing().end());
    }
    if (response.missing_size() > 0) {
      for (const int m : call.members) {
        if (std::find(missing.begin(), missing.end(), m) == missing.end()) came.insert(m);
      }
    }
    std::vector<std::string> lost;
    for (int i = 0; i < static_cast<int>(missing.size()); ++i) {
      const int m = missing[i];
      std::string address =
          m < static_cast<int>(call.addresses.size()) ? call.addresses[m] : std::string();
      if (address.empty() && i < response.missing_addresses_size()) {
        address = response.missing_addresses(i);
      }
      if (address.empty()) continue;
      auto it = probed.find(m);
      if (it != probed.end() && absl::Now() - it->second < kProbeInterval) continue;
      // A probe never holds the answer past the call's deadline.
      if (call.deadline - absl::Now() < 2 * kProbeTimeout) continue;
      probed[m] = absl::Now();
      GrpcStore probe(address, kProbeTimeout);
      switch (probe.Probe(kProbeTimeout)) {
        case GrpcStore::ProbeResult::kRefuses:
          lost.push_back(absl::StrCat("rank ", m, " (", address, ") refuses connections"));
          break;
        case GrpcStore::ProbeResult::kSilent:
          if (!answered.contains(m)) silent.insert(m);
          break;
        case GrpcStore::ProbeResult::kAnswers: {
          answered.insert(m);
          silent.erase(m);
          // Alive; but still a member of this group?
          const absl::StatusOr<v1::GetStatusResponse> peer = probe.PeerStatus(kProbeTimeout);
          if (peer.ok() && (peer->generation() != call.generation ||
                            peer->state() == v1::WORKER_STATE_STARTED || peer->group_broken())) {
            lost.push_back(absl::StrCat(
                "rank ", m, " (", address, ") is no longer a member of generation ",
                call.generation, ": it reports generation ", peer->generation(), ", state ",
                v1::WorkerState_Name(peer->state()), peer->group_broken() ? ", group broken" : ""));
          }
          break;
        }
      }
    }
    if (!lost.empty()) {
      bool complete = false;
      if (absl::Status back = Withdraw(host, call, &complete); !back.ok()) return back;
      if (complete) return absl::OkStatus();
      return absl::UnavailableError(absl::StrCat(call.rpc, ": ", absl::StrJoin(lost, "; "),
                                                 ": a rank was lost before the call's vote; "
                                                 "nothing moved"));
    }
  }
  bool complete = false;
  if (absl::Status back = Withdraw(host, call, &complete); !back.ok()) return back;
  if (complete) return absl::OkStatus();
  if (cancelled) {
    return absl::AbortedError(
        absl::StrCat(call.rpc, ": the caller cancelled the call while ranks [",
                     absl::StrJoin(missing, ","), "] had not entered it; nothing moved"));
  }
  if (missing.empty()) {
    // No look at the board came back before the deadline (one shorter than
    // a look), or the last one found nobody missing yet no completion:
    // the call ran out of time with no rank known to be absent.
    return absl::DeadlineExceededError(absl::StrCat(
        call.rpc, ": the call's deadline passed ", Seconds(absl::Now() - start),
        " after it started, before every rank's arrival was seen (no rank is known to be "
        "missing); nothing moved, the group is unchanged: send it again with a longer deadline"));
  }
  std::vector<int> quiet;
  std::vector<int> absent;
  std::vector<int> withdrew;
  for (int m : missing) {
    if (silent.contains(m)) quiet.push_back(m);
    (came.contains(m) ? withdrew : absent).push_back(m);
  }
  std::string head = absent.empty()
                         ? absl::StrCat("every rank entered ", call.rpc, " but not at once")
                         : absl::StrCat("ranks [", absl::StrJoin(absent, ","), "] did not enter ",
                                        call.rpc, " within ", Seconds(absl::Now() - start));
  if (!withdrew.empty()) {
    absl::StrAppend(&head, "; ranks [", absl::StrJoin(withdrew, ","),
                    "] entered and took their arrival back at their own, earlier deadline");
  }
  if (!quiet.empty()) {
    return absl::DeadlineExceededError(
        absl::StrCat(head, "; ranks [", absl::StrJoin(quiet, ","),
                     "] do not answer their probe (stopped or overloaded); nothing moved"));
  }
  return absl::FailedPreconditionError(absl::StrCat(
      head,
      " (they answer: the call was not sent to them, or reached them later); nothing moved, the "
      "group is unchanged: send the call to every rank of the group"));
}

void RefuseForCall(GrpcStore& host, const CallArrival& call, const absl::Status& local) {
  v1::ArriveRequest request = BaseRequest(call);
  request.set_action(v1::ArriveRequest::ACTION_REFUSE);
  request.set_refusal(
      absl::StrCat(absl::StatusCodeToString(local.code()), ": ", local.message()).substr(0, 1024));
  const absl::Duration ttl =
      std::clamp(call.deadline - absl::Now(), absl::Milliseconds(1), kMaxRefusalLifetime);
  request.set_refusal_ttl_ms(absl::ToInt64Milliseconds(ttl));
  request.set_timeout_ms(0);
  v1::ArriveResponse response;
  // GrpcStore::Arrive adds its slack to timeout_ms; the post is small.
  const grpc::Status status = host.Arrive(request, &response);
  if (!status.ok()) {
    spdlog::warn("{}: refusal not posted on rank {}'s store: {}", call.rpc, call.host_rank,
                 status.error_message());
  }
}

}  // namespace moe_ep::server
