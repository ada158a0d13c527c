#include "server/worker_service.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <thread>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/agreement.h"
#include "core/expert_source.h"
#include "core/geometry.h"
#include "core/join_vote.h"
#include "core/logging.h"
#include "core/percentile.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "proto/rpc/status_conversion.h"
#include "server/benchmark_inputs.h"
#include "server/call_arrival.h"
#include "server/collective_slot.h"
#include "server/device_info.h"
#include "server/group_formation.h"
#include "server/grpc_store.h"
#include "server/request_limits.h"
#include "server/shared_expert_request.h"
#include "server/tensor_codec.h"
#include "server/worker_replies.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

// What a layer's LoadExperts asked for, as one fingerprint: the fields
// every rank must agree on (the layer excluded), compared by Forward's vote.
int64_t ExpertSpecFingerprint(const std::vector<core::BallotField>& fields) {
  std::string text;
  for (const core::BallotField& field : fields) {
    if (field.name == "layer") continue;
    absl::StrAppend(&text, field.name, "=", field.value, ";");
  }
  return static_cast<int64_t>(core::Fingerprint64(text));
}

}  // namespace

WorkerService::WorkerService(WorkerOptions options, rpc::HealthReporter* health)
    : options_(std::move(options)), health_(health) {
  // The default backend's device until a Join (and again after Leave).
  absl::MutexLock lock(&state_mu_);
  SetDeviceLocked(options_.default_backend);
  status_.set_memory_cap_bytes(options_.memory_cap_bytes);
  status_.set_state(ToProto(state_.phase()));
  status_.mutable_counters();
  UpdateHealthLocked();
}

WorkerService::~WorkerService() = default;

void WorkerService::SetListenAddress(const std::string& address) {
  absl::MutexLock lock(&state_mu_);
  status_.set_listen_address(address);
}

void WorkerService::BeginShutdown() {
  absl::MutexLock lock(&state_mu_);
  shutting_down_ = true;
}

grpc::Status WorkerService::Finish(const absl::Status& status) {
  if (!status.ok()) {
    absl::MutexLock lock(&state_mu_);
    status_.mutable_counters()->set_errors(status_.counters().errors() + 1);
  }
  return rpc::ToGrpcStatus(CapMessage(status));
}

grpc::Status WorkerService::FinishCollective(const absl::Status& status) {
  {
    absl::MutexLock lock(&state_mu_);
    v1::Counters* counters = status_.mutable_counters();
    if (status.ok()) {
      counters->set_consecutive_failed_collectives(0);
    } else if (IsGroupError(status)) {
      counters->set_consecutive_failed_collectives(counters->consecutive_failed_collectives() + 1);
    }
    UpdateHealthLocked();
  }
  return Finish(status);
}

absl::Status WorkerService::Leased(const char* rpc, const v1::LeaseClaim& claim,
                                   absl::FunctionRef<absl::Status(absl::Status)> fn) {
  absl::Status refused = ValidateLeaseClaim(claim, "lease.");
  if (refused.ok()) refused = lease_.Check(rpc, claim);
  absl::Status status = fn(refused);
  if (status.ok()) lease_.Apply(claim);
  return status;
}

absl::Status WorkerService::EnterLeasedGroup(SlotLease& slot, const grpc::ServerContext* context,
                                             const char* rpc, WorkerPhase phase,
                                             const absl::Status& refused) {
  const absl::Status entered = EnterGroup(slot, context, rpc, phase);
  // Not in a group: there is no vote to take part in; the refusal is the
  // more useful answer.
  if (!entered.ok()) return refused.ok() ? entered : refused;
  return absl::OkStatus();
}

void WorkerService::OnGroupBroken(const std::string& reason) {
  absl::MutexLock lock(&state_mu_);
  state_.MarkBroken(reason);
  UpdateHealthLocked();
}

void WorkerService::OnMaskAdopted(const RankMaskState& mask) {
  const std::vector<int> masked_ranks = mask.MaskedRanks();
  absl::MutexLock lock(&state_mu_);
  status_.mutable_masked_ranks()->Assign(masked_ranks.begin(), masked_ranks.end());
  status_.set_mask_round(mask.round);
  status_.set_mask_host(mask.host);
}

std::string WorkerService::SelfAddress() {
  absl::MutexLock lock(&state_mu_);
  return status_.listen_address();
}

absl::Status WorkerService::RequireGroup(WorkerPhase phase, const char* rpc) {
  absl::MutexLock lock(&state_mu_);
  if (shutting_down_) return absl::UnavailableError(absl::StrCat(rpc, ": worker is shutting down"));
  return state_.RequireGroup(phase, rpc, session_.args().generation);
}

absl::Status WorkerService::EnterGroup(SlotLease& slot, const grpc::ServerContext* context,
                                       const char* rpc, WorkerPhase phase) {
  RETURN_IF_ERROR(slot.Acquire(context, rpc));
  if (!RequireGroup(WorkerPhase::kJoined, rpc).ok()) return RequireGroup(phase, rpc);
  // A pending mask round is applied before the call looks at the plane, so
  // its checks (RequireNoMask) and its collective are the survivors'.
  return session_.BeginCall(context, rpc);
}

absl::Status WorkerService::RequirePhase(WorkerPhase phase, const char* rpc) {
  absl::MutexLock lock(&state_mu_);
  return state_.Require(phase, rpc);
}

MemoryBudget WorkerService::Budget() const {
  return MemoryBudget{options_.memory_cap_bytes,
                      session_.formed() ? session_.plane()->allocated_bytes() : 0, expert_bytes_};
}

void WorkerService::SetDeviceLocked(const std::string& backend) {
  const DeviceInfo device = DescribeBackendDevice(backend, options_.device);
  status_.set_device_name(device.name);
  status_.set_device_memory_bytes(device.memory_bytes);
}

void WorkerService::UpdateHealthLocked() {
  status_.set_state(ToProto(state_.phase()));
  status_.set_group_broken(state_.broken());
  status_.set_broken_reason(state_.broken_reason());
  const bool joined = state_.phase() != WorkerPhase::kStarted;
  core::SetLogContext(joined ? status_.rank() : -1, status_.generation(), status_.geometry_epoch());
  if (health_ != nullptr) {
    health_->SetReady(
        state_.phase() == WorkerPhase::kAllocated && !state_.broken() && !shutting_down_ &&
        status_.counters().consecutive_failed_collectives() < kFailedCollectivesNotReady);
  }
}

void WorkerService::TearDownGroup() {
  session_.TearDown();
  expert_bytes_ = 0;
  expert_specs_.clear();
  allocation_.reset();
  geometry_committed_ = false;
  plan_.clear();
  model_.Clear();
  absl::MutexLock lock(&state_mu_);
  state_.Left();
  status_.set_rank(0);
  status_.set_world_size(0);
  status_.set_backend("");
  status_.set_data_plane("");
  status_.set_plan_summary("");
  status_.set_workspace_bytes(0);
  status_.set_geometry_epoch(0);
  status_.set_runtime_max_tokens_per_rank(0);
  status_.set_capacity_tokens(0);
  status_.set_expert_bytes(0);
  status_.clear_expert_tokens();
  status_.clear_masked_ranks();
  status_.set_mask_round(0);
  status_.set_mask_host(0);
  SetDeviceLocked(options_.default_backend);
  UpdateHealthLocked();
}

// ---------------------------------------------------------------- GetStatus

grpc::Status WorkerService::GetStatus(grpc::ServerContext* /*context*/,
                                      const v1::GetStatusRequest* /*request*/,
                                      v1::GetStatusResponse* response) {
  {
    absl::MutexLock lock(&state_mu_);
    *response = status_;
    response->set_state(ToProto(state_.phase()));
  }
  lease_.Fill(response);
  return grpc::Status::OK;
}

// -------------------------------------------------------------------- Lease

grpc::Status WorkerService::Lease(grpc::ServerContext* /*context*/, const v1::LeaseRequest* request,
                                  v1::LeaseResponse* response) {
  return Finish(RunGuarded("Lease", [&]() -> absl::Status {
    {
      absl::MutexLock lock(&state_mu_);
      if (shutting_down_) return absl::UnavailableError("Lease: worker is shutting down");
    }
    ASSIGN_OR_RETURN(*response, lease_.Handle(*request));
    return absl::OkStatus();
  }));
}

// ---------------------------------------------------------- ConfigureLayers

grpc::Status WorkerService::ConfigureLayers(grpc::ServerContext* context,
                                            const v1::ConfigureLayersRequest* request,
                                            v1::ConfigureLayersResponse* response) {
  return FinishCollective(RunGuarded("ConfigureLayers", [&] {
    return Leased("ConfigureLayers", request->lease(), [&](const absl::Status& refused) {
      return DoConfigureLayers(context, *request, refused, response);
    });
  }));
}

absl::Status WorkerService::DoConfigureLayers(grpc::ServerContext* context,
                                              const v1::ConfigureLayersRequest& request,
                                              const absl::Status& refused,
                                              v1::ConfigureLayersResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(
      EnterLeasedGroup(slot, context, "ConfigureLayers", WorkerPhase::kJoined, refused));
  // A lease refusal is this rank's own error in the vote: its peers are
  // ABORTED at once, naming it and the owner (issue 12).
  absl::StatusOr<LayerConfig> config =
      refused.ok() ? LayerConfigFromRequest(options_.limits, request, session_.args().world_size)
                   : absl::StatusOr<LayerConfig>(refused);
  RETURN_IF_ERROR(session_.Vote("ConfigureLayers", config.status(), LayerConfigFields(request)));

  const int num_sparse = FillPlanReply(config->plan, response);
  response->set_fingerprint(core::Hex64(LayerConfigFingerprint(request, *config)));
  plan_ = std::move(config->plan);
  model_ = request.model();
  session_.layer_stack().Configure(config->layout, config->sparse, config->a2a_enabled, model_);
  absl::MutexLock lock(&state_mu_);
  state_.Configured();
  status_.set_plan_summary(absl::StrCat(plan_.size(), " layers, ", num_sparse, " sparse"));
  spdlog::debug("ConfigureLayers: planned {} layers ({} sparse) for hidden_size {}", plan_.size(),
                num_sparse, model_.hidden_size());
  UpdateHealthLocked();
  return absl::OkStatus();
}

// -------------------------------------------------------- AllocateWorkspace

grpc::Status WorkerService::AllocateWorkspace(grpc::ServerContext* context,
                                              const v1::AllocateWorkspaceRequest* request,
                                              v1::AllocateWorkspaceResponse* response) {
  return FinishCollective(RunGuarded("AllocateWorkspace", [&] {
    return Leased("AllocateWorkspace", request->lease(), [&](const absl::Status& refused) {
      return DoAllocateWorkspace(context, *request, refused, response);
    });
  }));
}

absl::StatusOr<core::EpDispatcherOptions> WorkerService::PrepareAllocation(
    const v1::AllocateWorkspaceRequest& request, bool* same_spec) {
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kConfigured, "AllocateWorkspace"));
  ASSIGN_OR_RETURN(
      core::EpDispatcherOptions options,
      AllocationFromRequest(options_.limits, request, session_.args().world_size, model_));
  RETURN_IF_ERROR(core::ValidateDispatchDType(options.workspace.dtype, session_.plane()->limits()));
  *same_spec = allocation_ != nullptr && allocation_->fingerprint == AllocationFingerprint(options);
  ASSIGN_OR_RETURN(core::AllocatedWorkspace allocated,
                   core::ComputeAllocatedWorkspace(options.workspace));
  // The memory cap covers the workspace and the expert weights kept with it
  // (a different spec drops the loaded experts).
  RETURN_IF_ERROR(
      CheckWorkspaceFits(Budget(), allocated.total_bytes, *same_spec ? expert_bytes_ : 0));
  return options;
}

absl::Status WorkerService::DoAllocateWorkspace(grpc::ServerContext* context,
                                                const v1::AllocateWorkspaceRequest& request,
                                                const absl::Status& refused,
                                                v1::AllocateWorkspaceResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(
      EnterLeasedGroup(slot, context, "AllocateWorkspace", WorkerPhase::kConfigured, refused));
  bool same_spec = false;
  absl::StatusOr<core::EpDispatcherOptions> options =
      refused.ok() ? PrepareAllocation(request, &same_spec)
                   : absl::StatusOr<core::EpDispatcherOptions>(refused);
  RETURN_IF_ERROR(
      session_.Vote("AllocateWorkspace", options.status(),
                    options.ok() ? AllocationFields(*options) : std::vector<core::BallotField>{}));
  if (!same_spec) RETURN_IF_ERROR(Allocate(*options));
  *response = allocation_->response;
  absl::MutexLock lock(&state_mu_);
  state_.Allocated();
  status_.set_workspace_bytes(allocation_->response.allocated_bytes());
  status_.set_capacity_tokens(options->workspace.capacity_tokens);
  status_.set_expert_bytes(expert_bytes_);
  spdlog::debug("AllocateWorkspace: {} ({} bytes, capacity {} tokens a rank)",
                same_spec ? "same spec, workspace and experts kept" : "new workspace",
                allocation_->response.allocated_bytes(), options->workspace.capacity_tokens);
  if (!same_spec) {
    status_.set_geometry_epoch(0);
    status_.set_runtime_max_tokens_per_rank(0);
    status_.clear_expert_tokens();  // the new data plane's load statistics start at zero
  }
  UpdateHealthLocked();
  return absl::OkStatus();
}

absl::Status WorkerService::Allocate(const core::EpDispatcherOptions& options) {
  // Replaces the data plane's workspace and drops its experts.
  ASSIGN_OR_RETURN(DataPlaneAllocation held,
                   session_.plane()->Allocate(options, model_.moe_intermediate_size(),
                                              options_.memory_cap_bytes));
  auto allocation = std::make_unique<Allocation>();
  allocation->options = options;
  allocation->fingerprint = AllocationFingerprint(options);
  ASSIGN_OR_RETURN(allocation->response, AllocationReply(options, held));
  allocation_ = std::move(allocation);
  geometry_committed_ = false;
  expert_bytes_ = 0;
  expert_specs_.clear();
  return absl::OkStatus();
}

// -------------------------------------------------------------- LoadExperts

grpc::Status WorkerService::LoadExperts(grpc::ServerContext* context,
                                        const v1::LoadExpertsRequest* request,
                                        v1::LoadExpertsResponse* response) {
  return Finish(RunGuarded("LoadExperts", [&] {
    return Leased("LoadExperts", request->lease(), [&](const absl::Status& refused) {
      return DoLoadExperts(context, *request, refused, response);
    });
  }));
}

absl::StatusOr<ExpertLoad> WorkerService::PrepareExpertLoad(const v1::LoadExpertsRequest& request) {
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "LoadExperts"));
  const int requested_layer = request.layer();
  const std::shared_ptr<const core::PlacementTable> table =
      requested_layer >= 0 ? session_.plane()->Placement(requested_layer) : nullptr;
  const ExpertLoadContext state{&plan_,
                                &model_,
                                &allocation_->options,
                                session_.args().world_size,
                                session_.args().rank,
                                options_.checkpoint_dirs,
                                table.get()};
  ASSIGN_OR_RETURN(ExpertLoad load, ExpertLoadFromRequest(options_.limits, request, state));
  RETURN_IF_ERROR(CheckExpertsFit(Budget(), load.layer, load.weight_bytes,
                                  session_.plane()->ExpertBytes(load.layer))
                      .status());
  return load;
}

absl::Status WorkerService::DoLoadExperts(grpc::ServerContext* context,
                                          const v1::LoadExpertsRequest& request,
                                          const absl::Status& refused,
                                          v1::LoadExpertsResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterLeasedGroup(slot, context, "LoadExperts", WorkerPhase::kAllocated, refused));
  absl::StatusOr<ExpertLoad> load =
      refused.ok() ? PrepareExpertLoad(request) : absl::StatusOr<ExpertLoad>(refused);
  // Local only, as worker.proto says (issue 29 item 3): no vote, so a
  // coordinator may load rank by rank and retry one rank. The ranks'
  // agreement on what each layer holds is checked by the next Forward's
  // vote (ExpertSpecField), and a rank without the layer's experts rejects
  // that Forward itself.
  RETURN_IF_ERROR(load.status());
  const int64_t hidden = allocation_->options.workspace.hidden;
  const int64_t old_bytes = session_.plane()->ExpertBytes(load->layer);
  ASSIGN_OR_RETURN(int64_t total,
                   CheckExpertsFit(Budget(), load->layer, load->weight_bytes, old_bytes));
  const core::ExpertSource source = MakeExpertSource(*load, request, allocation_->options);
  RETURN_IF_ERROR(core::ValidateExpertSource(source));
  // The shared expert is made (and checked) before anything is replaced.
  const int64_t old_shared = session_.plane()->SharedExpertBytes(load->layer);
  ASSIGN_OR_RETURN(std::optional<core::SharedExpert> shared,
                   MakeSharedExpert(request, load->checkpoint, hidden, total - old_shared,
                                    options_.memory_cap_bytes));
  // The plane makes the experts from the source (the GPU plane on its device,
  // without a host copy; core/expert_source.h) and may grow its expert scratch.
  ASSIGN_OR_RETURN(int64_t bytes,
                   session_.plane()->LoadExperts(load->layer, source, options_.memory_cap_bytes));
  expert_bytes_ += bytes - old_bytes;
  ASSIGN_OR_RETURN(int64_t shared_bytes,
                   session_.plane()->LoadSharedExpert(load->layer, std::move(shared),
                                                      options_.memory_cap_bytes));
  expert_bytes_ += shared_bytes - old_shared;
  expert_specs_[load->layer] = ExpertSpecFingerprint(ExpertLoadFields(request, *load));
  response->set_first_expert(load->first_expert);
  response->set_num_local_experts(load->num_local_experts);
  response->set_expert_bytes(bytes);
  response->set_shared_expert_bytes(shared_bytes);
  response->mutable_slot_experts()->Assign(load->slot_experts.begin(), load->slot_experts.end());
  spdlog::debug("LoadExperts: layer {}, {} local experts from id {}, {} expert bytes, {} shared",
                load->layer, load->num_local_experts, load->first_expert, bytes, shared_bytes);
  absl::MutexLock lock(&state_mu_);
  status_.set_expert_bytes(expert_bytes_);
  status_.set_workspace_bytes(session_.plane()->allocated_bytes());
  return absl::OkStatus();
}

// ---------------------------------------------------------- SyncTokenCounts

grpc::Status WorkerService::SyncTokenCounts(grpc::ServerContext* context,
                                            const v1::SyncTokenCountsRequest* request,
                                            v1::SyncTokenCountsResponse* response) {
  return FinishCollective(RunGuarded(
      "SyncTokenCounts", [&] { return DoSyncTokenCounts(context, *request, response); }));
}

absl::Status WorkerService::DoSyncTokenCounts(grpc::ServerContext* context,
                                              const v1::SyncTokenCountsRequest& request,
                                              v1::SyncTokenCountsResponse* response) {
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "SyncTokenCounts", WorkerPhase::kAllocated));
  absl::Status local = RequirePhase(WorkerPhase::kAllocated, "SyncTokenCounts");
  if (local.ok()) local = CheckSyncTokenCounts(request);
  if (local.ok()) local = RequireReadmitted("SyncTokenCounts");
  RETURN_IF_ERROR(session_.Vote("SyncTokenCounts", local, {{"epoch", request.epoch()}}));
  absl::StatusOr<std::vector<int64_t>> counts =
      session_.plane()->SyncTokenCounts(request.local_tokens());
  RETURN_IF_ERROR(session_.GroupResult("SyncTokenCounts", counts.status()));
  const core::EpDispatcherOptions& options = allocation_->options;
  ASSIGN_OR_RETURN(int64_t runtime_max,
                   core::ChooseRuntimeMaxTokens(*counts, options.cuda_graph_buckets,
                                                options.workspace.capacity_tokens));
  response->mutable_token_counts()->Assign(counts->begin(), counts->end());
  response->set_max_tokens(*std::max_element(counts->begin(), counts->end()));
  response->set_runtime_max_tokens_per_rank(runtime_max);
  spdlog::debug(
      "SyncTokenCounts: epoch {}, local {} tokens, ranks [{}] -> "
      "runtime_max_tokens_per_rank {}",
      request.epoch(), request.local_tokens(), absl::StrJoin(*counts, ","), runtime_max);
  return absl::OkStatus();
}

// ----------------------------------------------------------- CommitGeometry

grpc::Status WorkerService::CommitGeometry(grpc::ServerContext* context,
                                           const v1::CommitGeometryRequest* request,
                                           v1::CommitGeometryResponse* /*response*/) {
  return Finish(RunGuarded("CommitGeometry", [&] { return DoCommitGeometry(context, *request); }));
}

// Not a collective (each rank records its own geometry; the ranks' (epoch,
// R) agreement is checked by the next Forward), so there is no vote.
absl::Status WorkerService::DoCommitGeometry(grpc::ServerContext* context,
                                             const v1::CommitGeometryRequest& request) {
  RETURN_IF_ERROR(CheckCommitGeometry(request));
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "CommitGeometry", WorkerPhase::kAllocated));
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "CommitGeometry"));
  RETURN_IF_ERROR(session_.plane()->CommitGeometry(
      request.epoch(), request.runtime_max_tokens_per_rank(), request.local_tokens()));
  geometry_committed_ = true;
  absl::MutexLock lock(&state_mu_);
  status_.set_geometry_epoch(request.epoch());
  status_.set_runtime_max_tokens_per_rank(request.runtime_max_tokens_per_rank());
  spdlog::debug("CommitGeometry: epoch {}, runtime_max_tokens_per_rank {}, local {} tokens",
                request.epoch(), request.runtime_max_tokens_per_rank(), request.local_tokens());
  UpdateHealthLocked();  // the log fields carry the epoch
  return absl::OkStatus();
}

// ------------------------------------------------------------------ Forward

grpc::Status WorkerService::Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) {
  return FinishCollective(
      RunGuarded("Forward", [&] { return DoForward(context, *request, response); }));
}

absl::Status WorkerService::RequireReadmitted(const char* call) const {
  if (!session_.args().rejoin || session_.plane()->mask().round != 0) return absl::OkStatus();
  return absl::FailedPreconditionError(
      absl::StrCat(call, ": rank ", session_.args().rank,
                   " joined alone to take its masked rank back (JoinRequest.rejoin) and is not "
                   "re-admitted yet; call Rejoin on it and on the live ranks first"));
}

absl::StatusOr<ForwardInputs> WorkerService::PrepareForward(const v1::ForwardRequest& request) {
  RETURN_IF_ERROR(RequirePhase(WorkerPhase::kAllocated, "Forward"));
  RETURN_IF_ERROR(RequireReadmitted("Forward"));
  ASSIGN_OR_RETURN(ForwardInputs in,
                   ForwardFromRequest(options_.limits, request, allocation_->options));
  if (!session_.plane()->HasExperts(in.layer)) {
    return session_.plane()->ExpertsNotLoaded("Forward", in.layer);
  }
  if (!geometry_committed_) {
    return absl::FailedPreconditionError(
        "Forward requires a committed geometry; call SyncTokenCounts and CommitGeometry first");
  }
  if (in.epoch != session_.plane()->epoch()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Forward: epoch ", in.epoch, " does not match the committed geometry epoch ",
        session_.plane()->epoch(), "; call CommitGeometry for epoch ", in.epoch, " first"));
  }
  return in;
}

absl::Status WorkerService::DoForward(grpc::ServerContext* context,
                                      const v1::ForwardRequest& request,
                                      v1::ForwardResponse* response) {
  const absl::Time start = absl::Now();
  SlotLease slot(&slot_);
  RETURN_IF_ERROR(EnterGroup(slot, context, "Forward", WorkerPhase::kAllocated));
  absl::StatusOr<ForwardInputs> in = PrepareForward(request);
  std::vector<core::BallotField> fields;
  if (in.ok()) {
    fields = ForwardFields(*in);
    auto spec = expert_specs_.find(in->layer);
    fields.push_back(
        {"experts of the layer (LoadExperts kind, intermediate_size, seed, "
         "safetensors_path, name_pattern)",
         spec != expert_specs_.end() ? spec->second : 0, /*is_fingerprint=*/true});
  }
  RETURN_IF_ERROR(session_.Vote("Forward", in.status(), std::move(fields)));
  const int64_t hidden = allocation_->options.workspace.hidden;
  // The data plane reads the request's bytes and writes the reply's: one
  // host copy each way (issue 11 item 2).
  v1::Tensor* output = response->mutable_output();
  absl::StatusOr<core::StepStats> stats =
      session_.plane()->ForwardBytes(in->layer, in->tensors, in->tokens, output->mutable_data());
  RETURN_IF_ERROR(session_.GroupResult("Forward", stats.status()));
  output->set_dtype(v1::DTYPE_BF16);
  output->add_shape(in->tokens);
  output->add_shape(hidden);
  FillForwardReply(*stats, absl::Now() - start, response);
  const std::vector<int64_t> totals = session_.plane()->ExpertTokenTotals(in->layer);
  absl::MutexLock lock(&state_mu_);
  SetExpertTokensLocked(in->layer, totals);
  v1::Counters* counters = status_.mutable_counters();
  counters->set_forwards(counters->forwards() + 1);
  counters->set_tokens_dispatched(counters->tokens_dispatched() + stats->tokens_sent);
  counters->set_bytes_sent(counters->bytes_sent() + stats->bytes_sent_remote);
  spdlog::debug("Forward: layer {}, {} tokens, {} token-copies dispatched, {} bytes to peers",
                in->layer, in->tokens, stats->tokens_sent, stats->bytes_sent_remote);
  return absl::OkStatus();
}

// --------------------------------------------------------------------- Echo

grpc::Status WorkerService::Echo(grpc::ServerContext* /*context*/, const v1::EchoRequest* request,
                                 v1::EchoResponse* response) {
  return Finish(RunGuarded("Echo", [&]() -> absl::Status {
    {
      absl::MutexLock lock(&state_mu_);
      if (shutting_down_) return absl::UnavailableError("Echo: worker is shutting down");
    }
    if (!options_.enable_echo) {
      return absl::UnimplementedError(
          "Echo is a test-only RPC; this worker serves it only when started with --enable-echo");
    }
    const v1::Tensor& tensor = request->tensor();
    RETURN_IF_ERROR(ValidateTensor(tensor, "tensor", tensor.shape_size()));
    *response->mutable_tensor() = tensor;
    return absl::OkStatus();
  }));
}

}  // namespace moe_ep::server
