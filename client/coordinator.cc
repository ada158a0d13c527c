#include "client/coordinator.h"

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/grpc_status.h"
#include "client/targets.h"
#include "client/unsent_retry.h"
#include "core/status_macros.h"
#include "grpcpp/grpcpp.h"

namespace moe_ep::client {
namespace {

// A fresh per-generation rendezvous secret: 128 random bits, hex. Rank 0's
// store accepts the generation's keys only from calls carrying it
// (server/rendezvous_service.h).
std::string RendezvousSecret() {
  std::random_device device;
  std::string secret;
  for (int i = 0; i < 4; ++i) absl::StrAppend(&secret, absl::Hex(device(), absl::kZeroPad8));
  return secret;
}

bool IsPeerSymptom(absl::StatusCode code) {
  return code == absl::StatusCode::kDeadlineExceeded || code == absl::StatusCode::kUnavailable ||
         code == absl::StatusCode::kCancelled;
}

std::chrono::system_clock::time_point DeadlineAfter(absl::Duration timeout) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             absl::ToChronoNanoseconds(timeout));
}

// Runs call(rank, context, response) on every rank where `include(rank)`, one
// thread per rank, all under one deadline, and aggregates the errors. A call
// that failed before it was sent is sent again once its channel connects
// within `connect_grace`.
template <typename Response>
absl::StatusOr<std::vector<Response>> FanOut(
    absl::string_view op, const std::vector<std::string>& targets,
    const std::vector<std::shared_ptr<grpc::Channel>>& channels, absl::Duration connect_grace,
    absl::Duration timeout,
    const std::function<grpc::Status(int, grpc::ClientContext*, Response*)>& call,
    const std::function<bool(int)>& include = nullptr) {
  const int n = static_cast<int>(targets.size());
  std::vector<Response> responses(n);
  std::vector<absl::Status> statuses(n);
  const auto deadline = DeadlineAfter(timeout);
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    if (include && !include(r)) continue;
    threads.emplace_back([&, r] {
      // A call gRPC failed before sending it is sent once more
      // (client/unsent_retry.h).
      statuses[r] = ToAbslStatus(CallRetryingUnsent(
          *channels[r], deadline, connect_grace,
          [&](grpc::ClientContext* context) { return call(r, context, &responses[r]); }));
    });
  }
  for (auto& t : threads) t.join();
  RETURN_IF_ERROR(AggregateRankErrors(op, targets, statuses));
  return responses;
}

}  // namespace

absl::Status AggregateRankErrors(absl::string_view op, const std::vector<std::string>& targets,
                                 const std::vector<absl::Status>& per_rank) {
  std::vector<std::string> parts;
  int code_rank = -1;
  int first_rank = -1;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    const absl::Status& s = per_rank[r];
    if (s.ok()) continue;
    if (first_rank < 0) first_rank = static_cast<int>(r);
    if (code_rank < 0 && !IsPeerSymptom(s.code())) code_rank = static_cast<int>(r);
    const std::string target = r < targets.size() ? targets[r] : "?";
    parts.push_back(absl::StrCat("rank ", r, " (", target,
                                 "): ", absl::StatusCodeToString(s.code()), ": ", s.message()));
  }
  if (parts.empty()) return absl::OkStatus();
  if (code_rank < 0) code_rank = first_rank;
  return absl::Status(per_rank[code_rank].code(),
                      absl::StrCat(op, " failed on ", parts.size(), " of ", per_rank.size(),
                                   " ranks: ", absl::StrJoin(parts, "; ")));
}

std::shared_ptr<grpc::Channel> MakeWorkerChannel(const std::string& target,
                                                 const CoordinatorOptions& options) {
  grpc::ChannelArguments args;
  args.SetMaxReceiveMessageSize(options.max_message_bytes);
  args.SetMaxSendMessageSize(options.max_message_bytes);
  // Workers are addressed directly; an http_proxy in the environment must not
  // capture loopback or cluster-internal addresses.
  args.SetInt(GRPC_ARG_ENABLE_HTTP_PROXY, 0);
  // No service config from DNS: a retry policy from there could resend a
  // collective the worker already ran (client/unsent_retry.h resends only
  // what never left).
  args.SetInt(GRPC_ARG_SERVICE_CONFIG_DISABLE_RESOLUTION, 1);
  if (options.max_reconnect_backoff > absl::ZeroDuration()) {
    const int ms = static_cast<int>(absl::ToInt64Milliseconds(options.max_reconnect_backoff));
    args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, ms);
    args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, ms);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, ms);
  }
  return grpc::CreateCustomChannel(target,
                                   options.channel_credentials != nullptr
                                       ? options.channel_credentials
                                       : grpc::InsecureChannelCredentials(),
                                   args);
}

Coordinator::Coordinator(std::vector<std::string> targets, CoordinatorOptions options)
    : targets_(std::move(targets)),
      options_(std::move(options)),
      connect_grace_(ConnectGrace(options_.max_reconnect_backoff)) {
  for (const std::string& target : targets_) {
    channels_.push_back(MakeWorkerChannel(target, options_));
    stubs_.push_back(v1::Worker::NewStub(channels_.back()));
  }
}

absl::StatusOr<std::unique_ptr<Coordinator>> Coordinator::Connect(std::vector<std::string> targets,
                                                                  CoordinatorOptions options) {
  if (targets.empty()) return absl::InvalidArgumentError("targets: expected at least 1 worker");
  for (size_t r = 0; r < targets.size(); ++r) {
    auto hp = SplitHostPort(targets[r]);
    if (!hp.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("rank ", r, ": ", hp.status().message()));
    }
  }
  if (!options.data_plane_hosts.empty() && options.data_plane_hosts.size() != targets.size()) {
    return absl::InvalidArgumentError(absl::StrCat("data_plane_hosts: expected ", targets.size(),
                                                   " entries (one per target), got ",
                                                   options.data_plane_hosts.size()));
  }
  if (options.max_message_bytes < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_message_bytes: expected >= 1, got ", options.max_message_bytes));
  }
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(targets), std::move(options)));
}

absl::Status Coordinator::WaitReady(absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  const int n = world_size();
  std::vector<bool> ready(n, false);
  std::vector<absl::Status> last(n, absl::UnavailableError("not polled yet"));
  while (true) {
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      if (ready[r]) continue;
      threads.emplace_back([&, r] {
        grpc::ClientContext context;
        // One attempt waits for the connection up to 1 s (or what is left).
        const absl::Duration left = std::max(absl::ZeroDuration(), deadline - absl::Now());
        context.set_deadline(DeadlineAfter(std::min(absl::Seconds(1), left)));
        context.set_wait_for_ready(true);
        v1::GetStatusRequest request;
        v1::GetStatusResponse response;
        last[r] = ToAbslStatus(stubs_[r]->GetStatus(&context, request, &response));
        if (last[r].ok()) ready[r] = true;
      });
    }
    for (auto& t : threads) t.join();
    if (std::all_of(ready.begin(), ready.end(), [](bool b) { return b; })) {
      return absl::OkStatus();
    }
    if (absl::Now() >= deadline) {
      std::vector<absl::Status> missing(n);
      for (int r = 0; r < n; ++r) {
        if (!ready[r]) {
          missing[r] = absl::DeadlineExceededError(
              absl::StrCat("no answer to GetStatus within ", absl::FormatDuration(timeout),
                           "; last error: ", last[r].ToString()));
        }
      }
      return AggregateRankErrors("WaitReady", targets_, missing);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
}

std::vector<absl::StatusOr<v1::GetStatusResponse>> Coordinator::StatusEach() {
  const int n = world_size();
  std::vector<absl::StatusOr<v1::GetStatusResponse>> out(n);
  std::vector<std::thread> threads;
  threads.reserve(n);
  const auto deadline = DeadlineAfter(std::min(options_.rpc_timeout, absl::Seconds(10)));
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      v1::GetStatusRequest request;
      v1::GetStatusResponse response;
      absl::Status s = ToAbslStatus(CallRetryingUnsent(
          *channels_[r], deadline, connect_grace_,
          [&](grpc::ClientContext* c) { return stubs_[r]->GetStatus(c, request, &response); }));
      if (s.ok()) {
        out[r] = std::move(response);
      } else {
        out[r] = s;
      }
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

absl::StatusOr<std::vector<v1::GetStatusResponse>> Coordinator::Status() {
  return FanOut<v1::GetStatusResponse>(
      "GetStatus", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::GetStatusResponse* resp) {
        return stubs_[r]->GetStatus(c, v1::GetStatusRequest(), resp);
      });
}

absl::StatusOr<std::vector<v1::JoinResponse>> Coordinator::FormGroup() {
  ASSIGN_OR_RETURN(std::vector<v1::GetStatusResponse> statuses, Status());
  int64_t generation = generation_;
  // Above every generation a worker has seen, formed or not: a failed
  // formation may have written that generation's rendezvous keys (issue 13).
  for (const auto& s : statuses) {
    generation = std::max({generation, s.generation(), s.max_generation_seen()});
  }
  ++generation;
  const std::string secret = RendezvousSecret();

  // Ranks still in an earlier group leave it first (Join with new arguments
  // would be FAILED_PRECONDITION).
  RETURN_IF_ERROR(FanOut<v1::LeaveResponse>(
                      "Leave (before Join)", targets_, channels_, connect_grace_,
                      options_.rpc_timeout,
                      [&](int r, grpc::ClientContext* c, v1::LeaveResponse* resp) {
                        v1::LeaveRequest request;
                        request.set_generation(statuses[r].generation());
                        *request.mutable_lease() = Claim();
                        return stubs_[r]->Leave(c, request, resp);
                      },
                      [&](int r) {
                        return statuses[r].state() != v1::WORKER_STATE_STARTED &&
                               statuses[r].state() != v1::WORKER_STATE_UNSPECIFIED;
                      })
                      .status());

  std::vector<std::string> hosts = options_.data_plane_hosts;
  if (hosts.empty()) {
    for (const std::string& target : targets_) {
      ASSIGN_OR_RETURN(HostPort hp, SplitHostPort(target));
      hosts.push_back(hp.host);
    }
  }
  const int64_t timeout_ms = absl::ToInt64Milliseconds(options_.group_timeout);
  ASSIGN_OR_RETURN(
      std::vector<v1::JoinResponse> joined,
      FanOut<v1::JoinResponse>("Join", targets_, channels_, connect_grace_,
                               options_.group_timeout + absl::Seconds(10),
                               [&](int r, grpc::ClientContext* c, v1::JoinResponse* resp) {
                                 v1::JoinRequest request;
                                 request.set_world_size(world_size());
                                 request.set_rank(r);
                                 request.set_backend(options_.backend);
                                 request.set_rendezvous_address(targets_[0]);
                                 request.set_generation(generation);
                                 request.set_timeout_ms(timeout_ms);
                                 request.set_data_plane_host(hosts[r]);
                                 request.set_rendezvous_secret(secret);
                                 if (options_.rank_masks) {
                                   for (const std::string& t : targets_) {
                                     request.add_rendezvous_addresses(t);
                                   }
                                 }
                                 *request.mutable_lease() = Claim();
                                 return stubs_[r]->Join(c, request, resp);
                               }));
  generation_ = generation;
  secret_ = secret;
  join_hosts_ = hosts;
  return joined;
}

absl::Status Coordinator::Leave() {
  return FanOut<v1::LeaveResponse>("Leave", targets_, channels_, connect_grace_,
                                   options_.rpc_timeout,
                                   [&](int r, grpc::ClientContext* c, v1::LeaveResponse* resp) {
                                     v1::LeaveRequest request;
                                     request.set_generation(generation_);
                                     *request.mutable_lease() = Claim();
                                     return stubs_[r]->Leave(c, request, resp);
                                   })
      .status();
}

v1::LeaseClaim Coordinator::Claim() const {
  v1::LeaseClaim claim;
  if (options_.owner_id.empty()) return claim;
  claim.set_owner_id(options_.owner_id);
  claim.set_ttl_ms(absl::ToInt64Milliseconds(options_.lease_ttl));
  return claim;
}

absl::StatusOr<std::vector<v1::LeaseResponse>> Coordinator::AcquireLease(bool take_over) {
  if (options_.owner_id.empty()) {
    return absl::FailedPreconditionError("AcquireLease: no owner_id in the coordinator's options");
  }
  const int n = world_size();
  std::vector<v1::LeaseResponse> responses(n);
  std::vector<absl::Status> statuses(n);
  std::vector<bool> held_before(n, false);
  {
    // Who holds each rank now: another owner's live lease refuses at once,
    // before any Lease call (so a refused client leaves every counter as it
    // was), and a failed acquisition gives back only what it took.
    // One message per owner, not one per rank (issue 31 item 2).
    std::vector<absl::StatusOr<v1::GetStatusResponse>> before = StatusEach();
    std::vector<std::string> owners;                   // first-seen order
    std::map<std::string, std::vector<int>> ranks_of;  // owner -> ranks it holds
    std::map<std::string, int64_t> least_left_ms;      // owner -> its shortest time left
    for (int r = 0; r < n; ++r) {
      if (!before[r].ok()) continue;
      const std::string& owner = before[r]->lease_owner();
      held_before[r] = owner == options_.owner_id;
      if (take_over || owner.empty() || owner == options_.owner_id) continue;
      if (ranks_of[owner].empty()) {
        owners.push_back(owner);
        least_left_ms[owner] = before[r]->lease_remaining_ms();
      }
      ranks_of[owner].push_back(r);
      least_left_ms[owner] = std::min(least_left_ms[owner], before[r]->lease_remaining_ms());
    }
    if (!owners.empty()) {
      std::vector<std::string> held;
      for (const std::string& owner : owners) {
        const std::vector<int>& ranks = ranks_of[owner];
        // "ranks 0-2 of 3 are leased by owner 'X' for another 29.9 s"
        held.push_back(absl::StrCat(
            ranks.size() > 1 ? "ranks " : "rank ", FormatRankList(ranks), " of ", n,
            ranks.size() > 1 ? " are" : " is", " leased by owner '", owner, "' for another ",
            absl::StrFormat("%.1f s", static_cast<double>(least_left_ms[owner]) / 1000.0)));
      }
      return absl::FailedPreconditionError(
          absl::StrCat("Lease refused: ", absl::StrJoin(held, "; "), "; this client is '",
                       options_.owner_id, "'"));
    }
  }
  const auto deadline = DeadlineAfter(std::min(options_.rpc_timeout, absl::Seconds(10)));
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      v1::LeaseRequest request;
      *request.mutable_claim() = Claim();
      request.mutable_claim()->set_take_over(take_over);
      statuses[r] = ToAbslStatus(CallRetryingUnsent(
          *channels_[r], deadline, connect_grace_,
          [&](grpc::ClientContext* c) { return stubs_[r]->Lease(c, request, &responses[r]); }));
    });
  }
  for (auto& t : threads) t.join();
  absl::Status all = AggregateRankErrors("Lease", targets_, statuses);
  if (all.ok()) return responses;
  threads.clear();
  for (int r = 0; r < n; ++r) {
    if (!statuses[r].ok() || held_before[r]) continue;
    threads.emplace_back([&, r] {
      grpc::ClientContext context;
      context.set_deadline(deadline);
      v1::LeaseRequest request;
      *request.mutable_claim() = Claim();
      request.set_release(true);
      v1::LeaseResponse ignored;
      (void)stubs_[r]->Lease(&context, request, &ignored);
    });
  }
  for (auto& t : threads) t.join();
  return all;
}

absl::Status Coordinator::ReleaseLease() {
  if (options_.owner_id.empty()) return absl::OkStatus();
  return FanOut<v1::LeaseResponse>("Lease (release)", targets_, channels_, connect_grace_,
                                   std::min(options_.rpc_timeout, absl::Seconds(10)),
                                   [&](int r, grpc::ClientContext* c, v1::LeaseResponse* resp) {
                                     v1::LeaseRequest request;
                                     *request.mutable_claim() = Claim();
                                     request.set_release(true);
                                     return stubs_[r]->Lease(c, request, resp);
                                   })
      .status();
}

absl::StatusOr<std::vector<v1::ConfigureLayersResponse>> Coordinator::ConfigureLayers(
    const v1::ConfigureLayersRequest& request) {
  v1::ConfigureLayersRequest claimed = request;
  if (!options_.owner_id.empty()) *claimed.mutable_lease() = Claim();
  return FanOut<v1::ConfigureLayersResponse>(
      "ConfigureLayers", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::ConfigureLayersResponse* resp) {
        return stubs_[r]->ConfigureLayers(c, claimed, resp);
      });
}

absl::StatusOr<std::vector<v1::AllocateWorkspaceResponse>> Coordinator::AllocateWorkspace(
    const v1::AllocateWorkspaceRequest& request) {
  v1::AllocateWorkspaceRequest claimed = request;
  if (!options_.owner_id.empty()) *claimed.mutable_lease() = Claim();
  return FanOut<v1::AllocateWorkspaceResponse>(
      "AllocateWorkspace", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::AllocateWorkspaceResponse* resp) {
        return stubs_[r]->AllocateWorkspace(c, claimed, resp);
      });
}

absl::StatusOr<std::vector<v1::LoadExpertsResponse>> Coordinator::LoadExperts(
    const v1::LoadExpertsRequest& request) {
  v1::LoadExpertsRequest claimed = request;
  if (!options_.owner_id.empty()) *claimed.mutable_lease() = Claim();
  return FanOut<v1::LoadExpertsResponse>(
      "LoadExperts", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::LoadExpertsResponse* resp) {
        return stubs_[r]->LoadExperts(c, claimed, resp);
      });
}

absl::StatusOr<std::vector<v1::InstallPlacementResponse>> Coordinator::InstallPlacement(
    const v1::InstallPlacementRequest& request) {
  v1::InstallPlacementRequest claimed = request;
  if (!options_.owner_id.empty()) *claimed.mutable_lease() = Claim();
  return FanOut<v1::InstallPlacementResponse>(
      "InstallPlacement", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::InstallPlacementResponse* resp) {
        return stubs_[r]->InstallPlacement(c, claimed, resp);
      });
}

absl::StatusOr<std::vector<v1::GetExpertLoadResponse>> Coordinator::GetExpertLoad(
    const v1::GetExpertLoadRequest& request) {
  return FanOut<v1::GetExpertLoadResponse>(
      "GetExpertLoad", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::GetExpertLoadResponse* resp) {
        return stubs_[r]->GetExpertLoad(c, request, resp);
      });
}

absl::StatusOr<std::vector<v1::BenchmarkResponse>> Coordinator::Benchmark(
    const v1::BenchmarkRequest& request) {
  return FanOut<v1::BenchmarkResponse>(
      "Benchmark", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::BenchmarkResponse* resp) {
        return stubs_[r]->Benchmark(c, request, resp);
      });
}

absl::StatusOr<TokenCountSync> Coordinator::SyncTokenCounts(
    int64_t epoch, const std::vector<int64_t>& local_tokens) {
  if (static_cast<int>(local_tokens.size()) != world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("local_tokens: expected ", world_size(),
                                                   " entries (one per rank), got ",
                                                   local_tokens.size()));
  }
  ASSIGN_OR_RETURN(std::vector<v1::SyncTokenCountsResponse> responses,
                   FanOut<v1::SyncTokenCountsResponse>(
                       "SyncTokenCounts", targets_, channels_, connect_grace_, options_.rpc_timeout,
                       [&](int r, grpc::ClientContext* c, v1::SyncTokenCountsResponse* resp) {
                         v1::SyncTokenCountsRequest request;
                         request.set_epoch(epoch);
                         request.set_local_tokens(local_tokens[r]);
                         return stubs_[r]->SyncTokenCounts(c, request, resp);
                       },
                       StepRanks()));
  auto describe = [](const v1::SyncTokenCountsResponse& s) {
    return absl::StrCat("counts [", absl::StrJoin(s.token_counts(), ","), "], max ", s.max_tokens(),
                        ", R ", s.runtime_max_tokens_per_rank());
  };
  const int first_rank = FirstStepRank();
  const auto& first = responses[first_rank];
  for (int r = first_rank + 1; r < world_size(); ++r) {
    if (!StepRank(r)) continue;
    const auto& s = responses[r];
    if (!std::equal(s.token_counts().begin(), s.token_counts().end(), first.token_counts().begin(),
                    first.token_counts().end()) ||
        s.max_tokens() != first.max_tokens() ||
        s.runtime_max_tokens_per_rank() != first.runtime_max_tokens_per_rank()) {
      return absl::InternalError(
          absl::StrCat("SyncTokenCounts epoch ", epoch, ": ranks disagree: rank ", first_rank,
                       " returned ", describe(first), ", rank ", r, " returned ", describe(s)));
    }
  }
  TokenCountSync out;
  out.token_counts.assign(first.token_counts().begin(), first.token_counts().end());
  out.max_tokens = first.max_tokens();
  out.runtime_max_tokens_per_rank = first.runtime_max_tokens_per_rank();
  return out;
}

absl::Status Coordinator::CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                                         const std::vector<int64_t>& local_tokens) {
  if (static_cast<int>(local_tokens.size()) != world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("local_tokens: expected ", world_size(),
                                                   " entries (one per rank), got ",
                                                   local_tokens.size()));
  }
  return FanOut<v1::CommitGeometryResponse>(
             "CommitGeometry", targets_, channels_, connect_grace_, options_.rpc_timeout,
             [&](int r, grpc::ClientContext* c, v1::CommitGeometryResponse* resp) {
               v1::CommitGeometryRequest request;
               request.set_epoch(epoch);
               request.set_runtime_max_tokens_per_rank(runtime_max_tokens_per_rank);
               request.set_local_tokens(local_tokens[r]);
               return stubs_[r]->CommitGeometry(c, request, resp);
             },
             StepRanks())
      .status();
}

absl::StatusOr<std::vector<v1::ForwardResponse>> Coordinator::Forward(
    const std::vector<v1::ForwardRequest>& requests) {
  if (static_cast<int>(requests.size()) != world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "requests: expected ", world_size(), " entries (one per rank), got ", requests.size()));
  }
  return FanOut<v1::ForwardResponse>(
      "Forward", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::ForwardResponse* resp) {
        return stubs_[r]->Forward(c, requests[r], resp);
      },
      StepRanks());
}

absl::StatusOr<std::vector<v1::ForwardLayersResponse>> Coordinator::ForwardLayers(
    const std::vector<v1::ForwardLayersRequest>& requests) {
  if (static_cast<int>(requests.size()) != world_size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "requests: expected ", world_size(), " entries (one per rank), got ", requests.size()));
  }
  return FanOut<v1::ForwardLayersResponse>(
      "ForwardLayers", targets_, channels_, connect_grace_, options_.rpc_timeout,
      [&](int r, grpc::ClientContext* c, v1::ForwardLayersResponse* resp) {
        return stubs_[r]->ForwardLayers(c, requests[r], resp);
      });
}

void Coordinator::SetStepRanks(std::vector<bool> live) {
  if (std::all_of(live.begin(), live.end(), [](bool b) { return b; })) live.clear();
  step_ranks_ = std::move(live);
}

bool Coordinator::StepRank(int rank) const {
  return step_ranks_.empty() || (rank < static_cast<int>(step_ranks_.size()) && step_ranks_[rank]);
}

int Coordinator::FirstStepRank() const {
  for (int r = 0; r < world_size(); ++r) {
    if (StepRank(r)) return r;
  }
  return 0;
}

std::function<bool(int)> Coordinator::StepRanks() const {
  if (step_ranks_.empty()) return nullptr;
  return [this](int r) { return StepRank(r); };
}

}  // namespace moe_ep::client
