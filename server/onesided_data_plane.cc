#include "server/onesided_data_plane.h"

#ifdef MOE_EP_HAVE_CUDA

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/expert_source.h"
#include "core/masked_collective.h"
#include "core/routing.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "server/call_gate.h"
#include "server/host_forward.h"
#include "server/memory_budget.h"

namespace moe_ep::server {
namespace {

using kernels::onesided::OneSidedDispatcher;

// What ProbeOneSidedPlane all-gathers: where a rank runs.
struct PlaceRecord {
  char host[192];  // boot id + host name, NUL-terminated
  char bus[32];    // the device's PCI bus id
  int64_t pid;     // the process
};

std::string HostIdentity() {
  std::string boot;
  std::ifstream("/proc/sys/kernel/random/boot_id") >> boot;
  char name[128] = {0};
  gethostname(name, sizeof(name) - 1);
  return absl::StrCat(boot, "/", name);
}

// The step's host agreement record (AgreeOnStep).
struct StepRecord {
  int64_t epoch;
  int64_t r;
  int64_t ready;   // 1: this rank's step can start
  uint64_t route;  // the route map's table fingerprint (mask included)
};

// The options whose window the members of `map` map (the window depends on
// the ranks, not on the expert numbering; E stays the workspace's, >= top_k).
core::EpDispatcherOptions WindowOptionsFor(core::EpDispatcherOptions o,
                                           const OneSidedRouteMap& map) {
  o.workspace.ep_size = map.ep_size();
  o.redundant_slots_per_rank = 0;
  return o;
}

// The dispatcher's options for `map` (server/onesided_route_map.h): the
// live ranks and their ids.
core::EpDispatcherOptions DispatchOptionsFor(core::EpDispatcherOptions o,
                                             const OneSidedRouteMap& map) {
  o.workspace.ep_size = map.ep_size();
  // Invalid and lost choices arrive as -1; the configured invalid id stays
  // when it is still "no expert" in the dispatcher's ids (the padding ids an
  // engine reads back from dispatch: server/onesided_engine_calls.cc).
  if (o.invalid_expert_id != -1 && o.num_experts != map.num_dispatch_experts) {
    o.invalid_expert_id = -1;
  }
  o.num_experts = map.num_dispatch_experts;
  o.redundant_slots_per_rank = 0;
  return o;
}

}  // namespace

absl::StatusOr<bool> ProbeOneSidedPlane(core::ControlCollective& control, int device,
                                        std::string* why) {
  PlaceRecord mine;
  std::memset(&mine, 0, sizeof(mine));
  const std::string host = HostIdentity();
  std::memcpy(mine.host, host.data(), std::min(host.size(), sizeof(mine.host) - 1));
  ASSIGN_OR_RETURN(const std::string bus, kernels::PciBusId(device));
  std::memcpy(mine.bus, bus.data(), std::min(bus.size(), sizeof(mine.bus) - 1));
  mine.pid = static_cast<int64_t>(getpid());
  const int world = control.size();
  std::vector<PlaceRecord> all(world);
  RETURN_IF_ERROR(control.AllGather(&mine, sizeof(mine), all.data()));
  for (int r = 0; r < world; ++r) {
    if (std::strncmp(all[r].host, all[0].host, sizeof(mine.host)) != 0) {
      *why =
          absl::StrCat("rank ", r, " runs on another host than rank 0 (CUDA IPC needs one host)");
      return false;
    }
    for (int s = 0; s < r; ++s) {
      if (all[s].pid == all[r].pid) {
        *why = absl::StrCat("ranks ", s, " and ", r,
                            " are one process (CUDA IPC maps other processes' windows only)");
        return false;
      }
    }
  }
  // Each rank's verdict on reaching every other rank's distinct device.
  int32_t reach = -1;  // the first rank this one cannot reach, or -1
  for (int r = 0; r < world && reach < 0; ++r) {
    if (std::strncmp(all[r].bus, mine.bus, sizeof(mine.bus)) == 0) continue;
    if (!kernels::CanReachPeer(device,
                               std::string(all[r].bus, strnlen(all[r].bus, sizeof(all[r].bus))))) {
      reach = r;
    }
  }
  std::vector<int32_t> verdicts(world);
  RETURN_IF_ERROR(control.AllGather(&reach, sizeof(reach), verdicts.data()));
  for (int r = 0; r < world; ++r) {
    if (verdicts[r] >= 0) {
      *why = absl::StrCat("rank ", r, "'s GPU (", all[r].bus, ") cannot reach rank ", verdicts[r],
                          "'s GPU (", all[verdicts[r]].bus, ") peer to peer");
      return false;
    }
  }
  return true;
}

absl::StatusOr<std::unique_ptr<OneSidedDataPlane>> OneSidedDataPlane::Form(
    const DataPlaneGroup& group, std::unique_ptr<core::GlooCollective> control) {
  if (control == nullptr) return absl::InvalidArgumentError("OneSidedDataPlane: null collective");
  std::unique_ptr<OneSidedDataPlane> plane(new OneSidedDataPlane());
  const bool alone = group.rejoin && group.world_size > 1;
  plane->compact_ = control.get();
  plane->mask_.live.assign(group.world_size, !alone);
  if (alone) {
    // A returning rank: a group of itself, every other rank masked.
    plane->mask_.live[group.rank] = true;
    ASSIGN_OR_RETURN(plane->control_, core::MaskedCollective::Create(std::move(control), group.rank,
                                                                     plane->mask_.live));
  } else if (control->size() != group.world_size || control->rank() != group.rank) {
    return absl::InvalidArgumentError(
        absl::StrCat("OneSidedDataPlane: the collective is rank ", control->rank(), " of ",
                     control->size(), ", the group rank ", group.rank, " of ", group.world_size));
  } else {
    plane->control_ = std::move(control);
  }
  plane->group_ = group;
  RETURN_IF_ERROR(plane->MakeDeviceCurrent());
  ASSIGN_OR_RETURN(plane->events_, kernels::GpuPlaneEvents::Create());
  ASSIGN_OR_RETURN(plane->host_counts_,
                   kernels::AllocatePinned(2 * kernels::kMaxEpSize * 4, "step counts"));
  return plane;
}

OneSidedDataPlane::OneSidedDataPlane()
    : DataPlane(PlaneKind::kOneSided, kernels::onesided::OneSidedDispatcher::kLimits) {}

OneSidedDataPlane::~OneSidedDataPlane() {
  (void)MakeDeviceCurrent();
  experts_.Clear();
  // The dispatcher's destructor waits for its stream; a step that failed
  // on a deadline has already been waited for (CheckStep bounds it).
  UseDispatcher(nullptr, 0);
  dispatcher_.reset();
  staging_.reset();
  windows_.reset();
  events_.reset();
}

absl::Status OneSidedDataPlane::MakeDeviceCurrent() const {
  return kernels::SetDevice(group_.device);
}

kernels::onesided::OneSidedDispatcherOptions OneSidedDataPlane::DispatcherOptions(
    const core::EpDispatcherOptions& options, int64_t max_intermediate) const {
  kernels::onesided::OneSidedDispatcherOptions o;
  o.dispatcher = options;
  o.max_intermediate = max_intermediate;
  o.timeout = group_.timeout;
  o.sm_budget = group_.onesided_sm_budget;
  o.receive_buffers = group_.onesided_receive_buffers;
  return o;
}

absl::Status OneSidedDataPlane::UseAgreement(MaskAgreement agreed, int /*agreed_round*/) {
  core::GlooCollective* members = agreed.group.get();
  ASSIGN_OR_RETURN(
      std::unique_ptr<core::MaskedCollective> masked,
      core::MaskedCollective::Create(std::move(agreed.group), group_.rank, agreed.live));
  RETURN_IF_ERROR(MakeDeviceCurrent());
  // No kernel of this plane runs now (the failed step was waited for, with
  // a bound, before its call returned): the old dispatcher and windows go,
  // and with them this process's mapping of a lost peer's window, which is
  // never touched again. The members' windows are made at their next
  // Forward or Allocate (MakeWindowsIfDropped).
  dispatcher_.reset();
  ServeDispatcher();
  if (windows_ != nullptr || staging_ != nullptr) windows_dropped_ = true;
  windows_.reset();
  dispatch_ep_ = 0;
  dispatch_experts_ = 0;
  control_ = std::move(masked);
  compact_ = members;
  control_->SetCallDeadline(CollectiveDeadline(call_));
  return absl::OkStatus();
}

absl::StatusOr<DataPlaneAllocation> OneSidedDataPlane::Allocate(
    const core::EpDispatcherOptions& options, int64_t max_intermediate, int64_t memory_cap_bytes) {
  RETURN_IF_ERROR(MakeDeviceCurrent());
  const core::WorkspaceSpec& ws = options.workspace;
  ASSIGN_OR_RETURN(const int64_t window_bytes,
                   OneSidedDispatcher::WindowBytes(options, group_.onesided_receive_buffers));
  const int64_t staging_bytes =
      kernels::StepStaging::Bytes(ws.capacity_tokens, ws.hidden, ws.top_k);
  int64_t cap = 0;
  if (memory_cap_bytes > 0) {
    cap = memory_cap_bytes - staging_bytes;
    if (cap <= window_bytes) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "AllocateWorkspace: the one-sided plane's window (", window_bytes,
          " bytes) and forward staging (", staging_bytes, " bytes) exceed the memory cap of ",
          memory_cap_bytes, " bytes (--memory-cap-bytes)"));
    }
  }
  ASSIGN_OR_RETURN(core::PlacementTable contiguous,
                   core::PlacementTable::Contiguous(options.num_experts, ws.ep_size));
  // The members' windows and ids (all ranks without a mask).
  ASSIGN_OR_RETURN(const core::PlacementTable served,
                   mask_.MaskedRanks().empty() ? contiguous : contiguous.WithMask(mask_.live));
  const OneSidedRouteMap map = MakeOneSidedRouteMap(served);
  const core::EpDispatcherOptions dispatch = DispatchOptionsFor(options, map);
  ASSIGN_OR_RETURN(const int64_t member_window_bytes,
                   OneSidedDispatcher::WindowBytes(WindowOptionsFor(options, map),
                                                   group_.onesided_receive_buffers));
  // No peer may still use the old windows once they go.
  RETURN_IF_ERROR(compact_->Barrier());
  ForgetExperts();
  dispatcher_.reset();
  staging_.reset();
  ServeDispatcher();
  windows_.reset();
  windows_dropped_ = false;
  geometry_ = {};
  ASSIGN_OR_RETURN(windows_, kernels::onesided::CreateIpcPeerWindows(compact_, group_.device,
                                                                     member_window_bytes));
  // Under a mask (a returning rank alone) the members' ids may number fewer
  // experts than top_k: the dispatcher is made at the first Forward after
  // Readmit (UseRouteMap).
  const bool masked = !mask_.MaskedRanks().empty();
  absl::StatusOr<std::unique_ptr<OneSidedDispatcher>> dispatcher =
      masked ? std::unique_ptr<OneSidedDispatcher>()
             : OneSidedDispatcher::Create(windows_.get(),
                                          DispatcherOptions(dispatch, max_intermediate), cap);
  if (!dispatcher.ok()) {
    windows_.reset();
    if (dispatcher.status().code() == absl::StatusCode::kResourceExhausted &&
        memory_cap_bytes > 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "AllocateWorkspace: ", dispatcher.status().message(), " (--memory-cap-bytes)"));
    }
    return dispatcher.status();
  }
  ASSIGN_OR_RETURN(staging_, kernels::StepStaging::Create(ws.capacity_tokens, ws.hidden, ws.top_k));
  dispatcher_ = std::move(*dispatcher);
  ServeDispatcher();
  dispatcher_cap_ = cap;
  dispatch_ep_ = masked ? 0 : map.ep_size();
  dispatch_experts_ = masked ? 0 : map.num_dispatch_experts;

  DataPlaneAllocation allocation;
  const int64_t rest = masked ? 0 : dispatcher_->allocated_bytes() - member_window_bytes;
  allocation.regions.push_back({"peer_window", 0, member_window_bytes});
  allocation.regions.push_back({"local_state_and_expert_scratch", member_window_bytes, rest});
  allocation.regions.push_back({"forward_staging", member_window_bytes + rest, staging_bytes});
  allocation.allocated_bytes = allocated_bytes();
  book_.Reset(std::make_shared<const core::PlacementTable>(std::move(contiguous)));
  book_.SetLive(mask_.live);
  shared_.Reset(ws.capacity_tokens, ws.hidden);
  options_ = options;
  max_intermediate_ = max_intermediate;
  NewWorkspaceToken();
  return allocation;
}

void OneSidedDataPlane::ServeDispatcher() {
  UseDispatcher(dispatcher_.get(), staging_ != nullptr ? staging_->bytes() : 0);
}

absl::StatusOr<int64_t> OneSidedDataPlane::LoadExperts(int layer, const core::ExpertSource& source,
                                                       int64_t memory_cap_bytes) {
  if (staging_ == nullptr) {
    return absl::FailedPreconditionError("LoadExperts: no workspace; call Allocate first");
  }
  // An installed table is checked slot by slot; without one, the range of
  // the contiguous placement (and its message).
  RETURN_IF_ERROR(
      CheckExpertSourceForWorkspace(source, options_, group_.rank, book_.Installed(layer)));
  RETURN_IF_ERROR(CheckGpuExpertSource(source));
  RETURN_IF_ERROR(MakeDeviceCurrent());
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceExpertSet> device,
                   kernels::DeviceExpertSet::Load(source));
  if (source.expert_kind() == core::ExpertKind::kSwiGlu &&
      source.intermediate > max_intermediate_ && dispatcher_ != nullptr) {
    // More expert scratch: a new dispatcher over the same windows (Create
    // touches no window; the step counter lives there and carries on).
    ASSIGN_OR_RETURN(
        const int64_t cap,
        GrownScratchCap(layer, source.intermediate, max_intermediate_, device->weight_bytes(),
                        staging_->bytes() + shared_.ScratchBytes(), memory_cap_bytes));
    core::EpDispatcherOptions dispatch = options_;
    dispatch.workspace.ep_size = dispatch_ep_;
    dispatch.num_experts = dispatch_experts_;
    dispatch.invalid_expert_id = -1;
    dispatch.redundant_slots_per_rank = 0;
    ASSIGN_OR_RETURN(std::unique_ptr<OneSidedDispatcher> grown,
                     OneSidedDispatcher::Create(
                         windows_.get(), DispatcherOptions(dispatch, source.intermediate), cap));
    if (geometry_.committed) {
      RETURN_IF_ERROR(
          grown->CommitGeometry(geometry_.epoch, geometry_.runtime_max_tokens_per_rank, 0));
    }
    dispatcher_ = std::move(grown);  // the old one waits for its stream as it goes
    ServeDispatcher();
    dispatcher_cap_ = cap;
    max_intermediate_ = source.intermediate;
    NewWorkspaceToken();
  } else if (source.expert_kind() == core::ExpertKind::kSwiGlu &&
             source.intermediate > max_intermediate_) {
    // Windows dropped by a mask: the next dispatcher is made with this I.
    max_intermediate_ = source.intermediate;
  }
  const int64_t bytes = device->weight_bytes();
  experts_.Put(layer, std::move(device));
  return bytes;
}

absl::StatusOr<int64_t> OneSidedDataPlane::HoldSharedExpert(
    int layer, std::optional<core::SharedExpert> shared, int64_t others_bytes,
    int64_t memory_cap_bytes) {
  if (staging_ == nullptr) {
    return absl::FailedPreconditionError("LoadSharedExpert: no workspace; call Allocate first");
  }
  RETURN_IF_ERROR(MakeDeviceCurrent());
  return shared_.Load(layer, std::move(shared), others_bytes, memory_cap_bytes);
}

absl::Status OneSidedDataPlane::InstallPlacement(
    int layer, std::shared_ptr<const core::PlacementTable> table) {
  if (staging_ == nullptr) {
    return absl::FailedPreconditionError("InstallPlacement: no workspace; call Allocate first");
  }
  if (table == nullptr) return absl::InvalidArgumentError("InstallPlacement: null table");
  RETURN_IF_ERROR(core::ValidatePlacement(*table, options_));
  // Any table: the route map numbers every rank's slots (DESIGN §17). The
  // layer's experts stay when they are this rank's new distinct slot
  // experts, else they go (LoadExperts again).
  experts_.KeepIfSlotsOf(layer, *table, group_.rank);
  book_.Install(layer, std::move(table));
  return absl::OkStatus();
}

absl::Status OneSidedDataPlane::MakeWindowsIfDropped() {
  if (!windows_dropped_ || staging_ == nullptr) return absl::OkStatus();
  ASSIGN_OR_RETURN(const core::PlacementTable served, book_.contiguous()->WithMask(mask_.live));
  const OneSidedRouteMap map = MakeOneSidedRouteMap(served);
  ASSIGN_OR_RETURN(const int64_t bytes,
                   OneSidedDispatcher::WindowBytes(WindowOptionsFor(options_, map),
                                                   group_.onesided_receive_buffers));
  ASSIGN_OR_RETURN(windows_,
                   kernels::onesided::CreateIpcPeerWindows(compact_, group_.device, bytes));
  windows_dropped_ = false;
  return absl::OkStatus();
}

absl::Status OneSidedDataPlane::UseRouteMap(const OneSidedRouteMap& map) {
  if (windows_ == nullptr) {
    return absl::FailedPreconditionError("Forward: no peer windows; call AllocateWorkspace");
  }
  if (dispatcher_ != nullptr && dispatch_ep_ == map.ep_size() &&
      dispatch_experts_ == map.num_dispatch_experts) {
    return absl::OkStatus();
  }
  // Create touches no window; the step counter lives there and carries on.
  dispatcher_.reset();  // waits for its stream
  ServeDispatcher();
  ASSIGN_OR_RETURN(
      dispatcher_,
      OneSidedDispatcher::Create(
          windows_.get(), DispatcherOptions(DispatchOptionsFor(options_, map), max_intermediate_),
          dispatcher_cap_));
  ServeDispatcher();
  dispatch_ep_ = map.ep_size();
  dispatch_experts_ = map.num_dispatch_experts;
  NewWorkspaceToken();  // new buffers: graphs of engine calls must be captured again
  if (geometry_.committed) {
    RETURN_IF_ERROR(
        dispatcher_->CommitGeometry(geometry_.epoch, geometry_.runtime_max_tokens_per_rank, 0));
  }
  return absl::OkStatus();
}

absl::Status OneSidedDataPlane::AgreeOnStep(const absl::Status& local, uint64_t route) {
  StepRecord mine{dispatcher_ ? dispatcher_->epoch() : -1,
                  dispatcher_ ? dispatcher_->runtime_max_tokens_per_rank() : -1, local.ok() ? 1 : 0,
                  route};
  const int members = compact_->size();
  std::vector<StepRecord> all(members);
  RETURN_IF_ERROR(compact_->AllGather(&mine, sizeof(mine), all.data()));
  RETURN_IF_ERROR(local);
  std::vector<int> original;  // member index -> rank
  for (int r = 0; r < group_.world_size; ++r) {
    if (mask_.live[r]) original.push_back(r);
  }
  for (int m = 0; m < members; ++m) {
    const int r = m < static_cast<int>(original.size()) ? original[m] : m;
    // A rank that could not start sends no route: its own error is the cause.
    if (all[m].ready == 0) {
      return absl::AbortedError(absl::StrCat("Forward: rank ", r,
                                             " could not start this step (its reply says why); "
                                             "no rank ran it"));
    }
    if (all[m].route != mine.route) {
      return absl::AbortedError(absl::StrCat(
          "Forward: rank ", r, " routes by another placement table or rank mask (fingerprint ",
          all[m].route, ", rank ", group_.rank, " has ", mine.route,
          "); install the same table on every rank"));
    }
    if (all[m].epoch != mine.epoch || all[m].r != mine.r) {
      return absl::AbortedError(absl::StrCat(
          "geometry mismatch: rank ", r, " has (epoch ", all[m].epoch, ", R ", all[m].r, "), rank ",
          group_.rank, " has (epoch ", mine.epoch, ", R ", mine.r, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<core::StepStats> OneSidedDataPlane::RunForward(int layer, const HostForward& io,
                                                              int64_t num_tokens) {
  return RunOnHostTensors(io, [&](auto hidden, auto topk_ids, auto topk_weights, auto output) {
    return StepOnHost(layer, hidden, topk_ids, topk_weights, num_tokens, output);
  });
}

absl::StatusOr<core::StepStats> OneSidedDataPlane::StepOnHost(
    int layer, absl::Span<const core::bf16_t> hidden, absl::Span<const int32_t> topk_ids,
    absl::Span<const float> topk_weights, int64_t num_tokens, absl::Span<core::bf16_t> output) {
  const int64_t h = options_.workspace.hidden;
  const int k = options_.workspace.top_k;
  // The call gate (server/call_gate.h) before anything collective: every
  // rank stops together once one is past its deadline or cancelled.
  RETURN_IF_ERROR(CallGate(*control_, call_,
                           absl::StrCat("Forward (layer ", layer, "): before dispatch"),
                           kForwardStopHint));
  absl::Status local = MakeDeviceCurrent();
  // After a mask every member is in this call (WorkerService aligns them).
  // A rank whose windows fail still reaches the step agreement below, so no
  // peer waits on it.
  const bool makes_windows = windows_dropped_;
  if (local.ok()) local = MakeWindowsIfDropped();
  kernels::DeviceExpertSet* experts = experts_.Find<kernels::DeviceExpertSet>(layer);
  if (local.ok() && staging_ == nullptr) {
    local = absl::FailedPreconditionError("Forward: no workspace; call AllocateWorkspace first");
  }
  if (local.ok() && experts == nullptr) {
    local = ExpertsNotLoaded("Forward", layer);
  }
  if (local.ok() && !geometry_.committed) {
    local = absl::FailedPreconditionError("Forward: no geometry committed; call CommitGeometry");
  }
  if (local.ok() && (num_tokens < 0 || num_tokens > geometry_.runtime_max_tokens_per_rank)) {
    local = absl::InvalidArgumentError(absl::StrCat(
        "Forward on rank ", group_.rank, ": num_tokens: expected in [0, ",
        geometry_.runtime_max_tokens_per_rank, "] (the committed R), got ", num_tokens));
  }
  if (local.ok() && (static_cast<int64_t>(hidden.size()) != num_tokens * h ||
                     static_cast<int64_t>(topk_ids.size()) != num_tokens * k ||
                     static_cast<int64_t>(topk_weights.size()) != num_tokens * k ||
                     static_cast<int64_t>(output.size()) != num_tokens * h)) {
    local = absl::InvalidArgumentError(
        absl::StrCat("Forward on rank ", group_.rank, ": tensor sizes expected hidden/output ",
                     num_tokens * h, " and topk ", num_tokens * k, " elements, got ", hidden.size(),
                     ", ", topk_ids.size(), ", ", topk_weights.size(), ", ", output.size()));
  }
  // The layer's table under the mask, in the dispatcher's ids (DESIGN §15).
  const std::shared_ptr<const core::PlacementTable> table = Placement(layer);
  uint64_t route = 0;
  OneSidedChoices choices;
  if (local.ok()) {
    const OneSidedRouteMap map = MakeOneSidedRouteMap(*table);
    local = UseRouteMap(map);
    // This rank's slots answer to their dispatch ids (the expert set's
    // slots are its distinct slot experts, as the map's).
    if (local.ok()) {
      local = experts->Renumber(OneSidedSlotIds(map, group_.rank), dispatcher_->stream());
    }
    if (local.ok()) {
      route = map.table_fingerprint;
      choices = MapOneSidedChoices(*table, map, group_.rank, topk_ids, topk_weights, num_tokens, k);
    }
  }
  if (absl::Status agreed = AgreeOnStep(local, route); !agreed.ok()) {
    if (makes_windows) {
      // Every member made windows in this call (or failed to): drop them on
      // every rank alike, so the next Forward makes them again together.
      dispatcher_.reset();
      ServeDispatcher();
      windows_.reset();
      windows_dropped_ = true;
    }
    return agreed;
  }

  cudaStream_t stream = dispatcher_->stream();
  RETURN_IF_ERROR(staging_->Upload(reinterpret_cast<const uint16_t*>(hidden.data()),
                                   choices.ids.data(), choices.weights.data(), num_tokens, stream));
  const bool has_shared = shared_.Has(layer);
  if (has_shared) RETURN_IF_ERROR(shared_.Begin(layer, staging_->hidden(), num_tokens, stream));
  RETURN_IF_ERROR(events_->Record(0, stream));
  RETURN_IF_ERROR(dispatcher_->Dispatch(staging_->hidden(), staging_->topk_ids(),
                                        staging_->topk_weights(), num_tokens));
  RETURN_IF_ERROR(events_->Record(1, stream));
  absl::Status computed = dispatcher_->ComputeExperts(*experts);
  if (computed.ok() && has_shared) computed = shared_.JoinInto(stream);
  RETURN_IF_ERROR(events_->Record(2, stream));
  // Combine even when this rank's compute failed: the peers wait for its
  // combine flags (the output is then not used).
  absl::Status combined = dispatcher_->Combine(
      staging_->output(), computed.ok() && has_shared ? shared_.output() : nullptr);
  RETURN_IF_ERROR(events_->Record(3, stream));
  const int members = dispatch_ep_;
  auto* host_counts = static_cast<int32_t*>(host_counts_.get());
  RETURN_IF_ERROR(kernels::CopyToHostAsync(host_counts, dispatcher_->send_counts(), members * 4,
                                           stream, "send counts to host"));
  RETURN_IF_ERROR(kernels::CopyToHostAsync(host_counts + members, dispatcher_->recv_counts(),
                                           members * 4, stream, "receive counts to host"));
  // The bounded wait: kAborted (geometry) or kDeadlineExceeded (a peer).
  RETURN_IF_ERROR(dispatcher_->CheckStep());
  RETURN_IF_ERROR(computed);
  RETURN_IF_ERROR(combined);
  if (num_tokens > 0) {
    RETURN_IF_ERROR(kernels::CopyToHost(output.data(), staging_->output(), num_tokens * h * 2,
                                        "output to host"));
  }

  ASSIGN_OR_RETURN(core::StepStats stats,
                   StepCountStats(host_counts, members, compact_->rank(), options_.workspace,
                                  dispatcher_->runtime_max_tokens_per_rank()));
  stats.lost_choices = choices.lost_choices;
  stats.lost_experts = std::move(choices.lost_experts);
  core::ExpertLoadCounts step;
  step.tokens_per_expert.assign(options_.num_experts, 0);
  step.steps = 1;
  core::CountExpertTokens(topk_ids, options_.num_experts, absl::MakeSpan(step.tokens_per_expert));
  // Keyed like the CPU plane's: a step resent after a mask counts once.
  book_.AddLoad(
      layer, step,
      core::LoadStepKey{geometry_.epoch, mask_.round, core::RoutingFingerprint(topk_ids)});
  RETURN_IF_ERROR(AddStepTimes(*events_, has_shared ? &shared_ : nullptr, &stats));
  return stats;
}

absl::StatusOr<std::unique_ptr<BenchmarkRun>> OneSidedDataPlane::MakeBenchmarkRun(
    const core::EpDispatcherOptions& options, const BenchmarkInputs& inputs,
    int64_t memory_cap_bytes, const std::string& /*plane*/) {
  if (!mask_.MaskedRanks().empty()) {
    return absl::FailedPreconditionError(
        "Benchmark: the one-sided plane serves a rank mask; Benchmark needs every rank");
  }
  RETURN_IF_ERROR(MakeDeviceCurrent());
  const int members = compact_->size();
  const int64_t tokens = inputs.num_tokens;
  const int64_t h = options.workspace.hidden;
  const int k = options.workspace.top_k;
  const int64_t input_bytes = kernels::StepStaging::Bytes(tokens, h, k);
  ASSIGN_OR_RETURN(const int64_t cap, DeviceScratchCap(input_bytes, memory_cap_bytes));
  ASSIGN_OR_RETURN(const int64_t window_bytes, OneSidedDispatcher::WindowBytes(options));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::onesided::PeerWindows> windows,
                   kernels::onesided::CreateIpcPeerWindows(compact_, group_.device, window_bytes));
  // The bench's own windows: no engine fills receive buffers in them.
  kernels::onesided::OneSidedDispatcherOptions bench_options = DispatcherOptions(options, 0);
  bench_options.receive_buffers = false;
  ASSIGN_OR_RETURN(std::unique_ptr<OneSidedDispatcher> bench,
                   OneSidedDispatcher::Create(windows.get(), bench_options, cap));
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(options.num_experts, members));
  ASSIGN_OR_RETURN(
      std::unique_ptr<kernels::DeviceExpertSet> identity,
      kernels::DeviceExpertSet::Upload(core::ExpertSet::Identity(
          placement.FirstExpert(group_.rank), placement.NumLocalExperts(group_.rank), h)));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::StepStaging> buffers,
                   kernels::StepStaging::Create(tokens, h, k));
  RETURN_IF_ERROR(buffers->Upload(reinterpret_cast<const uint16_t*>(inputs.hidden.data()),
                                  inputs.topk_ids.data(), inputs.topk_weights.data(), tokens,
                                  bench->stream()));
  RETURN_IF_ERROR(bench->CommitGeometry(1, tokens, tokens));
  OneSidedDispatcher* d = bench.get();
  GpuBenchmarkHooks hooks;
  hooks.wait = [d] { return d->CheckStep(); };
  hooks.tokens_sent = [d, members] {
    return kernels::DeviceTokensSent(d->send_counts(), members, d->stream());
  };
  // No peer may still store into the scratch windows once they go.
  hooks.finish = [this] { return compact_->Barrier(); };
  return std::make_unique<GpuBenchmarkRun<OneSidedDispatcher>>(
      std::move(windows), std::move(bench), std::move(identity), std::move(buffers), tokens,
      events_.get(), std::move(hooks));
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
