#pragma once

// The moe_ep.v1.Worker service (proto/moe_ep/v1/worker.proto, whose comments
// are the contract): a synchronous gRPC service that converts and validates
// each request (server/request_options.h), calls the group session
// (server/group_session.h: the formed data plane, votes, arrival rounds,
// rank masks) or the data plane, and replies. It owns the reported state
// (phase, GetStatus, health), the lease and the collective slot. One per
// worker process (one per rank). The RPCs are split by concern:
// worker_service.cc (state, set-up and step RPCs), _join.cc (Join, Leave),
// _stack.cc (Benchmark, ForwardLayers), _placement.cc, _rejoin.cc and
// _engine.cc (the embedded engine's calls).
//
// Locking: all collective work (Join, Leave, ConfigureLayers,
// AllocateWorkspace, LoadExperts, SyncTokenCounts, CommitGeometry, Forward,
// Benchmark, ForwardLayers) is serialized by one "collective slot" (the collective is
// single-threaded), taken with the call's deadline (DEADLINE_EXCEEDED when
// another call holds it past the deadline). The snapshot GetStatus returns is
// guarded by a separate mutex, so GetStatus never waits on peers.
//
// Requests are validated in full before anything changes: bad input returns
// INVALID_ARGUMENT naming the field (expected vs got) and leaves the state as
// it was (server/request_options.h converts and checks each request).
//
// Failure isolation (DESIGN §16; issues 12 and 13): Join votes through the
// generation's rendezvous store before forming (core/join_vote.h: a bad
// Join on one rank, e.g. another world_size or backend, fails every rank at
// once, the peers ABORTED naming it; one too malformed to vote, e.g. a rank
// outside [0, world), posts a refusal that fails them just as fast); every collective RPC
// (ConfigureLayers, AllocateWorkspace, LoadExperts, SyncTokenCounts, Forward,
// Benchmark, ForwardLayers) first runs the cross-rank vote (core/agreement.h)
// with the call's identity (RPC, generation, sequence), this rank's own
// validation result and its spec field by field. A rank whose request fails
// its own checks still votes: it returns its error, its peers ABORTED naming
// it, within one small all-gather, and the group stays usable. Ranks in
// different RPCs, or with a differing field, are ABORTED everywhere, the
// message naming the field and each rank's value. The vote record has a fixed
// size, so even ranks in different calls never mismatch a collective.
// Collective waits end by the call's deadline or the group timeout,
// whichever is first. CommitGeometry is not a collective and does not vote.
//
// Any collective failure (DEADLINE_EXCEEDED, UNAVAILABLE, ...) marks the group
// broken: later collective calls return FAILED_PRECONDITION "... re-join with
// a new generation" until Join with a new generation re-forms it. GetStatus
// shows it (group_broken, broken_reason: "<rpc>: <CODE>: <message>"). Health
// (proto/rpc/health.h) is SERVING only while joined, allocated and not broken.
//
// Rank masks (DESIGN §15; issue 17): in a group joined with every rank's
// address (Gloo, or NCCL on either GPU plane) a collective failure starts a mask round instead (the
// survivors agree on who is left and keep serving Forward; see
// GroupSession::GroupResult and Vote); ForwardLayers, Benchmark and the engine calls then fail
// FAILED_PRECONDITION naming the masked ranks (they route by the unmasked
// placement). A restarted worker Joins with rejoin (alone: only its rank
// live), is set up with the group's requests sent to it only, and Rejoin on
// it and the survivors re-admits it at a step boundary
// (server/worker_service_rejoin.cc); until then its Forward and
// SyncTokenCounts are FAILED_PRECONDITION.
//
// Ownership (DESIGN §16; issue 12 item 4; LeaseClaim in worker.proto): the
// worker holds one lease (server/worker_lease.h). Join of a new generation,
// Leave, ConfigureLayers, AllocateWorkspace, LoadExperts and InstallPlacement
// check their request's claim before anything changes: another owner's live
// lease is FAILED_PRECONDITION naming it and its time left. In the collective
// calls the refusal is this rank's own error in the vote (Join's in its store
// vote), so in a partly leased group the peers of a refused rank are ABORTED
// at once, naming it and the owner, and nothing changes on any rank; Leave is
// refused before anything else. A claimed call that succeeds acquires or
// renews the lease. The Lease RPC takes no slot.
//
// Backends: Join resolves "auto" / "gloo" / "nccl" (server/backend_selection.h)
// and forms the group's data plane (server/data_plane.h): Gloo + the CPU
// dispatcher, or NCCL + the GPU dispatcher on WorkerOptions::device. GetStatus
// reports that device's name and memory ("cpu" and host memory for Gloo).
//
// Thread-safe. Source: DESIGN §6-§8; issue 2 ("proto and server"), issue 3.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/functional/function_ref.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "core/agreement.h"
#include "core/collective.h"
#include "core/ep_dispatcher.h"
#include "core/experts.h"
#include "core/layer_plan.h"
#include "moe_ep/v1/worker.grpc.pb.h"
#include "proto/rpc/health.h"
#include "server/backend_selection.h"
#include "server/collective_slot.h"
#include "server/data_plane.h"
#include "server/group_session.h"
#include "server/layer_stack_runner.h"
#include "server/memory_budget.h"
#include "server/rendezvous_service.h"
#include "server/request_limits.h"
#include "server/request_options.h"
#include "server/worker_lease.h"
#include "server/worker_state.h"

namespace moe_ep::server {

struct WorkerOptions {
  // Bytes this worker may hold in workspace + expert weights; 0 = unlimited.
  int64_t memory_cap_bytes = 0;
  // Backend used when Join asks for "" : "auto", "gloo" or "nccl".
  std::string default_backend = "auto";
  // GPU data plane used when Join asks for "": "auto", "one-sided" or "nccl"
  // (server/backend_selection.h ResolveGpuDataPlane). moe-ep-worker sets it
  // from --gpu-data-plane (default "auto"); a service made in process keeps
  // the nccl plane unless it asks (the engine's calls need that plane).
  std::string default_gpu_data_plane = "nccl";
  // Address the Gloo TCP device binds to when Join leaves data_plane_host empty.
  std::string data_plane_host = "127.0.0.1";
  // Collective timeout when Join leaves timeout_ms at 0.
  absl::Duration default_timeout = absl::Seconds(30);
  // CUDA device ordinal the NCCL backend runs on (--device); Gloo ignores it.
  int device = 0;
  // Blocks of each one-sided communication kernel (--onesided-sm-budget;
  // DataPlaneGroup::onesided_sm_budget).
  int onesided_sm_budget = 16;
  // Receive buffers in the one-sided windows (--onesided-receive-buffers;
  // DataPlaneGroup::onesided_receive_buffers).
  bool onesided_receive_buffers = false;
  // Bounds on request sizes (--max-*; server/request_limits.h).
  RequestLimits limits;
  // Directories LoadExperts may read checkpoints from (--checkpoint-dir;
  // server/path_policy.h); empty = none.
  std::vector<std::string> checkpoint_dirs;
  // This worker's Rendezvous store: a Join as rank 0 opens its generation
  // there and, once formed, frees the older generations' keys. May be null
  // (no store in this process); must outlive the service.
  RendezvousService* rendezvous = nullptr;
  // Serve the test-only Echo RPC (--enable-echo; worker.proto); when false
  // Echo is UNIMPLEMENTED.
  bool enable_echo = false;
};

class WorkerService final : public v1::Worker::Service, private GroupSession::Observer {
 public:
  // `health` may be null; it must outlive the service.
  WorkerService(WorkerOptions options, rpc::HealthReporter* health);
  ~WorkerService() override;

  // Shown by GetStatus (the address main.cc bound).
  void SetListenAddress(const std::string& address);
  // From now on every RPC but GetStatus returns UNAVAILABLE "shutting down".
  void BeginShutdown();

  // The in-process data calls of an embedded worker (server/moe_ep.h,
  // DESIGN §14; server/worker_service_engine.cc): takes the collective slot
  // (waiting until `deadline`: kDeadlineExceeded), requires an allocated
  // group that is not broken (the RPCs' kFailedPrecondition / kUnavailable),
  // with `needs_steps` also readiness for steps (WaitReadyForSteps in this
  // group and workspace; kFailedPrecondition naming what is missing), and
  // runs `fn` on the data plane with the allocated options; `fn`'s
  // collectives are bounded by the group's timeout, not by `deadline` (a
  // peer later than the caller's timeout is waited for). A group error
  // from `fn` marks the group broken, as an RPC's does.
  absl::Status RunOnDataPlane(
      const char* call, absl::Time deadline, bool needs_steps,
      absl::FunctionRef<absl::Status(DataPlane&, const core::EpDispatcherOptions&)> fn);

  // The readiness contract of the engine calls (server/moe_ep.h
  // moe_ep_worker_wait_ready_for_steps; issue 30 item 1): waits until this
  // rank is joined, configured, allocated, not broken, not under a rank
  // mask and, with `worker_experts`, holds experts for every sparse layer
  // of the plan; then until every rank of the group is so with the same
  // (generation, workspace, mask round, loaded layers) fingerprint, agreed
  // in one arrival round on the group's store (server/call_arrival.h; no
  // data-plane collective, so a peer still loading breaks nothing). From
  // then on data calls run (RunOnDataPlane with needs_steps) until the
  // group re-forms or the workspace is re-allocated. `deadline`
  // absl::InfiniteFuture() = no limit. Errors: kDeadlineExceeded naming
  // what this rank lacks or which ranks did not agree, kUnavailable
  // (shutting down). Thread-safe; holds the slot only for short checks.
  absl::Status WaitReadyForSteps(bool worker_experts, absl::Time deadline);

  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest* request,
                         v1::GetStatusResponse* response) override;
  grpc::Status Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                    v1::JoinResponse* response) override;
  grpc::Status Leave(grpc::ServerContext* context, const v1::LeaveRequest* request,
                     v1::LeaveResponse* response) override;
  grpc::Status ConfigureLayers(grpc::ServerContext* context,
                               const v1::ConfigureLayersRequest* request,
                               v1::ConfigureLayersResponse* response) override;
  grpc::Status AllocateWorkspace(grpc::ServerContext* context,
                                 const v1::AllocateWorkspaceRequest* request,
                                 v1::AllocateWorkspaceResponse* response) override;
  grpc::Status LoadExperts(grpc::ServerContext* context, const v1::LoadExpertsRequest* request,
                           v1::LoadExpertsResponse* response) override;
  grpc::Status SyncTokenCounts(grpc::ServerContext* context,
                               const v1::SyncTokenCountsRequest* request,
                               v1::SyncTokenCountsResponse* response) override;
  grpc::Status CommitGeometry(grpc::ServerContext* context,
                              const v1::CommitGeometryRequest* request,
                              v1::CommitGeometryResponse* response) override;
  grpc::Status Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                       v1::ForwardResponse* response) override;
  grpc::Status Benchmark(grpc::ServerContext* context, const v1::BenchmarkRequest* request,
                         v1::BenchmarkResponse* response) override;
  grpc::Status ForwardLayers(grpc::ServerContext* context, const v1::ForwardLayersRequest* request,
                             v1::ForwardLayersResponse* response) override;
  // Test-only (worker.proto): the request's tensor back, after
  // ValidateTensor; kUnimplemented unless options.enable_echo. Takes no lock
  // and no collective slot. Thread-safe.
  grpc::Status Echo(grpc::ServerContext* context, const v1::EchoRequest* request,
                    v1::EchoResponse* response) override;
  // server/worker_service_placement.cc (DESIGN §15).
  grpc::Status InstallPlacement(grpc::ServerContext* context,
                                const v1::InstallPlacementRequest* request,
                                v1::InstallPlacementResponse* response) override;
  grpc::Status GetExpertLoad(grpc::ServerContext* context, const v1::GetExpertLoadRequest* request,
                             v1::GetExpertLoadResponse* response) override;
  grpc::Status Lease(grpc::ServerContext* context, const v1::LeaseRequest* request,
                     v1::LeaseResponse* response) override;
  // server/worker_service_rejoin.cc (DESIGN §15; worker.proto's Rejoin).
  grpc::Status Rejoin(grpc::ServerContext* context, const v1::RejoinRequest* request,
                      v1::RejoinResponse* response) override;

 private:
  // The allocation in force (AllocateWorkspace, normalized).
  struct Allocation {
    core::EpDispatcherOptions options;
    v1::AllocateWorkspaceResponse response;
    uint64_t fingerprint = 0;
  };

  // Whether a Join's ballot has a place in the store vote even when the
  // request is bad (a rank of a group of several, a fresh generation within
  // the limit, a rendezvous address). Needs state_mu_.
  bool CanVoteOnJoin(const v1::JoinRequest& request) const;
  absl::Status DoJoin(grpc::ServerContext* context, const v1::JoinRequest& request,
                      v1::JoinResponse* response);
  // A Join rejected as `local` whose ballot has no place (core/join_vote.h):
  // posts its refusal to the request's store from a detached thread (at most
  // 4 at once, each for at most the call's deadline, the request's timeout
  // and 30 s), so its peers fail at once and this call answers at once; a
  // store that cannot be reached is logged and ignored.
  void RefuseJoin(const grpc::ServerContext* context, const v1::JoinRequest& request,
                  const absl::Status& local);
  absl::Status DoLeave(grpc::ServerContext* context, const v1::LeaveRequest& request);
  absl::Status DoConfigureLayers(grpc::ServerContext* context,
                                 const v1::ConfigureLayersRequest& request,
                                 const absl::Status& refused,
                                 v1::ConfigureLayersResponse* response);
  absl::Status DoAllocateWorkspace(grpc::ServerContext* context,
                                   const v1::AllocateWorkspaceRequest& request,
                                   const absl::Status& refused,
                                   v1::AllocateWorkspaceResponse* response);
  absl::Status DoLoadExperts(grpc::ServerContext* context, const v1::LoadExpertsRequest& request,
                             const absl::Status& refused, v1::LoadExpertsResponse* response);
  absl::Status DoSyncTokenCounts(grpc::ServerContext* context,
                                 const v1::SyncTokenCountsRequest& request,
                                 v1::SyncTokenCountsResponse* response);
  absl::Status DoCommitGeometry(grpc::ServerContext* context,
                                const v1::CommitGeometryRequest& request);
  absl::Status DoForward(grpc::ServerContext* context, const v1::ForwardRequest& request,
                         v1::ForwardResponse* response);
  absl::Status DoBenchmark(grpc::ServerContext* context, const v1::BenchmarkRequest& request,
                           v1::BenchmarkResponse* response);
  absl::Status DoForwardLayers(grpc::ServerContext* context,
                               const v1::ForwardLayersRequest& request,
                               v1::ForwardLayersResponse* response);
  absl::Status DoInstallPlacement(grpc::ServerContext* context,
                                  const v1::InstallPlacementRequest& request,
                                  const absl::Status& refused,
                                  v1::InstallPlacementResponse* response);
  absl::Status DoGetExpertLoad(grpc::ServerContext* context,
                               const v1::GetExpertLoadRequest& request,
                               v1::GetExpertLoadResponse* response);
  absl::StatusOr<core::PlacementTable> PreparePlacement(const v1::InstallPlacementRequest& request);
  absl::Status DoRejoin(grpc::ServerContext* context, const v1::RejoinRequest& request,
                        const absl::Status& refused, v1::RejoinResponse* response);
  // Rejoin's local check (worker.proto); *returning: this rank is one of
  // request.ranks (a worker that joined alone). No state changes.
  absl::Status CheckRejoin(const v1::RejoinRequest& request, bool* returning) const;
  // What the members of a re-admitted group vote on before it serves: the
  // allocation, the model, every MoE layer's table and the loaded layers.
  std::vector<core::BallotField> MemberStateFields() const;
  // What WaitReadyForSteps agreed on (server/worker_service_engine.cc).
  // Owned by the slot holder.
  struct StepReadiness {
    bool ready = false;
    int64_t generation = 0;
    uint64_t allocation = 0;  // Allocation::fingerprint
    int mask_round = 0;
    int64_t rounds = 0;  // readiness rounds completed in `generation`
  };
  // This rank's side of WaitReadyForSteps, under the slot: OK with the
  // round's fingerprint text in *fingerprint, or kFailedPrecondition saying
  // what is missing.
  absl::Status LocalStepReadiness(bool worker_experts, std::string* fingerprint);
  // kFailedPrecondition naming `call` and what is missing unless the data
  // calls may run (StepReadiness matches the group in force). Needs the slot.
  absl::Status RequireReadyForSteps(const char* call) const;

  // kFailedPrecondition while this worker joined alone (JoinRequest.rejoin)
  // and Rejoin has not re-admitted it: its steps would not be the group's.
  absl::Status RequireReadmitted(const char* call) const;

  // The local validation of each voting RPC: the state it needs and its
  // request (server/request_options.h), before the vote. No state changes.
  absl::StatusOr<core::EpDispatcherOptions> PrepareAllocation(
      const v1::AllocateWorkspaceRequest& request, bool* same_spec);
  absl::StatusOr<ExpertLoad> PrepareExpertLoad(const v1::LoadExpertsRequest& request);
  absl::StatusOr<ForwardInputs> PrepareForward(const v1::ForwardRequest& request);
  absl::StatusOr<BenchmarkSpec> PrepareBenchmark(const v1::BenchmarkRequest& request);
  // Replaces the data plane's workspace with one of `options` (drops the experts).
  absl::Status Allocate(const core::EpDispatcherOptions& options);

  // A leased call `rpc` (see the file comment): validates `claim` and checks
  // it against the lease, runs `fn` with the result (OK, or the refusal the
  // collective calls vote with) and, when `fn` succeeded, applies the claim.
  absl::Status Leased(const char* rpc, const v1::LeaseClaim& claim,
                      absl::FunctionRef<absl::Status(absl::Status)> fn);
  // EnterGroup for a leased collective call: when this rank is not in a
  // group (no vote to take part in), a lease refusal is returned instead of
  // EnterGroup's error.
  absl::Status EnterLeasedGroup(SlotLease& slot, const grpc::ServerContext* context,
                                const char* rpc, WorkerPhase phase, const absl::Status& refused);
  // GroupSession::Observer: the session's changes in the reported state.
  void OnGroupBroken(const std::string& reason) override;
  void OnMaskAdopted(const RankMaskState& mask) override;
  std::string SelfAddress() override;
  // Counts errors, converts to grpc::Status.
  grpc::Status Finish(const absl::Status& status);
  // Finish for a collective RPC: also counts consecutive group errors
  // (Counters.consecutive_failed_collectives; readiness NOT_SERVING from
  // kFailedCollectivesNotReady on, issue 29 item 4), reset by a success.
  static constexpr int64_t kFailedCollectivesNotReady = 3;
  grpc::Status FinishCollective(const absl::Status& status);
  // Takes `slot` for `rpc` (server/collective_slot.h); then the worker must
  // be in a usable group (joined, not broken) and the call enters it
  // (GroupSession::BeginCall: its deadline and cancellation bound the
  // group's waits). Outside a group: the error of `phase`, the state the
  // RPC needs (within a group the RPC checks its phase itself and votes on
  // the result).
  absl::Status EnterGroup(SlotLease& slot, const grpc::ServerContext* context, const char* rpc,
                          WorkerPhase phase);
  // OK when the worker is at `phase` or later (kFailedPrecondition naming
  // `rpc` otherwise); a voting RPC's local check.
  absl::Status RequirePhase(WorkerPhase phase, const char* rpc);
  // The memory budget now (server/memory_budget.h). Needs the slot.
  MemoryBudget Budget() const;
  // Replaces the group in force (TearDownGroup) by `formed`, joined with
  // `args`: JOINED. Needs the slot.
  void InstallGroup(const JoinArgs& args, std::unique_ptr<DataPlane> formed);
  // Drops the group and everything built on it; back to STARTED. Needs the slot.
  void TearDownGroup();
  // Re-derives the reported state, readiness and the log fields (rank,
  // generation, epoch) from the state. Needs state_mu_.
  void UpdateHealthLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  // The device GetStatus shows for `backend` (server/device_info.h).
  void SetDeviceLocked(const std::string& backend) ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);
  absl::Status RequireGroup(WorkerPhase phase, const char* rpc);
  // GetStatusResponse.expert_tokens of `layer` := `totals` (the data plane's
  // ExpertTokenTotals), kept sorted by layer. Needs state_mu_.
  void SetExpertTokensLocked(int layer, const std::vector<int64_t>& totals)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(state_mu_);

  const WorkerOptions options_;
  rpc::HealthReporter* const health_;

  // The collective slot (server/collective_slot.h): held by at most one
  // collective call at a time.
  CollectiveSlot slot_;

  // The group this worker is a member of (server/group_session.h): its data
  // plane (the group's collective, the dispatcher and the experts of each
  // layer), votes and rank masks. Owned by the holder of the collective slot.
  GroupSession session_{this};
  int64_t max_generation_used_ = 0;
  v1::ModelDescription model_;  // as configured (0 = field not given)
  std::vector<core::LayerPlan> plan_;
  std::unique_ptr<Allocation> allocation_;
  bool geometry_committed_ = false;
  int64_t expert_bytes_ = 0;  // all layers' experts held by the data plane
  // layer -> fingerprint of what its LoadExperts asked for (Forward's vote).
  std::map<int, int64_t> expert_specs_;
  StepReadiness step_ready_;  // WaitReadyForSteps (issue 30)

  // Who owns the group (thread-safe on its own; never under state_mu_).
  WorkerLease lease_;

  // The snapshot GetStatus returns, and the state machine.
  absl::Mutex state_mu_;
  WorkerStateMachine state_ ABSL_GUARDED_BY(state_mu_);
  v1::GetStatusResponse status_ ABSL_GUARDED_BY(state_mu_);
  bool shutting_down_ ABSL_GUARDED_BY(state_mu_) = false;
};

}  // namespace moe_ep::server
