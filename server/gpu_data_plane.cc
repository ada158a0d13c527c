#include "server/gpu_data_plane.h"

#ifdef MOE_EP_HAVE_CUDA

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <optional>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/shrink_plan.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "kernels/device_calls.h"
#include "server/backend_selection.h"
#include "server/call_gate.h"
#include "server/device_info.h"
#include "server/gpu_step_buffers.h"
#include "server/memory_budget.h"
#include "server/nccl_id_share.h"

namespace moe_ep::server {
namespace {

static_assert(kNcclUniqueIdBytes == NCCL_UNIQUE_ID_BYTES);

// The masked view's all-gather scratch per rank, allocated with the view
// (kernels/masked_stream_collective.h): what an engine's captured step may
// gather through it (sync_token_counts: one int64 per rank; CaptureForward's
// (epoch, R) agreement, 16 bytes). Larger records of the control collective
// (a vote's ballot, about 704 bytes a rank) are never captured: they grow
// the second scratch once.
constexpr int64_t kMaskedCaptureGatherBytes = 256;

std::string JoinContext(const DataPlaneGroup& group) {
  return absl::StrCat("Join (rank ", group.rank, " of ", group.world_size, ", generation ",
                      group.generation, ")");
}

absl::Status WithContext(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat(context, ": ", status.message()));
}

}  // namespace

absl::StatusOr<std::unique_ptr<GpuDataPlane>> GpuDataPlane::Form(
    const DataPlaneGroup& group, const std::shared_ptr<gloo::rendezvous::Store>& store) {
  const std::string context = JoinContext(group);
  {
    absl::Status device = CheckDevice(group.device, VisibleGpuCount(), "nccl");
    if (!device.ok()) return WithContext(device, context);
  }
  RETURN_IF_ERROR(WithContext(kernels::SetDevice(group.device), context));
  // A returning rank (group.rejoin): a communicator of itself alone, every
  // other rank masked, until Readmit forms one with the survivors.
  const bool alone = group.rejoin && group.world_size > 1;
  absl::StatusOr<std::string> id =
      alone ? kernels::NcclCollective::NewUniqueId()
            : ExchangeNcclUniqueId(group, *store, &kernels::NcclCollective::NewUniqueId);
  if (!id.ok()) return WithContext(id.status(), context);
  const auto timeout_ms =
      std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(group.timeout)));
  absl::StatusOr<std::unique_ptr<kernels::NcclCollective>> collective =
      kernels::NcclCollective::Create(*id, alone ? 0 : group.rank, alone ? 1 : group.world_size,
                                      group.device, timeout_ms);
  if (!collective.ok()) return WithContext(collective.status(), context);
  std::unique_ptr<GpuDataPlane> plane(new GpuDataPlane());
  plane->group_ = group;
  plane->nccl_ = collective->get();
  plane->mask_.live.assign(group.world_size, true);
  if (alone) {
    std::vector<bool> live(group.world_size, false);
    live[group.rank] = true;
    absl::StatusOr<std::unique_ptr<kernels::MaskedStreamCollective>> masked =
        kernels::MaskedStreamCollective::Create(std::move(*collective), group.rank, live,
                                                kMaskedCaptureGatherBytes);
    if (!masked.ok()) return WithContext(masked.status(), context);
    plane->masked_ = std::move(*masked);
    plane->view_ = plane->masked_.get();
    plane->members_ = {group.rank};
    plane->mask_.live = std::move(live);
  } else {
    plane->collective_ = std::move(*collective);
    plane->view_ = plane->collective_.get();
    plane->members_ = core::LiveMembers(plane->mask_.live);
  }
  plane->control_ = std::make_unique<kernels::StagedControlCollective>(plane->view_);
  {
    absl::StatusOr<std::unique_ptr<kernels::GpuPlaneEvents>> events =
        kernels::GpuPlaneEvents::Create();
    RETURN_IF_ERROR(WithContext(events.status(), context));
    plane->events_ = std::move(*events);
  }
  return plane;
}

GpuDataPlane::GpuDataPlane() : DataPlane(PlaneKind::kNccl, kernels::GpuEpDispatcher::kGpuLimits) {}

GpuDataPlane::~GpuDataPlane() {
  // Whatever is still enqueued must not outlive the buffers; a broken group
  // was aborted by the collective, so this does not wait on a dead peer.
  // Frees and event destruction happen on this group's device.
  (void)MakeDeviceCurrent();
  if (view_ != nullptr && view_->healthy()) (void)Synchronize();
  // The core's control_ views view_, which the members below own.
  control_.reset();
  experts_.Clear();
  staging_.reset();
  UseDispatcher(nullptr, 0);
  dispatcher_.reset();
  events_.reset();
}

absl::Status GpuDataPlane::MakeDeviceCurrent() const { return kernels::SetDevice(group_.device); }

absl::Status GpuDataPlane::Synchronize() { return view_->Synchronize(); }

void GpuDataPlane::BeforeMaskRound() {
  if (MakeDeviceCurrent().ok()) nccl_->Revoke().IgnoreError();
}

absl::Status GpuDataPlane::UseAgreement(MaskAgreement agreed, int agreed_round) {
  RETURN_IF_ERROR(MakeDeviceCurrent());
  ASSIGN_OR_RETURN(core::ShrinkPlan plan, core::PlanShrink(members_, agreed.live, group_.rank));
  const std::string context =
      absl::StrCat("rank mask round ", agreed_round, " on rank ", group_.rank, " (members [",
                   absl::StrJoin(plan.members, ","), "])");
  std::unique_ptr<kernels::NcclCollective> next;
  // A revoked communicator only shrinks or tears down, and NCCL refuses a
  // shrink that excludes nobody: a round that kept every member of a revoked
  // communicator (a false alarm) re-initialises like a returning rank.
  const bool reinit = plan.kind == core::ShrinkPlan::Kind::kReinit ||
                      (plan.kind == core::ShrinkPlan::Kind::kKeep && nccl_->revoked());
  if (reinit) {
    // A fresh communicator of the members, the id made by the lowest one and
    // shared over the round's Gloo group (its failure too, so no member
    // waits for an id that will not come).
    absl::StatusOr<std::string> id =
        ShareNcclUniqueId(*agreed.group, &kernels::NcclCollective::NewUniqueId,
                          absl::StrCat("rank ", plan.members.front(), " (member 0)"));
    if (!id.ok()) return WithContext(id.status(), context);
    const auto timeout_ms =
        std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(group_.timeout)));
    absl::StatusOr<std::unique_ptr<kernels::NcclCollective>> fresh =
        kernels::NcclCollective::Create(*id, plan.new_rank, static_cast<int>(plan.members.size()),
                                        group_.device, timeout_ms);
    if (!fresh.ok()) return WithContext(fresh.status(), context);
    next = std::move(*fresh);
  } else if (plan.kind == core::ShrinkPlan::Kind::kShrink) {
    // ncclCommShrink without the lost ranks.
    absl::StatusOr<std::unique_ptr<kernels::NcclCollective>> shrunk = nccl_->Shrink(plan.exclude);
    if (!shrunk.ok()) return WithContext(shrunk.status(), context);
    next = std::move(*shrunk);
  }
  if (next == nullptr) {
    // kKeep on a healthy communicator: nothing moves; the mask stays.
    mask_.round = agreed_round;
    mask_.host = agreed.host;
    return absl::OkStatus();
  }
  kernels::NcclCollective* next_nccl = next.get();
  const bool all_live =
      std::find(agreed.live.begin(), agreed.live.end(), false) == agreed.live.end();
  std::unique_ptr<kernels::MaskedStreamCollective> masked;
  if (!all_live) {
    absl::StatusOr<std::unique_ptr<kernels::MaskedStreamCollective>> view =
        kernels::MaskedStreamCollective::Create(std::move(next), group_.rank, agreed.live,
                                                kMaskedCaptureGatherBytes);
    if (!view.ok()) return WithContext(view.status(), context);
    masked = std::move(*view);
  }
  kernels::StreamCollective* next_view =
      masked != nullptr ? static_cast<kernels::StreamCollective*>(masked.get()) : next.get();
  std::unique_ptr<kernels::GpuEpDispatcher> dispatcher;
  if (dispatcher_ != nullptr) {
    // The same buffers' shapes on the new communicator; the geometry stays.
    // The old dispatcher's communicator is revoked, so it can serve no step:
    // free its buffers first so a full GPU does not fail the mask.
    const int64_t epoch = dispatcher_->epoch();
    const int64_t runtime_max = dispatcher_->runtime_max_tokens_per_rank();
    staging_->Rebind(nullptr);
    UseDispatcher(nullptr, 0);
    dispatcher_.reset();
    const core::WorkspaceSpec& ws = options_.workspace;
    kernels::GpuEpDispatcherOptions gpu_options;
    gpu_options.dispatcher = options_;
    gpu_options.max_intermediate = max_intermediate_;
    gpu_options.tail_bytes = kernels::StepStaging::Bytes(ws.capacity_tokens, ws.hidden, ws.top_k);
    absl::StatusOr<std::unique_ptr<kernels::GpuEpDispatcher>> made =
        kernels::GpuEpDispatcher::Create(next_view, gpu_options, 0);
    if (!made.ok()) return WithContext(made.status(), context);
    dispatcher = std::move(*made);
    if (geometry_.committed) {
      RETURN_IF_ERROR(dispatcher->CommitGeometry(epoch, runtime_max, 0));
    }
  }
  // The old communicator is aborted (its destructor) once the new one serves.
  auto control = std::make_unique<kernels::StagedControlCollective>(next_view);
  if (dispatcher != nullptr) {
    dispatcher_ = std::move(dispatcher);
    UseDispatcher(dispatcher_.get(), 0);
    staging_->Rebind(dispatcher_->tail());
    NewWorkspaceToken();  // new buffers: graphs of engine calls must be captured again
  }
  control_ = std::move(control);
  masked_ = std::move(masked);
  if (masked_ == nullptr) {
    collective_ = std::move(next);
  } else {
    collective_.reset();
  }
  nccl_ = next_nccl;
  view_ = next_view;
  view_->SetCallDeadline(CollectiveDeadline(call_));
  members_ = plan.members;
  return absl::OkStatus();
}

absl::StatusOr<DataPlaneAllocation> GpuDataPlane::Allocate(const core::EpDispatcherOptions& options,
                                                           int64_t max_intermediate,
                                                           int64_t memory_cap_bytes) {
  RETURN_IF_ERROR(MakeDeviceCurrent());
  const core::WorkspaceSpec& ws = options.workspace;
  // The book's contiguous table, before anything is allocated (the engine
  // calls read their experts from it).
  ASSIGN_OR_RETURN(core::PlacementTable contiguous,
                   core::PlacementTable::Contiguous(options.num_experts, ws.ep_size));
  const int64_t staging_bytes =
      kernels::StepStaging::Bytes(ws.capacity_tokens, ws.hidden, ws.top_k);
  kernels::GpuEpDispatcherOptions gpu_options;
  gpu_options.dispatcher = options;
  gpu_options.max_intermediate = max_intermediate;
  gpu_options.tail_bytes = staging_bytes;
  absl::StatusOr<std::unique_ptr<kernels::GpuEpDispatcher>> dispatcher =
      kernels::GpuEpDispatcher::Create(view_, gpu_options, memory_cap_bytes);
  if (!dispatcher.ok()) {
    if (dispatcher.status().code() == absl::StatusCode::kResourceExhausted &&
        memory_cap_bytes > 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "AllocateWorkspace: ", dispatcher.status().message(), " (--memory-cap-bytes)"));
    }
    return dispatcher.status();
  }
  ASSIGN_OR_RETURN(
      std::unique_ptr<kernels::StepStaging> staging,
      kernels::StepStaging::Create(ws.capacity_tokens, ws.hidden, ws.top_k,
                                   {.device = (*dispatcher)->tail(), .pinned_host = true}));

  // The breakdown is the dispatcher's one allocation: its typed layout, then
  // what the expert compute says its scratch is, then the Forward staging
  // in the dispatcher's tail.
  const kernels::GpuEpDispatcher& held = **dispatcher;
  DataPlaneAllocation allocation;
  allocation.regions = held.layout().Regions();
  int64_t offset = held.layout().total_bytes;
  allocation.regions.push_back({"expert_scratch", offset, held.expert_scratch_bytes()});
  offset += held.expert_scratch_bytes();
  allocation.regions.push_back({"forward_staging", offset, staging_bytes});
  // The placement table and load counters (DESIGN §15), after the staging.
  allocation.regions.push_back(
      {"placement_table", held.placement_offset(), held.placement_bytes()});
  allocation.allocated_bytes = held.allocated_bytes();

  book_.Reset(std::make_shared<const core::PlacementTable>(std::move(contiguous)));
  book_.SetLive(mask_.live);  // a returning rank allocates under its mask
  ForgetExperts();
  shared_.Reset(ws.capacity_tokens, ws.hidden);
  staging_ = std::move(staging);
  dispatcher_ = std::move(*dispatcher);
  UseDispatcher(dispatcher_.get(), 0);  // the staging lives in its tail
  options_ = options;
  max_intermediate_ = max_intermediate;
  geometry_ = {};
  NewWorkspaceToken();
  return allocation;
}

absl::StatusOr<int64_t> GpuDataPlane::LoadExperts(int layer, const core::ExpertSource& source,
                                                  int64_t memory_cap_bytes) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("LoadExperts: no workspace; call Allocate first");
  }
  // An installed table is checked slot by slot; without one, the range of
  // the contiguous placement (and its message).
  RETURN_IF_ERROR(
      CheckExpertSourceForWorkspace(source, options_, view_->rank(), book_.Installed(layer)));
  RETURN_IF_ERROR(CheckGpuExpertSource(source));
  RETURN_IF_ERROR(MakeDeviceCurrent());
  // Made on the device from the source (seeded: generated there; safetensors:
  // streamed through bounded pinned staging): no host copy of the layer.
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceExpertSet> device,
                   kernels::DeviceExpertSet::Load(source));
  std::unique_ptr<kernels::GpuEpDispatcher> grown;
  if (source.expert_kind() == core::ExpertKind::kSwiGlu &&
      source.intermediate > max_intermediate_) {
    // More scratch than the workspace was sized for: a new dispatcher with
    // the same buffers' shapes, the committed geometry carried over.
    const core::WorkspaceSpec& ws = options_.workspace;
    ASSIGN_OR_RETURN(const int64_t cap, GrownScratchCap(layer, source.intermediate,
                                                        max_intermediate_, device->weight_bytes(),
                                                        shared_.ScratchBytes(), memory_cap_bytes));
    kernels::GpuEpDispatcherOptions gpu_options;
    gpu_options.dispatcher = options_;
    gpu_options.max_intermediate = source.intermediate;
    gpu_options.tail_bytes = kernels::StepStaging::Bytes(ws.capacity_tokens, ws.hidden, ws.top_k);
    ASSIGN_OR_RETURN(grown, kernels::GpuEpDispatcher::Create(view_, gpu_options, cap));
    if (geometry_.committed) {
      RETURN_IF_ERROR(
          grown->CommitGeometry(geometry_.epoch, geometry_.runtime_max_tokens_per_rank, 0));
    }
  }
  if (grown != nullptr) {
    RETURN_IF_ERROR(Synchronize());  // nothing of the old dispatcher may still run
    dispatcher_ = std::move(grown);
    UseDispatcher(dispatcher_.get(), 0);
    staging_->Rebind(dispatcher_->tail());
    max_intermediate_ = source.intermediate;
    NewWorkspaceToken();  // new buffers: graphs of engine calls must be captured again
  }
  const int64_t bytes = device->weight_bytes();
  experts_.Put(layer, std::move(device));
  return bytes;
}

absl::StatusOr<int64_t> GpuDataPlane::HoldSharedExpert(int layer,
                                                       std::optional<core::SharedExpert> shared,
                                                       int64_t others_bytes,
                                                       int64_t memory_cap_bytes) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("LoadSharedExpert: no workspace; call Allocate first");
  }
  RETURN_IF_ERROR(MakeDeviceCurrent());
  return shared_.Load(layer, std::move(shared), others_bytes, memory_cap_bytes);
}

absl::Status GpuDataPlane::InstallPlacement(int layer,
                                            std::shared_ptr<const core::PlacementTable> table) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("InstallPlacement: no workspace; call Allocate first");
  }
  if (table == nullptr) return absl::InvalidArgumentError("InstallPlacement: null table");
  RETURN_IF_ERROR(MakeDeviceCurrent());
  RETURN_IF_ERROR(dispatcher_->SetPlacement(*table));
  // The layer's experts stay when they are this rank's new distinct slot
  // experts (any set of ids, DESIGN §17), else they go (LoadExperts again).
  experts_.KeepIfSlotsOf(layer, *table, view_->rank());
  book_.Install(layer, std::move(table));
  return absl::OkStatus();
}

absl::StatusOr<core::StepStats> GpuDataPlane::RunForward(int layer, const HostForward& io,
                                                         int64_t num_tokens) {
  const core::WorkspaceSpec& ws = options_.workspace;
  const int64_t h = ws.hidden;
  const int k = ws.top_k;
  const int64_t hidden_elem = io.hidden_fp32 ? 4 : 2;
  if (num_tokens < 0 || static_cast<int64_t>(io.hidden.size()) != num_tokens * h * hidden_elem ||
      static_cast<int64_t>(io.topk_ids.size()) != num_tokens * k * 4 ||
      static_cast<int64_t>(io.topk_weights.size()) != num_tokens * k * 4 ||
      static_cast<int64_t>(io.output.size()) != num_tokens * h * 2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "Forward on rank ", view_->rank(), ": tensor bytes expected hidden ",
        num_tokens * h * hidden_elem, ", topk ", num_tokens * k * 4, " each and output ",
        num_tokens * h * 2, " for ", num_tokens, " tokens, got ", io.hidden.size(), ", ",
        io.topk_ids.size(), ", ", io.topk_weights.size(), ", ", io.output.size()));
  }
  return StepFromHost(layer, io, num_tokens);
}

absl::Status GpuDataPlane::Upload(void* dst, const void* src, int64_t bytes, void* pinned,
                                  const char* what) {
  cudaStream_t stream = dispatcher_->stream();
  if (host_copy_ == ForwardHostCopy::kPinned) {
    std::memcpy(pinned, src, bytes);
    src = pinned;
  }
  return kernels::CopyToDeviceAsync(dst, src, bytes, stream,
                                    absl::StrCat(what, " to device, ", bytes, " bytes"));
}

absl::StatusOr<core::StepStats> GpuDataPlane::StepFromHost(int layer, const HostForward& io,
                                                           int64_t num_tokens) {
  const core::WorkspaceSpec& ws = options_.workspace;
  const int64_t h = ws.hidden;
  const int k = ws.top_k;
  const int rank = view_->rank();
  const int world = view_->size();
  kernels::DeviceExpertSet* experts = experts_.Find<kernels::DeviceExpertSet>(layer);
  if (experts == nullptr) {
    return ExpertsNotLoaded("Forward", layer);
  }
  RETURN_IF_ERROR(dispatcher_->CheckStep("Forward", num_tokens));
  RETURN_IF_ERROR(MakeDeviceCurrent());
  // The call gate (server/call_gate.h), once, before anything is uploaded:
  // a host all-gather through the staged control collective (one small
  // stream-ordered NCCL call and a stream sync). The step after it is
  // stream-ordered and bounded by the capacity, so a second gate between
  // the expert GEMMs and the combine would only stall the stream without
  // bounding anything the host waits for.
  RETURN_IF_ERROR(CallGate(*control_, call_,
                           absl::StrCat("Forward (layer ", layer, "): before dispatch"),
                           kForwardStopHint));

  // The layer's placement table (DESIGN §15): the route kernel reads it.
  const std::shared_ptr<const core::PlacementTable> table = Placement(layer);
  RETURN_IF_ERROR(dispatcher_->SetPlacement(*table));

  // Inputs: one host copy each, on the collective's stream (see the header).
  cudaStream_t stream = dispatcher_->stream();
  const int64_t hidden_bytes = num_tokens * h * 2;
  const int64_t k_bytes = num_tokens * k * 4;
  if (num_tokens > 0) {
    if (io.hidden_fp32) {
      // The rounding to bf16 is the hidden states' one copy, into pinned
      // staging (as DecodeBf16 rounds: core::FloatToBf16).
      const char* src = io.hidden.data();
      auto* dst = static_cast<core::bf16_t*>(staging_->host_hidden());
      for (int64_t i = 0; i < num_tokens * h; ++i) {
        float value;
        std::memcpy(&value, src + i * 4, 4);
        dst[i] = core::FloatToBf16(value);
      }
      RETURN_IF_ERROR(kernels::CopyToDeviceAsync(staging_->hidden(), staging_->host_hidden(),
                                                 hidden_bytes, stream, "hidden to device"));
    } else {
      RETURN_IF_ERROR(Upload(staging_->hidden(), io.hidden.data(), hidden_bytes,
                             staging_->host_hidden(), "hidden"));
    }
    RETURN_IF_ERROR(Upload(staging_->topk_ids(), io.topk_ids.data(), k_bytes,
                           staging_->host_topk_ids(), "topk_ids"));
    RETURN_IF_ERROR(Upload(staging_->topk_weights(), io.topk_weights.data(), k_bytes,
                           staging_->host_topk_weights(), "topk_weights"));
  }
  const kernels::DeviceExpertSet& set = *experts;
  // The shared expert starts on its own stream once the inputs are on the
  // device, and runs while the dispatch does (issue 18).
  const bool has_shared = shared_.Has(layer);
  if (has_shared) RETURN_IF_ERROR(shared_.Begin(layer, staging_->hidden(), num_tokens, stream));
  RETURN_IF_ERROR(events_->Record(0, stream));
  RETURN_IF_ERROR(dispatcher_->Dispatch(staging_->hidden(), staging_->topk_ids(),
                                        staging_->topk_weights(), num_tokens));
  RETURN_IF_ERROR(events_->Record(1, stream));
  // The dispatcher's expert compute is ExpertGemm::kGroupedDevice (the
  // default): SwiGLU reads no row count on the host, so nothing waits here.
  absl::Status computed = dispatcher_->ComputeExperts(set);
  if (!computed.ok()) {
    // Keep the ranks' collective sequence aligned (the peers go on to the
    // combine all-to-all), then report this rank's failure.
    (void)dispatcher_->Combine(staging_->output());
    return computed;
  }
  if (has_shared) RETURN_IF_ERROR(shared_.JoinInto(stream));
  RETURN_IF_ERROR(events_->Record(2, stream));
  RETURN_IF_ERROR(
      dispatcher_->Combine(staging_->output(), has_shared ? shared_.output() : nullptr));
  RETURN_IF_ERROR(events_->Record(3, stream));
  // The counters: the dispatcher's device counts, one small async copy.
  int32_t* counts = staging_->host_counts();
  RETURN_IF_ERROR(kernels::CopyToHostAsync(counts, dispatcher_->step_counts(),
                                           2 * world * sizeof(int32_t), stream,
                                           "step counts to host"));
  const bool pinned_out = host_copy_ == ForwardHostCopy::kPinned;
  if (num_tokens > 0 && pinned_out) {
    RETURN_IF_ERROR(kernels::CopyToHostAsync(staging_->host_output(), staging_->output(),
                                             hidden_bytes, stream, "output to host"));
  }
  RETURN_IF_ERROR(Synchronize());
  if (num_tokens > 0) {
    if (pinned_out) {
      std::memcpy(io.output.data(), staging_->host_output(), hidden_bytes);
    } else {
      // The stream is idle now, so this pageable copy (which returns once
      // done) waits for nothing but itself.
      RETURN_IF_ERROR(kernels::CopyToHostAsync(io.output.data(), staging_->output(), hidden_bytes,
                                               stream, "output to host"));
    }
  }

  // Step counters, as core::EpDispatcher counts them: counts[d] tokens sent
  // to rank d, counts[world + s] tokens rank s sent here.
  ASSIGN_OR_RETURN(core::StepStats stats,
                   StepCountStats(counts, world, rank, options_.workspace,
                                  dispatcher_->runtime_max_tokens_per_rank()));
  // The route kernel counted this step on the device; the layer gets it.
  ASSIGN_OR_RETURN(core::ExpertLoadCounts step, dispatcher_->ReadExpertLoad(/*reset=*/true));
  // Under a rank mask: the lost experts this rank's tokens chose (their
  // choices went nowhere and contributed zero), from the step's counters.
  for (const int e : table->LostExperts()) {
    const int64_t chosen = step.tokens_per_expert[e];
    if (chosen == 0) continue;
    stats.lost_experts.push_back(e);
    stats.lost_choices += chosen;
  }
  // Keyed like the CPU plane: a step resent after a mask round counts once.
  book_.AddLoad(
      layer, step,
      core::LoadStepKey{dispatcher_->epoch(), mask_.round, core::RoutingFingerprint(io.topk_ids)});
  RETURN_IF_ERROR(AddStepTimes(*events_, has_shared ? &shared_ : nullptr, &stats));
  return stats;
}

absl::StatusOr<std::unique_ptr<BenchmarkRun>> GpuDataPlane::MakeBenchmarkRun(
    const core::EpDispatcherOptions& options, const BenchmarkInputs& inputs,
    int64_t memory_cap_bytes, const std::string& plane) {
  RETURN_IF_ERROR(MakeDeviceCurrent());
  const int rank = view_->rank();
  const int members = view_->size();
  const int64_t tokens = inputs.num_tokens;
  const int64_t h = options.workspace.hidden;
  const int k = options.workspace.top_k;
  const int64_t input_bytes = kernels::StepStaging::Bytes(tokens, h, k);
  ASSIGN_OR_RETURN(const int64_t cap, DeviceScratchCap(input_bytes, memory_cap_bytes));
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(options.num_experts, members));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceExpertSet> identity,
                   kernels::DeviceExpertSet::Upload(core::ExpertSet::Identity(
                       placement.FirstExpert(rank), placement.NumLocalExperts(rank), h)));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::StepStaging> buffers,
                   kernels::StepStaging::Create(tokens, h, k));
  auto upload = [&](cudaStream_t stream) {
    return buffers->Upload(reinterpret_cast<const uint16_t*>(inputs.hidden.data()),
                           inputs.topk_ids.data(), inputs.topk_weights.data(), tokens, stream);
  };
  if (plane == PlaneKindName(PlaneKind::kOneSided)) {
    // Scratch symmetric windows of this communicator (a collective), then
    // the one-sided dispatcher over them; the run drops both in that order.
    ASSIGN_OR_RETURN(const int64_t window_bytes,
                     kernels::onesided::OneSidedDispatcher::WindowBytes(options));
    ASSIGN_OR_RETURN(std::unique_ptr<kernels::onesided::PeerWindows> windows,
                     kernels::onesided::CreateNcclPeerWindows(nccl_, window_bytes));
    kernels::onesided::OneSidedDispatcherOptions o;
    o.dispatcher = options;
    o.timeout = std::min(group_.timeout, absl::Seconds(60));
    o.sm_budget = group_.onesided_sm_budget;
    ASSIGN_OR_RETURN(std::unique_ptr<kernels::onesided::OneSidedDispatcher> bench,
                     kernels::onesided::OneSidedDispatcher::Create(windows.get(), o, cap));
    RETURN_IF_ERROR(upload(bench->stream()));
    RETURN_IF_ERROR(bench->CommitGeometry(1, tokens, tokens));
    kernels::onesided::OneSidedDispatcher* d = bench.get();
    GpuBenchmarkHooks hooks;
    hooks.wait = [d] { return d->CheckStep(); };
    hooks.tokens_sent = [d, members] {
      return kernels::DeviceTokensSent(d->send_counts(), members, d->stream());
    };
    // No peer may still store into the windows when they go.
    hooks.finish = [this] { return control_->Barrier(); };
    return std::make_unique<GpuBenchmarkRun<kernels::onesided::OneSidedDispatcher>>(
        std::move(windows), std::move(bench), std::move(identity), std::move(buffers), tokens,
        events_.get(), std::move(hooks));
  }
  kernels::GpuEpDispatcherOptions gpu_options;
  gpu_options.dispatcher = options;
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::GpuEpDispatcher> bench,
                   kernels::GpuEpDispatcher::Create(view_, gpu_options, cap));
  // One upload before timing; the stream is idle (no collective pending).
  RETURN_IF_ERROR(upload(bench->stream()));
  RETURN_IF_ERROR(Synchronize());
  RETURN_IF_ERROR(bench->CommitGeometry(1, tokens, tokens));
  kernels::GpuEpDispatcher* d = bench.get();
  GpuBenchmarkHooks hooks;
  hooks.wait = [this] { return Synchronize(); };
  // Row 0 of the step counts: what this rank sent to each rank.
  hooks.tokens_sent = [d, members] {
    return kernels::DeviceTokensSent(d->step_counts(), members, d->stream());
  };
  return std::make_unique<GpuBenchmarkRun<kernels::GpuEpDispatcher>>(
      nullptr, std::move(bench), std::move(identity), std::move(buffers), tokens, events_.get(),
      std::move(hooks));
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
