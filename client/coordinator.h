#pragma once

// The coordinator: the client side of the control plane (DESIGN §8). It holds
// one gRPC channel per worker (rank i = targets[i]), fans every operation out
// to all ranks in parallel (one thread per rank) under one deadline, and folds
// the per-rank results into a single absl::Status that names each failing
// rank and its address:
//   "Forward failed on 2 of 4 ranks: rank 1 (127.0.0.1:4567): INVALID_ARGUMENT:
//    ...; rank 2 (127.0.0.1:4568): DEADLINE_EXCEEDED: ..."
//
// Thread safety: one operation at a time (the fan-out is internal).
// Source: DESIGN §8; proto/moe_ep/v1/worker.proto.

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "grpcpp/channel.h"
#include "grpcpp/security/credentials.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::client {

namespace v1 = ::moe_ep::v1;

struct CoordinatorOptions {
  // Deadline of every fanned-out call (collectives included) unless the
  // operation takes its own.
  absl::Duration rpc_timeout = absl::Seconds(300);
  // Collective timeout of the formed group (JoinRequest.timeout_ms); the Join
  // call itself gets this plus 10 s.
  absl::Duration group_timeout = absl::Seconds(120);
  // Channel send/receive limit; gRPC's default receive limit (4 MiB) is far
  // below one layer's hidden states.
  int max_message_bytes = 256 << 20;
  // "gloo", "nccl" or "auto" (JoinRequest.backend).
  std::string backend = "gloo";
  // Per-rank address each worker's data plane binds to
  // (JoinRequest.data_plane_host). Empty: the host part of each target.
  std::vector<std::string> data_plane_hosts;
  // Credentials of every channel (TLS, client certificate, bearer token:
  // client/credentials.h); null = plaintext.
  std::shared_ptr<grpc::ChannelCredentials> channel_credentials;
  // Longest wait between reconnection attempts to a worker that went away;
  // zero = gRPC's default (up to 120 s). A long-running coordinator sets it
  // low so a restarted worker is reached again within that time.
  absl::Duration max_reconnect_backoff = absl::ZeroDuration();
  // Ownership of the group (LeaseClaim in worker.proto; DESIGN §16; issue 12
  // item 4): the owner id every leased call claims (Leave, Join,
  // ConfigureLayers, AllocateWorkspace, LoadExperts, InstallPlacement) with
  // `lease_ttl`.
  // Empty = no claim: such calls then work only on workers without a live
  // lease. client/lease_renewer.h acquires and renews the lease itself.
  std::string owner_id;
  absl::Duration lease_ttl = absl::Seconds(30);
  // Rank masks (DESIGN §15; issue 17 item 3): Join sends every target as
  // JoinRequest.rendezvous_addresses, so a group (any data plane) survives a
  // lost rank (the survivors mask it and keep serving). Off: a lost rank
  // breaks it.
  bool rank_masks = false;
};

// The channel a Coordinator uses for `target`: options.channel_credentials
// (null = plaintext), the message limit both ways, no HTTP proxy, and
// options.max_reconnect_backoff (also the initial and minimum back-off) when
// set. Connects lazily. Thread-safe.
std::shared_ptr<grpc::Channel> MakeWorkerChannel(const std::string& target,
                                                 const CoordinatorOptions& options);

// Returns OK when every entry of `per_rank` is OK; otherwise one status whose
// message lists every failing rank as "rank R (TARGET): CODE: message",
// separated by "; ", after "<op> failed on F of N ranks: ". Its code is that of
// the lowest failing rank whose code is not DEADLINE_EXCEEDED, UNAVAILABLE or
// CANCELLED (the root cause of a collective failing is usually the rank whose
// error is specific; its peers just time out), else that of the lowest
// failing rank.
// REQUIRES: per_rank.size() == targets.size().
absl::Status AggregateRankErrors(absl::string_view op, const std::vector<std::string>& targets,
                                 const std::vector<absl::Status>& per_rank);

// The agreed result of SyncTokenCounts (DESIGN §6).
struct TokenCountSync {
  std::vector<int64_t> token_counts;  // [world], tokens each rank feeds into dispatch
  int64_t max_tokens = 0;
  int64_t runtime_max_tokens_per_rank = 0;  // R
};

// What a rank that takes its masked rank back is sent, to it alone, before
// Rejoin (DESIGN §15): the group's own set-up requests, in this order.
struct RankSetup {
  v1::ConfigureLayersRequest configure;
  v1::AllocateWorkspaceRequest allocate;
  std::vector<v1::InstallPlacementRequest> placements;
  std::vector<v1::LoadExpertsRequest> loads;
};

class Coordinator {
 public:
  // Creates one channel per target (connections are made lazily).
  // Errors: kInvalidArgument when `targets` is empty, a target is malformed,
  // or data_plane_hosts is non-empty with a size other than targets.size().
  static absl::StatusOr<std::unique_ptr<Coordinator>> Connect(std::vector<std::string> targets,
                                                              CoordinatorOptions options = {});

  int world_size() const { return static_cast<int>(targets_.size()); }
  const std::vector<std::string>& targets() const { return targets_; }
  const CoordinatorOptions& options() const { return options_; }
  // Generation of the group formed last by FormGroup (0 before).
  int64_t generation() const { return generation_; }
  void set_rpc_timeout(absl::Duration timeout) { options_.rpc_timeout = timeout; }

  // Polls GetStatus on every rank until all answer or `timeout` passes.
  // Errors: kDeadlineExceeded naming the ranks that never answered and their
  // last error.
  absl::Status WaitReady(absl::Duration timeout);

  // GetStatus of every rank; one entry per rank, each its own result (for a
  // status table that shows unreachable workers).
  std::vector<absl::StatusOr<v1::GetStatusResponse>> StatusEach();
  // GetStatus of every rank; fails when any rank fails (aggregated).
  absl::StatusOr<std::vector<v1::GetStatusResponse>> Status();

  // Forms the group: ranks already joined to an earlier group are made to
  // Leave first, then every rank Joins with rank = its index, world = N,
  // the rendezvous at targets[0] and generation = 1 + the largest generation
  // seen (ours or any worker's), so the store prefix is always fresh.
  // Returns each rank's JoinResponse. Errors: aggregated per rank.
  absl::StatusOr<std::vector<v1::JoinResponse>> FormGroup();
  // Leave on every rank (generation()).
  absl::Status Leave();

  // The Lease RPC on every rank with options().owner_id and lease_ttl
  // (worker.proto LeaseClaim): acquires or renews the lease, replacing
  // another owner's live lease when `take_over`. When it fails on a rank it
  // gives the lease back on the ranks where this call took it, so a refused
  // acquisition leaves every worker as it was. Returns each rank's answer.
  // Errors: kFailedPrecondition without an owner_id; kFailedPrecondition
  // before any Lease call when another owner holds a live lease, one message
  // for all ranks (issue 31 item 2): "Lease refused: ranks 0-2 of 3 are
  // leased by owner 'X' for another 29.9 s; this client is 'Y'" (the
  // shortest time left of each owner); the Lease calls' errors aggregated
  // per rank.
  absl::StatusOr<std::vector<v1::LeaseResponse>> AcquireLease(bool take_over);
  // Lease with release = true on every rank (no-op where this owner holds
  // nothing). Errors: aggregated per rank.
  absl::Status ReleaseLease();
  // The claim stamped into leased calls (empty without an owner_id).
  v1::LeaseClaim Claim() const;

  // The same request to every rank; per-rank responses (rank order).
  absl::StatusOr<std::vector<v1::ConfigureLayersResponse>> ConfigureLayers(
      const v1::ConfigureLayersRequest& request);
  absl::StatusOr<std::vector<v1::AllocateWorkspaceResponse>> AllocateWorkspace(
      const v1::AllocateWorkspaceRequest& request);
  absl::StatusOr<std::vector<v1::LoadExpertsResponse>> LoadExperts(
      const v1::LoadExpertsRequest& request);
  absl::StatusOr<std::vector<v1::BenchmarkResponse>> Benchmark(const v1::BenchmarkRequest& request);
  // InstallPlacement (DESIGN §15) and GetExpertLoad (this rank's counters;
  // the group's load is the sum over the responses).
  absl::StatusOr<std::vector<v1::InstallPlacementResponse>> InstallPlacement(
      const v1::InstallPlacementRequest& request);
  absl::StatusOr<std::vector<v1::GetExpertLoadResponse>> GetExpertLoad(
      const v1::GetExpertLoadRequest& request);

  // SyncTokenCounts with rank r's local count local_tokens[r].
  // Errors: kInvalidArgument when local_tokens.size() != world; aggregated
  // per-rank errors; kInternal when ranks return different counts or R (the
  // message shows rank 0's answer and the first that differs).
  absl::StatusOr<TokenCountSync> SyncTokenCounts(int64_t epoch,
                                                 const std::vector<int64_t>& local_tokens);
  // CommitGeometry(epoch, R) on every rank, with rank r's local count.
  // Errors: kInvalidArgument on a size mismatch; aggregated per-rank errors.
  absl::Status CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                              const std::vector<int64_t>& local_tokens);
  // Forward with rank r's request requests[r] (each rank its own tokens).
  // Errors: kInvalidArgument when requests.size() != world; aggregated.
  absl::StatusOr<std::vector<v1::ForwardResponse>> Forward(
      const std::vector<v1::ForwardRequest>& requests);
  // ForwardLayers with rank r's request requests[r] (its DP group's tokens).
  // Errors: kInvalidArgument when requests.size() != world; aggregated.
  absl::StatusOr<std::vector<v1::ForwardLayersResponse>> ForwardLayers(
      const std::vector<v1::ForwardLayersRequest>& requests);

  // Rank masks (DESIGN §15; issue 17; client/coordinator_rejoin.cc).
  // RejoinRank(): re-admits masked rank `rank` once its worker runs again
  // (restarted on its target), at a step boundary: reads the survivors'
  // mask (GetStatus of every live rank: the same generation, mask_round and
  // masked_ranks, `rank` among them), Joins `rank` alone (JoinRequest.rejoin
  // with this group's generation, secret and addresses: FormGroup with
  // rank_masks must have formed it), sends it `setup` (ConfigureLayers,
  // AllocateWorkspace, each InstallPlacement, each LoadExperts), then Rejoin
  // to it and every live rank at once. Returns the rank's RejoinResponse
  // (masked_ranks empty once every rank is back). Errors: kFailedPrecondition
  // (no group formed here, rank_masks off, `rank` not masked, survivors that
  // disagree on the mask), the calls' errors naming the rank (aggregated for
  // Rejoin).
  absl::StatusOr<v1::RejoinResponse> RejoinRank(int rank, const RankSetup& setup);
  // RejoinRanks(): RejoinRank for several masked ranks at once (DESIGN §15;
  // issue 17: two ranks restarted together): each is joined alone and set
  // up in turn (ascending), then one Rejoin (RejoinRequest.ranks = `ranks`)
  // re-admits them all in a single mask round. Returns the lowest returning
  // rank's RejoinResponse. Errors: RejoinRank's; kInvalidArgument for an
  // empty or repeated list.
  absl::StatusOr<v1::RejoinResponse> RejoinRanks(std::vector<int> ranks, const RankSetup& setup);
  // The ranks SyncTokenCounts, CommitGeometry and Forward go to: `live`
  // [world] (a masked group's survivors: the entries of the other ranks are
  // ignored and their responses left empty); all true or empty = every rank.
  void SetStepRanks(std::vector<bool> live);
  // The ranks GetStatus shows live (not masked) according to the survivors;
  // every rank before any mask. Errors: Status()'s of the ranks that answer.
  absl::StatusOr<std::vector<int>> LiveRanks();

 private:
  Coordinator(std::vector<std::string> targets, CoordinatorOptions options);

  std::vector<std::string> targets_;
  CoordinatorOptions options_;
  absl::Duration connect_grace_;                          // client/unsent_retry.h
  std::vector<std::shared_ptr<grpc::Channel>> channels_;  // [world], stubs_'s
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;
  int64_t generation_ = 0;
  bool StepRank(int rank) const;
  int FirstStepRank() const;
  std::function<bool(int)> StepRanks() const;  // FanOut's filter; null = every rank

  // RejoinRanks's steps (client/coordinator_rejoin.cc). RejoinSurvivors():
  // the live ranks, once every rank of `ranks` (sorted, in range) is masked
  // in the survivors' latest view (copied to *latest) and every live rank
  // reports that view; kFailedPrecondition otherwise. SetUpReturningRank():
  // Join (rejoin) and `setup` sent to `rank` alone; errors name the call and
  // the rank. RejoinMembers(): `request` to every rank of `members` at once;
  // `rank`'s response, or the ranks' errors aggregated.
  absl::StatusOr<std::vector<int>> RejoinSurvivors(const std::vector<int>& ranks,
                                                   v1::GetStatusResponse* latest);
  absl::Status SetUpReturningRank(int rank, const RankSetup& setup);
  absl::StatusOr<v1::RejoinResponse> RejoinMembers(const std::vector<int>& members,
                                                   const v1::RejoinRequest& request, int rank);

  std::vector<bool> step_ranks_;         // SetStepRanks; empty = every rank
  std::string secret_;                   // of generation_ (FormGroup)
  std::vector<std::string> join_hosts_;  // data_plane_host of each rank (FormGroup)
};

}  // namespace moe_ep::client
