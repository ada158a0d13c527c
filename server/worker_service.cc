#include "server/worker_service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "core/agreement.h"
#include "core/ep_contract.h"
#include "core/expert_placement.h"
#include "core/expert_source.h"
#include "core/geometry.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "gloo/rendezvous/hash_store.h"
#include "server/device_info.h"
#include "server/grpc_store.h"
#include "server/logging.h"
#include "server/path_policy.h"
#include "server/request_limits.h"
#include "server/shared_expert_request.h"
#include "server/status_conversion.h"
#include "server/tensor_codec.h"
#include "spdlog/spdlog.h"

namespace moe_ep::server {
namespace {

// Largest sizes a request may ask for; beyond them a multiplication of sizes
// could overflow int64 before the memory cap is consulted.
constexpr int64_t kMaxHidden = int64_t{1} << 20;
constexpr int64_t kMaxTokens = int64_t{1} << 24;
constexpr int kMaxExperts = 1 << 16;
constexpr int kMaxBenchmarkIterations = 100000;

using core::Fingerprint64;
using core::Hex64;

absl::Time CallDeadline(const grpc::ServerContext* context) {
  if (context == nullptr) return absl::InfiniteFuture();
  const auto deadline = context->deadline();
  if (deadline == std::chrono::system_clock::time_point::max()) return absl::InfiniteFuture();
  return absl::FromChrono(deadline);
}

// Errors of a collective that leave the group unusable.
bool IsGroupError(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kUnknown:
    case absl::StatusCode::kInternal:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kDataLoss:
      return true;
    case absl::StatusCode::kFailedPrecondition:
      return absl::StrContains(status.message(), "group broken");
    default:
      return false;
  }
}

v1::ScatterMode ToProto(core::ScatterMode mode) {
  switch (mode) {
    case core::ScatterMode::kScattered:
      return v1::SCATTER_MODE_SCATTERED;
    case core::ScatterMode::kTpAttnFull:
      return v1::SCATTER_MODE_TP_ATTN_FULL;
    case core::ScatterMode::kFull:
      return v1::SCATTER_MODE_FULL;
  }
  return v1::SCATTER_MODE_UNSPECIFIED;
}

absl::Status Positive(absl::string_view field, int64_t value, int64_t max) {
  if (value < 1 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected in [1, ", max, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status NonNegative(absl::string_view field, int64_t value) {
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected >= 0, got ", value));
  }
  return absl::OkStatus();
}

// The MoE sizes of AllocateWorkspace and Benchmark: the contract's one rule.
absl::Status CheckMoeSizes(int64_t hidden_size, int num_experts, int top_k) {
  return core::ValidateMoeSizes(hidden_size, num_experts, top_k, kMaxHidden, kMaxExperts);
}

// Contiguous placement gives every rank at least one expert: num_experts >= world.
absl::Status CheckEveryRankOwnsAnExpert(int num_experts, int world) {
  if (num_experts < world) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_experts: expected >= ", world,
                     " (the world size: every rank owns an expert), got ", num_experts));
  }
  return absl::OkStatus();
}

// A request size against the ConfigureLayers model's: equal, or the model
// left it 0 (unset).
absl::Status MatchesConfiguredModel(absl::string_view field, int64_t configured,
                                    int64_t requested) {
  if (configured > 0 && requested != configured) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected ", configured, " (the configured model), got ", requested));
  }
  return absl::OkStatus();
}

absl::StatusOr<core::DispatchDType> ToCore(v1::DispatchDType dtype) {
  switch (dtype) {
    case v1::DISPATCH_DTYPE_UNSPECIFIED:
    case v1::DISPATCH_DTYPE_BF16:
      return core::DispatchDType::kBF16;
    case v1::DISPATCH_DTYPE_NVFP4:
      return core::DispatchDType::kNVFP4;
    case v1::DISPATCH_DTYPE_MXFP8:
      return core::DispatchDType::kMXFP8;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dispatch_dtype: expected DISPATCH_DTYPE_BF16, _NVFP4 or _MXFP8, got ", dtype));
  }
}

// What GetStatus reports for `backend` ("auto" resolved here): the CUDA
// device for NCCL, the host for Gloo (and when the device cannot be read).
DeviceInfo DeviceFor(const std::string& backend, int device) {
  absl::StatusOr<std::string> resolved = ResolveBackend(backend, "auto");
  if (resolved.ok() && *resolved == "nccl") {
    absl::StatusOr<DeviceInfo> gpu = DescribeGpu(device);
    if (gpu.ok()) return *gpu;
  }
  return DescribeHost();
}

// Nearest-rank percentile of ascending `sorted` (p in (0, 100]).
double Percentile(const std::vector<double>& sorted, double p) {
  if (sorted.empty()) return 0.0;
  size_t rank = static_cast<size_t>(std::ceil(p / 100.0 * sorted.size()));
  rank = std::clamp<size_t>(rank, 1, sorted.size());
  return sorted[rank - 1];
}

// K distinct experts per token, drawn from `weights` (proportional) without
// replacement; ids [T, K] row-major.
std::vector<int32_t> SampleRouting(std::mt19937_64& rng, int64_t tokens, int top_k,
                                   const std::vector<double>& weights) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * top_k);
  std::vector<double> w(weights.size());
  for (int64_t t = 0; t < tokens; ++t) {
    w = weights;
    for (int k = 0; k < top_k; ++k) {
      std::discrete_distribution<int32_t> pick(w.begin(), w.end());
      const int32_t e = pick(rng);
      ids[t * top_k + k] = e;
      w[e] = 0.0;
    }
  }
  return ids;
}

}  // namespace

// Holds the collective slot for one call; released on destruction.
class WorkerService::CollectiveSlot {
 public:
  explicit CollectiveSlot(WorkerService* service) : service_(service) {}
  CollectiveSlot(const CollectiveSlot&) = delete;
  CollectiveSlot& operator=(const CollectiveSlot&) = delete;
  ~CollectiveSlot() {
    if (!held_) return;
    absl::MutexLock lock(&service_->slot_mu_);
    service_->slot_free_ = true;
  }

  // Waits for the slot until the call's deadline.
  absl::Status Acquire(const grpc::ServerContext* context, absl::string_view rpc) {
    // A call whose deadline passed or whose client gave up (while queued in
    // gRPC or waiting here) does no collective work at all.
    const absl::Time deadline = CallDeadline(context);
    if (absl::Now() >= deadline) {
      return absl::DeadlineExceededError(
          absl::StrCat(rpc, ": the call's deadline passed before it started"));
    }
    absl::MutexLock lock(&service_->slot_mu_);
    if (!service_->slot_mu_.AwaitWithDeadline(absl::Condition(&service_->slot_free_), deadline)) {
      return absl::DeadlineExceededError(absl::StrCat(
          rpc, ": another collective call kept this worker busy past the call's deadline"));
    }
    if (context != nullptr && context->IsCancelled()) {
      return absl::CancelledError(absl::StrCat(rpc, ": the client cancelled the call"));
    }
    service_->slot_free_ = false;
    held_ = true;
    return absl::OkStatus();
  }

  // Acquire, then RequireGroup(phase): the worker is in a usable group at
  // `phase` or later.
  absl::Status Acquire(const grpc::ServerContext* context, const char* rpc, WorkerPhase phase) {
    RETURN_IF_ERROR(Acquire(context, rpc));
    return service_->RequireGroup(phase, rpc);
  }

 private:
  WorkerService* service_;
  bool held_ = false;
};

WorkerService::WorkerService(WorkerOptions options, HealthReporter* health)
    : options_(std::move(options)), health_(health) {
  // The device of the default backend until a group is formed (Join shows
  // the joined backend's device, Leave the default's again).
  const DeviceInfo device = DeviceFor(options_.default_backend, options_.device);
  absl::MutexLock lock(&state_mu_);
  status_.set_device_name(device.name);
  status_.set_device_memory_bytes(device.memory_bytes);
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
  return ToGrpcStatus(CapMessage(status));
}

absl::Status WorkerService::GroupResult(absl::Status status) {
  if (status.ok() || !IsGroupError(status)) return status;
  spdlog::warn("collective failed, group of generation {} is broken: {}", joined_.generation,
               status.ToString());
  absl::MutexLock lock(&state_mu_);
  state_.MarkBroken(std::string(status.message()));
  UpdateHealthLocked();
  return status;
}

absl::Status WorkerService::RequireGroup(WorkerPhase phase, const char* rpc) {
  absl::MutexLock lock(&state_mu_);
  if (shutting_down_) return absl::UnavailableError(absl::StrCat(rpc, ": worker is shutting down"));
  return state_.RequireGroup(phase, rpc, joined_.generation);
}

void WorkerService::UpdateHealthLocked() {
  status_.set_state(ToProto(state_.phase()));
  const bool joined = state_.phase() != WorkerPhase::kStarted;
  SetLogContext(joined ? status_.rank() : -1, status_.generation(), status_.geometry_epoch());
  if (health_ != nullptr) {
    health_->SetReady(state_.phase() == WorkerPhase::kAllocated && !state_.broken() &&
                      !shutting_down_);
  }
}

absl::Status WorkerService::Vote(const char* rpc, absl::Status local,
                                 std::vector<core::BallotField> fields) {
  core::Ballot ballot;
  ballot.rpc = rpc;
  ballot.generation = joined_.generation;
  ballot.sequence = vote_sequence_++;
  ballot.local = std::move(local);
  ballot.fields = std::move(fields);
  return GroupResult(core::RunVote(data_plane_->collective(), ballot));
}

void WorkerService::TearDownGroup() {
  vote_sequence_ = 0;
  layer_stack_.Reset();  // before the data plane its sub-groups point into
  expert_bytes_ = 0;
  allocation_.reset();
  geometry_committed_ = false;
  plan_.clear();
  model_.Clear();
  data_plane_.reset();
  absl::MutexLock lock(&state_mu_);
  state_.Left();
  status_.set_rank(0);
  status_.set_world_size(0);
  status_.set_backend("");
  status_.set_plan_summary("");
  status_.set_workspace_bytes(0);
  status_.set_geometry_epoch(0);
  status_.set_runtime_max_tokens_per_rank(0);
  status_.set_capacity_tokens(0);
  status_.set_expert_bytes(0);
  const DeviceInfo device = DeviceFor(options_.default_backend, options_.device);
  status_.set_device_name(device.name);
  status_.set_device_memory_bytes(device.memory_bytes);
  UpdateHealthLocked();
}

// ---------------------------------------------------------------- GetStatus

grpc::Status WorkerService::GetStatus(grpc::ServerContext* /*context*/,
                                      const v1::GetStatusRequest* /*request*/,
                                      v1::GetStatusResponse* response) {
  absl::MutexLock lock(&state_mu_);
  *response = status_;
  response->set_state(ToProto(state_.phase()));
  return grpc::Status::OK;
}

// --------------------------------------------------------------------- Join

grpc::Status WorkerService::Join(grpc::ServerContext* context, const v1::JoinRequest* request,
                                 v1::JoinResponse* response) {
  return Finish(RunGuarded("Join", [&] { return DoJoin(context, *request, response); }));
}

absl::Status WorkerService::DoJoin(grpc::ServerContext* context, const v1::JoinRequest& request,
                                   v1::JoinResponse* response) {
  RETURN_IF_ERROR(CheckJoin(options_.limits, request));
  if (request.world_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: expected >= 1, got ", request.world_size()));
  }
  if (request.rank() < 0 || request.rank() >= request.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: expected in [0, ", request.world_size(),
                                                   ") (world_size ", request.world_size(),
                                                   "), got ", request.rank()));
  }
  if (request.generation() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation: expected >= 1, got ", request.generation()));
  }
  RETURN_IF_ERROR(NonNegative("timeout_ms", request.timeout_ms()));
  if (request.world_size() > 1 && request.rendezvous_address().empty()) {
    return absl::InvalidArgumentError(
        "rendezvous_address: required (host:port of rank 0's worker) when world_size > 1");
  }
  ASSIGN_OR_RETURN(std::string backend,
                   ResolveBackend(request.backend(), options_.default_backend));
  RETURN_IF_ERROR(CheckDevice(options_.device, VisibleGpuCount(), backend));
  JoinArgs args;
  args.world_size = request.world_size();
  args.rank = request.rank();
  args.backend = backend;
  args.rendezvous_address = request.rendezvous_address();
  args.generation = request.generation();
  args.timeout = request.timeout_ms() > 0 ? absl::Milliseconds(request.timeout_ms())
                                          : options_.default_timeout;
  args.data_plane_host =
      request.data_plane_host().empty() ? options_.data_plane_host : request.data_plane_host();
  args.rendezvous_secret = request.rendezvous_secret();

  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "Join"));
  {
    absl::MutexLock lock(&state_mu_);
    if (shutting_down_) return absl::UnavailableError("Join: worker is shutting down");
    if (state_.phase() != WorkerPhase::kStarted && args == joined_ && !state_.broken()) {
      response->set_backend(joined_.backend);
      return absl::OkStatus();  // idempotent
    }
    if (state_.phase() != WorkerPhase::kStarted && args == joined_) {
      return absl::FailedPreconditionError(
          absl::StrCat("Join: the group of generation ", joined_.generation, " is broken (",
                       state_.broken_reason(), "); re-join with a new generation"));
    }
    if (state_.phase() != WorkerPhase::kStarted && args.generation == joined_.generation) {
      return absl::FailedPreconditionError(
          absl::StrCat("Join: already joined generation ", joined_.generation, " as rank ",
                       joined_.rank, " of ", joined_.world_size,
                       " with different arguments; Leave first or join with a new generation"));
    }
  }
  if (args.generation <= max_generation_used_) {
    return absl::FailedPreconditionError(
        absl::StrCat("generation: ", args.generation,
                     " was already used by this worker (rendezvous keys are "
                     "write-once); join with a generation > ",
                     max_generation_used_));
  }

  // A new generation: form the new group, and only then drop the old one (a
  // failed formation leaves the old group in force: issue 13 item 5).
  max_generation_used_ = args.generation;
  {
    absl::MutexLock lock(&state_mu_);
    status_.set_max_generation_seen(max_generation_used_);
  }
  if (args.rank == 0 && options_.rendezvous != nullptr) {
    options_.rendezvous->OpenGeneration(args.generation, args.rendezvous_secret);
  }
  std::shared_ptr<gloo::rendezvous::Store> store;
  if (args.rendezvous_address.empty()) {
    store = std::make_shared<gloo::rendezvous::HashStore>();  // world 1: nobody to meet
  } else {
    // Meeting the peers ends by the call's deadline too (its caller is gone).
    const absl::Duration meet =
        std::clamp(CallDeadline(context) - absl::Now(), absl::Milliseconds(1), args.timeout);
    store = std::make_shared<GrpcStore>(args.rendezvous_address, meet, args.rendezvous_secret);
  }
  spdlog::info("Join: forming {} group generation {} as rank {} of {} via {}", args.backend,
               args.generation, args.rank, args.world_size,
               args.rendezvous_address.empty() ? "an in-process store" : args.rendezvous_address);
  DataPlaneGroup group;
  group.backend = args.backend;
  group.world_size = args.world_size;
  group.rank = args.rank;
  group.generation = args.generation;
  group.timeout = args.timeout;
  group.rendezvous_address = args.rendezvous_address;
  group.data_plane_host = args.data_plane_host;
  group.device = options_.device;
  ASSIGN_OR_RETURN(std::unique_ptr<DataPlane> formed, FormDataPlane(group, store));
  TearDownGroup();
  data_plane_ = std::move(formed);
  if (args.rank == 0 && options_.rendezvous != nullptr) {
    options_.rendezvous->DropGenerationsBelow(args.generation);
  }
  const DeviceInfo device = DeviceFor(args.backend, options_.device);
  joined_ = args;
  {
    absl::MutexLock lock(&state_mu_);
    state_.Joined();
    status_.set_rank(args.rank);
    status_.set_world_size(args.world_size);
    status_.set_generation(args.generation);
    status_.set_backend(args.backend);
    status_.set_device_name(device.name);
    status_.set_device_memory_bytes(device.memory_bytes);
    UpdateHealthLocked();
  }
  response->set_backend(args.backend);
  return absl::OkStatus();
}

// -------------------------------------------------------------------- Leave

grpc::Status WorkerService::Leave(grpc::ServerContext* context, const v1::LeaveRequest* request,
                                  v1::LeaveResponse* /*response*/) {
  return Finish(RunGuarded("Leave", [&] { return DoLeave(context, *request); }));
}

absl::Status WorkerService::DoLeave(grpc::ServerContext* context, const v1::LeaveRequest& request) {
  RETURN_IF_ERROR(NonNegative("generation", request.generation()));
  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "Leave"));
  {
    absl::MutexLock lock(&state_mu_);
    if (state_.phase() == WorkerPhase::kStarted) return absl::OkStatus();  // idempotent
    if (request.generation() != 0 && request.generation() != joined_.generation) {
      return absl::FailedPreconditionError(absl::StrCat("Leave: generation ", request.generation(),
                                                        " does not match the joined generation ",
                                                        joined_.generation));
    }
  }
  spdlog::info("Leave: tearing down generation {}", joined_.generation);
  TearDownGroup();
  return absl::OkStatus();
}

// ---------------------------------------------------------- ConfigureLayers

grpc::Status WorkerService::ConfigureLayers(grpc::ServerContext* context,
                                            const v1::ConfigureLayersRequest* request,
                                            v1::ConfigureLayersResponse* response) {
  return Finish(RunGuarded("ConfigureLayers",
                           [&] { return DoConfigureLayers(context, *request, response); }));
}

absl::Status WorkerService::DoConfigureLayers(grpc::ServerContext* context,
                                              const v1::ConfigureLayersRequest& request,
                                              v1::ConfigureLayersResponse* response) {
  RETURN_IF_ERROR(CheckConfigureLayers(options_.limits, request));
  const v1::ModelDescription& model = request.model();
  if (model.num_layers() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.num_layers: expected >= 1, got ", model.num_layers()));
  }
  if (model.sparse_layers_size() != model.num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.sparse_layers: expected ", model.num_layers(),
                     " entries (model.num_layers), got ", model.sparse_layers_size()));
  }
  RETURN_IF_ERROR(NonNegative("model.hidden_size", model.hidden_size()));
  RETURN_IF_ERROR(NonNegative("model.num_experts", model.num_experts()));
  RETURN_IF_ERROR(NonNegative("model.top_k", model.top_k()));
  RETURN_IF_ERROR(NonNegative("model.moe_intermediate_size", model.moe_intermediate_size()));
  if (model.top_k() > 0 && model.num_experts() > 0 && model.top_k() > model.num_experts()) {
    return absl::InvalidArgumentError(absl::StrCat("model.top_k: expected <= model.num_experts (",
                                                   model.num_experts(), "), got ", model.top_k()));
  }
  core::ParallelLayout layout;
  layout.tp_size = request.layout().tp_size();
  layout.attn_dp_size = request.layout().attn_dp_size();
  layout.moe_dense_tp_size = request.layout().moe_dense_tp_size();
  {
    absl::Status valid = core::ValidateLayout(layout);
    if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("layout: ", valid.message()));
  }
  const std::vector<bool> sparse(model.sparse_layers().begin(), model.sparse_layers().end());
  absl::StatusOr<std::vector<core::LayerPlan>> plan =
      core::PlanLayers(layout, sparse, request.a2a_enabled());
  if (!plan.ok()) return plan.status();

  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "ConfigureLayers", WorkerPhase::kJoined));
  absl::Status local = absl::OkStatus();
  if (layout.tp_size != joined_.world_size) {
    local = absl::InvalidArgumentError(absl::StrCat("layout.tp_size: expected ", joined_.world_size,
                                                    " (the world size), got ", layout.tp_size));
  }
  const std::string plan_fingerprint = core::PlanFingerprint(layout, sparse, request.a2a_enabled());
  const uint64_t fingerprint = Fingerprint64(
      absl::StrCat("plan=", plan_fingerprint, ";model=", model.name(), ",", model.hidden_size(),
                   ",", model.num_layers(), ",", model.num_experts(), ",", model.top_k(), ",",
                   model.moe_intermediate_size()));
  const auto text = [](absl::string_view name, absl::string_view value) {
    return core::BallotField{std::string(name), static_cast<int64_t>(Fingerprint64(value)), true};
  };
  // A request this rank rejects by itself still fails here, before the vote,
  // as it always did (a peer called alone must not wait for the others);
  // failing every rank at once through the vote's local status is issue 12.
  RETURN_IF_ERROR(local);
  RETURN_IF_ERROR(Vote("ConfigureLayers", absl::OkStatus(),
                       {text("plan", plan_fingerprint),
                        text("model.name", model.name()),
                        {"model.hidden_size", model.hidden_size()},
                        {"model.num_layers", model.num_layers()},
                        {"model.num_experts", model.num_experts()},
                        {"model.top_k", model.top_k()},
                        {"model.moe_intermediate_size", model.moe_intermediate_size()}}));

  response->Clear();
  int num_sparse = 0;
  for (const core::LayerPlan& p : *plan) {
    v1::LayerPlan* out = response->add_layers();
    out->set_layer(p.layer);
    out->set_sparse(p.sparse);
    out->set_input_mode(ToProto(p.input));
    out->set_attention_mode(ToProto(p.attention));
    out->set_residual_mode(ToProto(p.residual));
    out->set_mlp_mode(ToProto(p.mlp));
    out->set_output_mode(ToProto(p.output));
    out->set_before_attention(core::StepName(p.before_attention));
    out->set_before_mlp(core::DescribeBeforeMlp(p));
    out->set_after_mlp(core::DescribeAfterMlp(p));
    num_sparse += p.sparse ? 1 : 0;
  }
  response->set_fingerprint(Hex64(fingerprint));
  plan_ = std::move(*plan);
  model_ = model;
  layer_stack_.Configure(layout, sparse, request.a2a_enabled(), model);
  absl::MutexLock lock(&state_mu_);
  state_.Configured();
  status_.set_plan_summary(absl::StrCat(plan_.size(), " layers, ", num_sparse, " sparse"));
  UpdateHealthLocked();
  return absl::OkStatus();
}

// -------------------------------------------------------- AllocateWorkspace

grpc::Status WorkerService::AllocateWorkspace(grpc::ServerContext* context,
                                              const v1::AllocateWorkspaceRequest* request,
                                              v1::AllocateWorkspaceResponse* response) {
  return Finish(RunGuarded("AllocateWorkspace",
                           [&] { return DoAllocateWorkspace(context, *request, response); }));
}

absl::Status WorkerService::DoAllocateWorkspace(grpc::ServerContext* context,
                                                const v1::AllocateWorkspaceRequest& request,
                                                v1::AllocateWorkspaceResponse* response) {
  RETURN_IF_ERROR(CheckAllocateWorkspace(options_.limits, request));
  RETURN_IF_ERROR(CheckMoeSizes(request.hidden_size(), request.num_experts(), request.top_k()));
  RETURN_IF_ERROR(NonNegative("capacity_tokens", request.capacity_tokens()));
  RETURN_IF_ERROR(NonNegative("chunked_prefill_size", request.chunked_prefill_size()));
  const int64_t capacity = request.capacity_tokens() > 0
                               ? request.capacity_tokens()
                               : core::DefaultCapacityTokens(request.chunked_prefill_size());
  RETURN_IF_ERROR(Positive("capacity_tokens", capacity, kMaxTokens));
  ASSIGN_OR_RETURN(core::DispatchDType dtype, ToCore(request.dispatch_dtype()));
  int32_t invalid_id = -1;
  switch (request.invalid_expert_id()) {
    case v1::INVALID_EXPERT_ID_UNSPECIFIED:
    case v1::INVALID_EXPERT_ID_MINUS_ONE:
      break;
    case v1::INVALID_EXPERT_ID_NUM_EXPERTS:
      invalid_id = request.num_experts();
      break;
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("invalid_expert_id: expected INVALID_EXPERT_ID_MINUS_ONE or "
                       "INVALID_EXPERT_ID_NUM_EXPERTS, got ",
                       request.invalid_expert_id()));
  }
  std::vector<int64_t> buckets(request.cuda_graph_buckets().begin(),
                               request.cuda_graph_buckets().end());
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i] < 1 || (i > 0 && buckets[i] <= buckets[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_graph_buckets: expected positive and strictly ascending, got [",
                       absl::StrJoin(buckets, ", "), "]"));
    }
  }

  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "AllocateWorkspace", WorkerPhase::kConfigured));
  const int world = joined_.world_size;
  core::EpDispatcherOptions options;
  options.workspace.ep_size = world;
  options.workspace.capacity_tokens = capacity;
  options.workspace.hidden = request.hidden_size();
  options.workspace.top_k = request.top_k();
  options.workspace.dtype = dtype;
  options.num_experts = request.num_experts();
  options.invalid_expert_id = invalid_id;
  options.cuda_graph_buckets = buckets;
  const uint64_t fingerprint = Fingerprint64(absl::StrCat(
      "H=", options.workspace.hidden, ",K=", options.workspace.top_k,
      ",experts=", options.num_experts, ",N=", capacity, ",dtype=", core::DispatchDTypeName(dtype),
      ",invalid=", invalid_id, ",buckets=", absl::StrJoin(buckets, ":")));
  const bool same_spec = allocation_ != nullptr && allocation_->fingerprint == fingerprint;
  absl::Status local = CheckEveryRankOwnsAnExpert(request.num_experts(), world);
  if (local.ok()) {
    local = MatchesConfiguredModel("hidden_size", model_.hidden_size(), request.hidden_size());
  }
  if (local.ok()) {
    local = MatchesConfiguredModel("num_experts", model_.num_experts(), request.num_experts());
  }
  if (local.ok()) local = MatchesConfiguredModel("top_k", model_.top_k(), request.top_k());
  absl::StatusOr<core::AllocatedWorkspace> allocated =
      core::ComputeAllocatedWorkspace(options.workspace);
  if (local.ok()) local = allocated.status();
  // The memory cap covers the workspace and the expert weights kept with it
  // (a different spec drops the loaded experts).
  const int64_t kept_expert_bytes = same_spec ? expert_bytes_ : 0;
  if (local.ok() && options_.memory_cap_bytes > 0 &&
      allocated->total_bytes + kept_expert_bytes > options_.memory_cap_bytes) {
    local = absl::ResourceExhaustedError(absl::StrCat(
        "AllocateWorkspace: the workspace needs ", allocated->total_bytes, " bytes",
        kept_expert_bytes > 0 ? absl::StrCat(" (plus ", kept_expert_bytes, " of experts)") : "",
        ", more than the worker's memory cap of ", options_.memory_cap_bytes,
        " bytes (--memory-cap-bytes)"));
  }
  // A request this rank rejects by itself still fails here, before the vote,
  // as it always did (a peer called alone must not wait for the others);
  // failing every rank at once through the vote's local status is issue 12.
  RETURN_IF_ERROR(local);
  RETURN_IF_ERROR(Vote("AllocateWorkspace", absl::OkStatus(),
                       {{"hidden_size", options.workspace.hidden},
                        {"top_k", options.workspace.top_k},
                        {"num_experts", options.num_experts},
                        {"capacity_tokens", capacity},
                        {"dispatch_dtype", static_cast<int64_t>(dtype)},
                        {"invalid_expert_id", invalid_id},
                        {"cuda_graph_buckets",
                         static_cast<int64_t>(Fingerprint64(absl::StrJoin(buckets, ":"))), true}}));
  ASSIGN_OR_RETURN(int64_t dispatch_bytes,
                   core::DispatchBytesPerToken(dtype, request.hidden_size(), request.top_k()));
  ASSIGN_OR_RETURN(core::FlashInferWorkspace flashinfer,
                   core::ComputeFlashInferWorkspace(options.workspace));

  if (!same_spec) {
    // Replaces the data plane's workspace and drops its experts.
    ASSIGN_OR_RETURN(
        DataPlaneAllocation held,
        data_plane_->Allocate(options, model_.moe_intermediate_size(), options_.memory_cap_bytes));
    auto allocation = std::make_unique<Allocation>();
    allocation->options = options;
    allocation->fingerprint = fingerprint;
    v1::AllocateWorkspaceResponse& out = allocation->response;
    out.set_dispatch_bytes_per_token(dispatch_bytes);
    out.set_combine_bytes_per_token(core::CombineBytesPerToken(request.hidden_size()));
    out.set_flashinfer_workspace_bytes(flashinfer.total_bytes);
    out.set_flashinfer_aux_bytes(flashinfer.aux_bytes);
    out.set_allocated_bytes(held.allocated_bytes);
    for (const core::WorkspaceRegion& region : held.regions) {
      v1::WorkspaceRegion* r = out.add_regions();
      r->set_name(region.name);
      r->set_offset_bytes(region.offset_bytes);
      r->set_size_bytes(region.size_bytes);
    }
    out.set_capacity_tokens(capacity);
    allocation_ = std::move(allocation);
    geometry_committed_ = false;
    expert_bytes_ = 0;
  }
  *response = allocation_->response;
  absl::MutexLock lock(&state_mu_);
  state_.Allocated();
  status_.set_workspace_bytes(allocation_->response.allocated_bytes());
  status_.set_capacity_tokens(capacity);
  status_.set_expert_bytes(expert_bytes_);
  if (!same_spec) {
    status_.set_geometry_epoch(0);
    status_.set_runtime_max_tokens_per_rank(0);
  }
  UpdateHealthLocked();
  return absl::OkStatus();
}

// -------------------------------------------------------------- LoadExperts

grpc::Status WorkerService::LoadExperts(grpc::ServerContext* context,
                                        const v1::LoadExpertsRequest* request,
                                        v1::LoadExpertsResponse* response) {
  return Finish(
      RunGuarded("LoadExperts", [&] { return DoLoadExperts(context, *request, response); }));
}

absl::Status WorkerService::DoLoadExperts(grpc::ServerContext* context,
                                          const v1::LoadExpertsRequest& request,
                                          v1::LoadExpertsResponse* response) {
  RETURN_IF_ERROR(CheckLoadExperts(options_.limits, request));
  RETURN_IF_ERROR(NonNegative("layer", request.layer()));
  if (request.kind() != v1::EXPERT_KIND_SWIGLU && request.kind() != v1::EXPERT_KIND_IDENTITY) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind: expected EXPERT_KIND_SWIGLU or EXPERT_KIND_IDENTITY, got ", request.kind()));
  }
  RETURN_IF_ERROR(NonNegative("intermediate_size", request.intermediate_size()));
  if (!request.safetensors_path().empty() && request.kind() != v1::EXPERT_KIND_SWIGLU) {
    return absl::InvalidArgumentError(
        "safetensors_path: checkpoints hold SwiGLU experts; set kind EXPERT_KIND_SWIGLU");
  }
  if (!request.safetensors_path().empty() && request.name_pattern().empty()) {
    return absl::InvalidArgumentError(
        "name_pattern: required with safetensors_path, e.g. "
        "\"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight\"");
  }

  std::string checkpoint;  // canonical, under --checkpoint-dir (server/path_policy.h)
  if (!request.safetensors_path().empty()) {
    ASSIGN_OR_RETURN(checkpoint,
                     ResolveCheckpointPath(options_.checkpoint_dirs, request.safetensors_path(),
                                           options_.limits.max_file_bytes));
  }
  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "LoadExperts", WorkerPhase::kAllocated));
  if (request.layer() >= static_cast<int>(plan_.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer: expected in [0, ", plan_.size(),
                                                   ") (the configured layers), got ",
                                                   request.layer()));
  }
  if (!plan_[request.layer()].sparse) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", request.layer(),
                     " is a dense layer in the configured plan; only MoE layers "
                     "have experts"));
  }
  const core::EpDispatcherOptions& options = allocation_->options;
  const int64_t hidden = options.workspace.hidden;
  int64_t intermediate = request.intermediate_size();
  if (request.kind() == v1::EXPERT_KIND_SWIGLU && intermediate == 0) {
    intermediate = model_.moe_intermediate_size();
    if (intermediate == 0) {
      return absl::InvalidArgumentError(
          "intermediate_size: required for EXPERT_KIND_SWIGLU (the configured model has no "
          "moe_intermediate_size)");
    }
  }
  RETURN_IF_ERROR(Positive("intermediate_size",
                           request.kind() == v1::EXPERT_KIND_SWIGLU ? intermediate : 1,
                           kMaxHidden * 16));
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(options.num_experts, joined_.world_size));
  const int rank = joined_.rank;
  const int first = placement.FirstExpert(rank);
  const int count = placement.NumLocalExperts(rank);
  // Weight bytes the new set will hold: gate, up [I, H] and down [H, I], bf16.
  const int64_t new_bytes =
      request.kind() == v1::EXPERT_KIND_SWIGLU ? int64_t{count} * 3 * intermediate * hidden * 2 : 0;
  const int64_t old_bytes = data_plane_->ExpertBytes(request.layer());
  const int64_t total = data_plane_->allocated_bytes() + expert_bytes_ - old_bytes + new_bytes;
  if (options_.memory_cap_bytes > 0 && total > options_.memory_cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "LoadExperts: layer ", request.layer(), " needs ", new_bytes, " bytes of experts; with ",
        data_plane_->allocated_bytes(), " of workspace and ", expert_bytes_ - old_bytes,
        " of other layers' experts that is ", total, " bytes, more than the memory cap of ",
        options_.memory_cap_bytes, " bytes (--memory-cap-bytes)"));
  }
  // The plane makes the experts from this description (the GPU plane on its
  // device, without a host copy; core/expert_source.h).
  const core::ExpertSource source =
      request.kind() == v1::EXPERT_KIND_IDENTITY
          ? core::ExpertSource::Identity(request.layer(), options.num_experts, first, count, hidden)
      : !request.safetensors_path().empty()
          ? core::ExpertSource::Safetensors(checkpoint, request.name_pattern(), request.layer(),
                                            options.num_experts, first, count, hidden, intermediate)
          : core::ExpertSource::Seeded(request.seed(), request.layer(), options.num_experts, first,
                                       count, hidden, intermediate);
  RETURN_IF_ERROR(core::ValidateExpertSource(source));
  // The shared expert is made (and checked) before anything is replaced.
  const int64_t old_shared = data_plane_->SharedExpertBytes(request.layer());
  ASSIGN_OR_RETURN(
      std::optional<core::SharedExpert> shared,
      MakeSharedExpert(request, checkpoint, hidden, total - old_shared, options_.memory_cap_bytes));
  // The GPU plane may also grow its expert scratch.
  ASSIGN_OR_RETURN(int64_t bytes,
                   data_plane_->LoadExperts(request.layer(), source, options_.memory_cap_bytes));
  expert_bytes_ += bytes - old_bytes;
  ASSIGN_OR_RETURN(
      int64_t shared_bytes,
      data_plane_->LoadSharedExpert(request.layer(), std::move(shared), options_.memory_cap_bytes));
  expert_bytes_ += shared_bytes - old_shared;
  response->set_first_expert(first);
  response->set_num_local_experts(count);
  response->set_expert_bytes(bytes);
  response->set_shared_expert_bytes(shared_bytes);
  absl::MutexLock lock(&state_mu_);
  status_.set_expert_bytes(expert_bytes_);
  status_.set_workspace_bytes(data_plane_->allocated_bytes());
  return absl::OkStatus();
}

// ---------------------------------------------------------- SyncTokenCounts

grpc::Status WorkerService::SyncTokenCounts(grpc::ServerContext* context,
                                            const v1::SyncTokenCountsRequest* request,
                                            v1::SyncTokenCountsResponse* response) {
  return Finish(RunGuarded("SyncTokenCounts",
                           [&] { return DoSyncTokenCounts(context, *request, response); }));
}

absl::Status WorkerService::DoSyncTokenCounts(grpc::ServerContext* context,
                                              const v1::SyncTokenCountsRequest& request,
                                              v1::SyncTokenCountsResponse* response) {
  RETURN_IF_ERROR(NonNegative("epoch", request.epoch()));
  RETURN_IF_ERROR(NonNegative("local_tokens", request.local_tokens()));
  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "SyncTokenCounts", WorkerPhase::kAllocated));
  absl::StatusOr<std::vector<int64_t>> counts =
      data_plane_->SyncTokenCounts(request.local_tokens());
  RETURN_IF_ERROR(GroupResult(counts.status()));
  const core::EpDispatcherOptions& options = allocation_->options;
  ASSIGN_OR_RETURN(int64_t runtime_max,
                   core::ChooseRuntimeMaxTokens(*counts, options.cuda_graph_buckets,
                                                options.workspace.capacity_tokens));
  response->mutable_token_counts()->Assign(counts->begin(), counts->end());
  response->set_max_tokens(*std::max_element(counts->begin(), counts->end()));
  response->set_runtime_max_tokens_per_rank(runtime_max);
  return absl::OkStatus();
}

// ----------------------------------------------------------- CommitGeometry

grpc::Status WorkerService::CommitGeometry(grpc::ServerContext* context,
                                           const v1::CommitGeometryRequest* request,
                                           v1::CommitGeometryResponse* /*response*/) {
  return Finish(RunGuarded("CommitGeometry", [&] { return DoCommitGeometry(context, *request); }));
}

absl::Status WorkerService::DoCommitGeometry(grpc::ServerContext* context,
                                             const v1::CommitGeometryRequest& request) {
  RETURN_IF_ERROR(NonNegative("epoch", request.epoch()));
  RETURN_IF_ERROR(
      NonNegative("runtime_max_tokens_per_rank", request.runtime_max_tokens_per_rank()));
  RETURN_IF_ERROR(NonNegative("local_tokens", request.local_tokens()));
  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "CommitGeometry", WorkerPhase::kAllocated));
  RETURN_IF_ERROR(data_plane_->CommitGeometry(
      request.epoch(), request.runtime_max_tokens_per_rank(), request.local_tokens()));
  geometry_committed_ = true;
  absl::MutexLock lock(&state_mu_);
  status_.set_geometry_epoch(request.epoch());
  status_.set_runtime_max_tokens_per_rank(request.runtime_max_tokens_per_rank());
  UpdateHealthLocked();  // the log fields carry the epoch
  return absl::OkStatus();
}

// ------------------------------------------------------------------ Forward

grpc::Status WorkerService::Forward(grpc::ServerContext* context, const v1::ForwardRequest* request,
                                    v1::ForwardResponse* response) {
  return Finish(RunGuarded("Forward", [&] { return DoForward(context, *request, response); }));
}

absl::Status WorkerService::DoForward(grpc::ServerContext* context,
                                      const v1::ForwardRequest& request,
                                      v1::ForwardResponse* response) {
  RETURN_IF_ERROR(CheckForward(options_.limits, request));
  const absl::Time start = absl::Now();
  RETURN_IF_ERROR(NonNegative("layer", request.layer()));
  RETURN_IF_ERROR(NonNegative("epoch", request.epoch()));
  ASSIGN_OR_RETURN(DecodedTensor<core::bf16_t> hidden,
                   DecodeBf16(request.hidden_states(), "hidden_states", 2));
  ASSIGN_OR_RETURN(DecodedTensor<int32_t> ids, DecodeInt32(request.topk_ids(), "topk_ids", 2));
  ASSIGN_OR_RETURN(DecodedTensor<float> weights,
                   DecodeFloat32(request.topk_weights(), "topk_weights", 2));
  const int64_t tokens = hidden.shape[0];
  if (ids.shape[0] != tokens) {
    return absl::InvalidArgumentError(absl::StrCat("topk_ids.shape[0]: expected ", tokens,
                                                   " (hidden_states rows), got ", ids.shape[0]));
  }
  if (weights.shape != ids.shape) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_weights.shape: expected [", absl::StrJoin(ids.shape, ", "),
                     "] (topk_ids' shape), got [", absl::StrJoin(weights.shape, ", "), "]"));
  }

  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "Forward", WorkerPhase::kAllocated));
  const core::EpDispatcherOptions& options = allocation_->options;
  if (hidden.shape[1] != options.workspace.hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states.shape[1]: expected ", options.workspace.hidden,
                     " (the allocated hidden_size), got ", hidden.shape[1]));
  }
  if (ids.shape[1] != options.workspace.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("topk_ids.shape[1]: expected ",
                                                   options.workspace.top_k,
                                                   " (the allocated top_k), got ", ids.shape[1]));
  }
  if (!data_plane_->HasExperts(request.layer())) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Forward: layer ", request.layer(), " has no loaded experts; call LoadExperts first"));
  }
  if (!geometry_committed_) {
    return absl::FailedPreconditionError(
        "Forward requires a committed geometry; call SyncTokenCounts and CommitGeometry first");
  }
  if (request.epoch() != data_plane_->epoch()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "Forward: epoch ", request.epoch(), " does not match the committed geometry epoch ",
        data_plane_->epoch(), "; call CommitGeometry for epoch ", request.epoch(), " first"));
  }
  std::vector<core::bf16_t> output(hidden.values.size());
  absl::StatusOr<core::StepStats> stats = data_plane_->Forward(
      request.layer(), hidden.values, ids.values, weights.values, tokens, absl::MakeSpan(output));
  RETURN_IF_ERROR(GroupResult(stats.status()));
  const core::StepStats& step = *stats;
  const std::vector<int64_t> shape = {tokens, options.workspace.hidden};
  *response->mutable_output() = EncodeBf16(output, shape);
  v1::ForwardTimings* timings = response->mutable_timings();
  timings->set_dispatch_us(step.dispatch_us);
  timings->set_expert_us(step.expert_us);
  timings->set_combine_us(step.combine_us);
  timings->set_shared_expert_us(step.shared_us);
  timings->set_shared_overlap_us(step.shared_overlap_us);
  timings->set_total_us(absl::ToInt64Microseconds(absl::Now() - start));
  response->set_runtime_max_tokens_per_rank(step.runtime_max_tokens_per_rank);
  response->set_tokens_sent(step.tokens_sent);
  response->set_bytes_sent(step.bytes_sent_remote);
  response->set_tokens_received(step.tokens_received);
  absl::MutexLock lock(&state_mu_);
  v1::Counters* counters = status_.mutable_counters();
  counters->set_forwards(counters->forwards() + 1);
  counters->set_tokens_dispatched(counters->tokens_dispatched() + step.tokens_sent);
  counters->set_bytes_sent(counters->bytes_sent() + step.bytes_sent_remote);
  return absl::OkStatus();
}

// ---------------------------------------------------------------- Benchmark

grpc::Status WorkerService::Benchmark(grpc::ServerContext* context,
                                      const v1::BenchmarkRequest* request,
                                      v1::BenchmarkResponse* response) {
  return Finish(RunGuarded("Benchmark", [&] { return DoBenchmark(context, *request, response); }));
}

absl::Status WorkerService::DoBenchmark(grpc::ServerContext* context,
                                        const v1::BenchmarkRequest& request,
                                        v1::BenchmarkResponse* response) {
  RETURN_IF_ERROR(CheckBenchmark(options_.limits, request));
  RETURN_IF_ERROR(Positive("tokens_per_rank", request.tokens_per_rank(), kMaxTokens));
  RETURN_IF_ERROR(CheckMoeSizes(request.hidden_size(), request.num_experts(), request.top_k()));
  RETURN_IF_ERROR(Positive("iterations", request.iterations(), kMaxBenchmarkIterations));
  RETURN_IF_ERROR(NonNegative("warmup", request.warmup()));
  if (request.warmup() > kMaxBenchmarkIterations) {
    return absl::InvalidArgumentError(
        absl::StrCat("warmup: expected <= ", kMaxBenchmarkIterations, ", got ", request.warmup()));
  }
  const std::string routing = request.routing().empty() ? "uniform" : request.routing();
  if (routing != "uniform" && routing != "skewed") {
    return absl::InvalidArgumentError(
        absl::StrCat("routing: expected \"uniform\" or \"skewed\", got \"", routing, "\""));
  }

  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "Benchmark", WorkerPhase::kJoined));
  const int world = joined_.world_size;
  const int rank = joined_.rank;
  RETURN_IF_ERROR(CheckEveryRankOwnsAnExpert(request.num_experts(), world));
  const int64_t tokens = request.tokens_per_rank();
  const int64_t hidden_size = request.hidden_size();
  const int top_k = request.top_k();
  core::EpDispatcherOptions options;
  options.workspace.ep_size = world;
  options.workspace.capacity_tokens = tokens;
  options.workspace.hidden = hidden_size;
  options.workspace.top_k = top_k;
  options.workspace.dtype = core::DispatchDType::kBF16;
  options.num_experts = request.num_experts();
  ASSIGN_OR_RETURN(core::AllocatedWorkspace needed,
                   core::ComputeAllocatedWorkspace(options.workspace));
  const int64_t held = data_plane_->allocated_bytes() + expert_bytes_;
  const int64_t inputs = tokens * (hidden_size * 2 * 2 + int64_t{top_k} * 8);
  if (options_.memory_cap_bytes > 0 &&
      held + needed.total_bytes + inputs > options_.memory_cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "Benchmark: needs ", needed.total_bytes + inputs,
        " bytes (workspace and inputs) on top of ", held, " held, more than the memory cap of ",
        options_.memory_cap_bytes, " bytes (--memory-cap-bytes)"));
  }
  ASSIGN_OR_RETURN(int64_t dispatch_bytes_per_token,
                   core::DispatchBytesPerToken(core::DispatchDType::kBF16, hidden_size, top_k));
  const int64_t combine_bytes_per_token = core::CombineBytesPerToken(hidden_size);

  // Inputs: seeded per rank. Uniform routing, or "skewed": expert e drawn in
  // proportion to 1 / (e + 1) (Zipf, s = 1), K distinct experts per token.
  std::mt19937_64 rng(request.seed() * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  BenchmarkInputs bench_inputs;
  bench_inputs.num_tokens = tokens;
  std::vector<core::bf16_t>& hidden = bench_inputs.hidden;
  hidden.resize(static_cast<size_t>(tokens * hidden_size));
  for (core::bf16_t& h : hidden) h = core::FloatToBf16(value(rng));
  std::vector<double> popularity(request.num_experts(), 1.0);
  if (routing == "skewed") {
    for (int e = 0; e < request.num_experts(); ++e) popularity[e] = 1.0 / (e + 1);
  }
  bench_inputs.topk_ids = SampleRouting(rng, tokens, top_k, popularity);
  std::vector<float>& weights = bench_inputs.topk_weights;
  weights.resize(bench_inputs.topk_ids.size());
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) sum += weights[t * top_k + k] = weight(rng);
    for (int k = 0; k < top_k; ++k) weights[t * top_k + k] /= sum;
  }
  // Identity experts on a scratch dispatcher of the data plane (GPU: timed
  // with CUDA events on the stream; CPU: wall clock).
  const int64_t cap_left =
      options_.memory_cap_bytes > 0 ? options_.memory_cap_bytes - held : int64_t{0};
  absl::StatusOr<BenchmarkTimes> times = data_plane_->Benchmark(
      options, bench_inputs, request.warmup(), request.iterations(), cap_left);
  RETURN_IF_ERROR(GroupResult(times.status()));
  std::vector<double>& dispatch_us = times->dispatch_us;
  std::vector<double>& combine_us = times->combine_us;
  const int64_t tokens_sent = times->tokens_sent;
  std::sort(dispatch_us.begin(), dispatch_us.end());
  std::sort(combine_us.begin(), combine_us.end());
  response->set_dispatch_p50_us(Percentile(dispatch_us, 50));
  response->set_dispatch_p99_us(Percentile(dispatch_us, 99));
  response->set_combine_p50_us(Percentile(combine_us, 50));
  response->set_combine_p99_us(Percentile(combine_us, 99));
  // Logical bytes: every token copy this rank sends, the local share included.
  const int64_t dispatch_bytes = tokens_sent * dispatch_bytes_per_token;
  const int64_t combine_bytes = tokens_sent * combine_bytes_per_token;
  response->set_dispatch_bytes(dispatch_bytes);
  response->set_combine_bytes(combine_bytes);
  const double d50 = response->dispatch_p50_us();
  const double c50 = response->combine_p50_us();
  response->set_dispatch_logical_gbps(d50 > 0 ? dispatch_bytes / (d50 * 1e3) : 0.0);
  response->set_combine_logical_gbps(c50 > 0 ? combine_bytes / (c50 * 1e3) : 0.0);
  return absl::OkStatus();
}

// ------------------------------------------------------------ ForwardLayers

grpc::Status WorkerService::ForwardLayers(grpc::ServerContext* context,
                                          const v1::ForwardLayersRequest* request,
                                          v1::ForwardLayersResponse* response) {
  return Finish(
      RunGuarded("ForwardLayers", [&] { return DoForwardLayers(context, *request, response); }));
}

absl::Status WorkerService::DoForwardLayers(grpc::ServerContext* context,
                                            const v1::ForwardLayersRequest& request,
                                            v1::ForwardLayersResponse* response) {
  RETURN_IF_ERROR(CheckForwardLayers(options_.limits, request));
  // The request is checked inside the runner, after the slot: a rank with a
  // bad request still takes part in the runner's agreement all-gather, so its
  // peers fail with ABORTED instead of timing out (server/layer_stack_runner.h).
  CollectiveSlot slot(this);
  RETURN_IF_ERROR(slot.Acquire(context, "ForwardLayers", WorkerPhase::kConfigured));
  if (data_plane_->backend() != "gloo") {
    return absl::UnimplementedError(
        "ForwardLayers: the layer stack runs on the Gloo backend; GPU layer communicator is not "
        "built yet (join with backend \"gloo\")");
  }
  const int64_t held = data_plane_->allocated_bytes() + expert_bytes_;
  return GroupResult(layer_stack_.Run(data_plane_->collective(), joined_.generation, request,
                                      options_.memory_cap_bytes, held, response));
}

}  // namespace moe_ep::server
