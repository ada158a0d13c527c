#include "server/onesided_data_plane.h"

#ifdef MOE_EP_HAVE_CUDA

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/routing.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "server/call_gate.h"

namespace moe_ep::server {
namespace {

using kernels::onesided::OneSidedDispatcher;

absl::Status Cuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

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
  int64_t ready;  // 1: this rank's step can start
};

}  // namespace

absl::StatusOr<bool> ProbeOneSidedPlane(core::ControlCollective& control, int device,
                                        std::string* why) {
  PlaceRecord mine;
  std::memset(&mine, 0, sizeof(mine));
  const std::string host = HostIdentity();
  std::memcpy(mine.host, host.data(), std::min(host.size(), sizeof(mine.host) - 1));
  RETURN_IF_ERROR(Cuda(cudaDeviceGetPCIBusId(mine.bus, sizeof(mine.bus), device),
                       absl::StrCat("cudaDeviceGetPCIBusId(", device, ")")));
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
    int peer = -1;
    int can = 0;
    if (cudaDeviceGetByPCIBusId(&peer, all[r].bus) != cudaSuccess ||
        cudaDeviceCanAccessPeer(&can, device, peer) != cudaSuccess || can == 0) {
      cudaGetLastError();
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
  std::unique_ptr<OneSidedDataPlane> plane(new OneSidedDataPlane());
  plane->control_ = std::move(control);
  plane->device_ = group.device;
  plane->rank_ = group.rank;
  plane->world_ = group.world_size;
  plane->timeout_ = group.timeout;
  RETURN_IF_ERROR(plane->MakeDeviceCurrent());
  for (cudaEvent_t& event : plane->events_) {
    RETURN_IF_ERROR(Cuda(cudaEventCreate(&event), "cudaEventCreate"));
  }
  RETURN_IF_ERROR(Cuda(cudaMallocHost(&plane->host_counts_, 2 * kernels::kMaxEpSize * 4),
                       "cudaMallocHost(step counts)"));
  return plane;
}

OneSidedDataPlane::~OneSidedDataPlane() {
  (void)MakeDeviceCurrent();
  experts_.clear();
  // The dispatcher's destructor waits for its stream; a step that failed
  // on a deadline has already been waited for (CheckStep bounds it).
  dispatcher_.reset();
  staging_.reset();
  windows_.reset();
  for (cudaEvent_t event : events_) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  cudaFreeHost(host_counts_);
}

absl::Status OneSidedDataPlane::MakeDeviceCurrent() const {
  return Cuda(cudaSetDevice(device_), absl::StrCat("cudaSetDevice(", device_, ")"));
}

kernels::onesided::OneSidedDispatcherOptions OneSidedDataPlane::DispatcherOptions(
    const core::EpDispatcherOptions& options, int64_t max_intermediate) const {
  kernels::onesided::OneSidedDispatcherOptions o;
  o.dispatcher = options;
  o.max_intermediate = max_intermediate;
  o.timeout = timeout_;
  return o;
}

int64_t OneSidedDataPlane::TotalExpertBytes() const {
  int64_t total = 0;
  for (const auto& [layer, experts] : experts_) total += experts->weight_bytes();
  return total + shared_.TotalBytes();
}

absl::StatusOr<DataPlaneAllocation> OneSidedDataPlane::Allocate(
    const core::EpDispatcherOptions& options, int64_t max_intermediate, int64_t memory_cap_bytes) {
  RETURN_IF_ERROR(MakeDeviceCurrent());
  const core::WorkspaceSpec& ws = options.workspace;
  ASSIGN_OR_RETURN(const int64_t window_bytes, OneSidedDispatcher::WindowBytes(options));
  const int64_t staging_bytes = DeviceStepBuffers::Bytes(ws.capacity_tokens, ws.hidden, ws.top_k);
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
  // No peer may still use the old windows once they go.
  RETURN_IF_ERROR(control_->Barrier());
  experts_.clear();
  dispatcher_.reset();
  staging_.reset();
  windows_.reset();
  geometry_committed_ = false;
  ASSIGN_OR_RETURN(windows_,
                   kernels::onesided::CreateIpcPeerWindows(control_.get(), device_, window_bytes));
  absl::StatusOr<std::unique_ptr<OneSidedDispatcher>> dispatcher =
      OneSidedDispatcher::Create(windows_.get(), DispatcherOptions(options, max_intermediate), cap);
  if (!dispatcher.ok()) {
    windows_.reset();
    if (dispatcher.status().code() == absl::StatusCode::kResourceExhausted &&
        memory_cap_bytes > 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "AllocateWorkspace: ", dispatcher.status().message(), " (--memory-cap-bytes)"));
    }
    return dispatcher.status();
  }
  ASSIGN_OR_RETURN(staging_, DeviceStepBuffers::Create(ws.capacity_tokens, ws.hidden, ws.top_k));
  dispatcher_ = std::move(*dispatcher);

  DataPlaneAllocation allocation;
  const int64_t rest = dispatcher_->allocated_bytes() - window_bytes;
  allocation.regions.push_back({"peer_window", 0, window_bytes});
  allocation.regions.push_back({"local_state_and_expert_scratch", window_bytes, rest});
  allocation.regions.push_back({"forward_staging", window_bytes + rest, staging_bytes});
  allocation.allocated_bytes = allocated_bytes();
  book_.Reset(std::make_shared<const core::PlacementTable>(std::move(contiguous)));
  shared_.Reset(ws.capacity_tokens, ws.hidden);
  options_ = options;
  max_intermediate_ = max_intermediate;
  NewWorkspaceToken();
  return allocation;
}

int64_t OneSidedDataPlane::allocated_bytes() const {
  if (dispatcher_ == nullptr) return 0;
  return dispatcher_->allocated_bytes() + staging_->bytes();
}

absl::StatusOr<int64_t> OneSidedDataPlane::LoadExperts(int layer, const core::ExpertSource& source,
                                                       int64_t memory_cap_bytes) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("LoadExperts: no workspace; call Allocate first");
  }
  RETURN_IF_ERROR(CheckExpertSourceForWorkspace(source, options_, rank_));
  RETURN_IF_ERROR(MakeDeviceCurrent());
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceExpertSet> device,
                   kernels::DeviceExpertSet::Load(source));
  if (source.expert_kind() == core::ExpertKind::kSwiGlu &&
      source.intermediate > max_intermediate_) {
    // More expert scratch: a new dispatcher over the same windows (Create
    // touches no window; the step counter lives there and carries on).
    int64_t cap = 0;
    if (memory_cap_bytes > 0) {
      cap = memory_cap_bytes - (TotalExpertBytes() - ExpertBytes(layer)) - device->weight_bytes() -
            staging_->bytes();
      if (cap <= 0) {
        return absl::ResourceExhaustedError(absl::StrCat(
            "LoadExperts: layer ", layer, " (intermediate ", source.intermediate,
            ") needs more expert scratch than the workspace was allocated with (intermediate ",
            max_intermediate_, "), and the memory cap of ", memory_cap_bytes,
            " bytes leaves no room; configure the model's moe_intermediate_size before "
            "AllocateWorkspace or raise --memory-cap-bytes"));
      }
    }
    ASSIGN_OR_RETURN(std::unique_ptr<OneSidedDispatcher> grown,
                     OneSidedDispatcher::Create(
                         windows_.get(), DispatcherOptions(options_, source.intermediate), cap));
    if (geometry_committed_) {
      RETURN_IF_ERROR(grown->CommitGeometry(dispatcher_->epoch(),
                                            dispatcher_->runtime_max_tokens_per_rank(), 0));
    }
    dispatcher_ = std::move(grown);  // the old one waits for its stream as it goes
    max_intermediate_ = source.intermediate;
    NewWorkspaceToken();
  }
  const int64_t bytes = device->weight_bytes();
  experts_.insert_or_assign(layer, std::move(device));
  return bytes;
}

int64_t OneSidedDataPlane::ExpertBytes(int layer) const {
  auto it = experts_.find(layer);
  return it == experts_.end() ? 0 : it->second->weight_bytes();
}

absl::StatusOr<int64_t> OneSidedDataPlane::LoadSharedExpert(
    int layer, std::optional<core::SharedExpert> shared, int64_t memory_cap_bytes) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("LoadSharedExpert: no workspace; call Allocate first");
  }
  RETURN_IF_ERROR(MakeDeviceCurrent());
  const int64_t others = allocated_bytes() + TotalExpertBytes() - shared_.TotalBytes();
  return shared_.Load(layer, std::move(shared), others, memory_cap_bytes);
}

absl::Status OneSidedDataPlane::InstallPlacement(
    int layer, std::shared_ptr<const core::PlacementTable> table) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("InstallPlacement: no workspace; call Allocate first");
  }
  if (table == nullptr) return absl::InvalidArgumentError("InstallPlacement: null table");
  if (table->Fingerprint() != book_.contiguous()->Fingerprint()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "InstallPlacement: layer ", layer,
        ": the one-sided data plane routes by the contiguous placement only; join with "
        "gpu_data_plane \"nccl\" to install EPLB tables"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> OneSidedDataPlane::SyncTokenCounts(int64_t local_tokens) {
  ASSIGN_OR_RETURN(std::vector<int64_t> counts, core::AllGatherInt64(*control_, local_tokens));
  if (local_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_tokens: expected >= 0 on rank ", rank_, ", got ", local_tokens));
  }
  for (int r = 0; r < static_cast<int>(counts.size()); ++r) {
    if (counts[r] < 0) {
      return absl::AbortedError(
          absl::StrCat("rank ", r, " reported an invalid local token count ", counts[r]));
    }
  }
  return counts;
}

absl::Status OneSidedDataPlane::CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                                               int64_t local_tokens) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("CommitGeometry: no workspace; call Allocate first");
  }
  RETURN_IF_ERROR(dispatcher_->CommitGeometry(epoch, runtime_max_tokens_per_rank, local_tokens));
  geometry_committed_ = true;
  return absl::OkStatus();
}

absl::Status OneSidedDataPlane::AgreeOnStep(const absl::Status& local) {
  StepRecord mine{dispatcher_ ? dispatcher_->epoch() : -1,
                  dispatcher_ ? dispatcher_->runtime_max_tokens_per_rank() : -1,
                  local.ok() ? 1 : 0};
  std::vector<StepRecord> all(world_);
  RETURN_IF_ERROR(control_->AllGather(&mine, sizeof(mine), all.data()));
  RETURN_IF_ERROR(local);
  for (int r = 0; r < world_; ++r) {
    if (all[r].ready == 0) {
      return absl::AbortedError(absl::StrCat("Forward: rank ", r,
                                             " could not start this step (its reply says why); "
                                             "no rank ran it"));
    }
    if (all[r].epoch != mine.epoch || all[r].r != mine.r) {
      return absl::AbortedError(absl::StrCat("geometry mismatch: rank ", r, " has (epoch ",
                                             all[r].epoch, ", R ", all[r].r, "), rank ", rank_,
                                             " has (epoch ", mine.epoch, ", R ", mine.r, ")"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<core::StepStats> OneSidedDataPlane::Forward(
    int layer, absl::Span<const core::bf16_t> hidden, absl::Span<const int32_t> topk_ids,
    absl::Span<const float> topk_weights, int64_t num_tokens, absl::Span<core::bf16_t> output) {
  const int64_t h = options_.workspace.hidden;
  const int k = options_.workspace.top_k;
  absl::Status local = MakeDeviceCurrent();
  auto experts = experts_.find(layer);
  if (local.ok() && dispatcher_ == nullptr) {
    local = absl::FailedPreconditionError("Forward: no workspace; call AllocateWorkspace first");
  }
  if (local.ok() && experts == experts_.end()) {
    local = absl::FailedPreconditionError(
        absl::StrCat("Forward: layer ", layer, " has no loaded experts; call LoadExperts first"));
  }
  if (local.ok() && !geometry_committed_) {
    local = absl::FailedPreconditionError("Forward: no geometry committed; call CommitGeometry");
  }
  if (local.ok() && (num_tokens < 0 || num_tokens > dispatcher_->runtime_max_tokens_per_rank())) {
    local = absl::InvalidArgumentError(absl::StrCat(
        "Forward on rank ", rank_, ": num_tokens: expected in [0, ",
        dispatcher_->runtime_max_tokens_per_rank(), "] (the committed R), got ", num_tokens));
  }
  if (local.ok() && (static_cast<int64_t>(hidden.size()) != num_tokens * h ||
                     static_cast<int64_t>(topk_ids.size()) != num_tokens * k ||
                     static_cast<int64_t>(topk_weights.size()) != num_tokens * k ||
                     static_cast<int64_t>(output.size()) != num_tokens * h)) {
    local = absl::InvalidArgumentError(
        absl::StrCat("Forward on rank ", rank_, ": tensor sizes expected hidden/output ",
                     num_tokens * h, " and topk ", num_tokens * k, " elements, got ", hidden.size(),
                     ", ", topk_ids.size(), ", ", topk_weights.size(), ", ", output.size()));
  }
  // The call gate (server/call_gate.h) before the step's agreement: every
  // rank stops together once one is past its deadline or cancelled.
  RETURN_IF_ERROR(CallGate(*control_, call_,
                           absl::StrCat("Forward (layer ", layer, "): before dispatch"),
                           kForwardStopHint));
  RETURN_IF_ERROR(AgreeOnStep(local));

  cudaStream_t stream = dispatcher_->stream();
  RETURN_IF_ERROR(staging_->Upload(reinterpret_cast<const uint16_t*>(hidden.data()),
                                   topk_ids.data(), topk_weights.data(), num_tokens, stream));
  const bool has_shared = shared_.Has(layer);
  if (has_shared) RETURN_IF_ERROR(shared_.Begin(layer, staging_->hidden(), num_tokens, stream));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(events_[0], stream), "cudaEventRecord"));
  RETURN_IF_ERROR(dispatcher_->Dispatch(staging_->hidden(), staging_->topk_ids(),
                                        staging_->topk_weights(), num_tokens));
  RETURN_IF_ERROR(Cuda(cudaEventRecord(events_[1], stream), "cudaEventRecord"));
  absl::Status computed = dispatcher_->ComputeExperts(*experts->second);
  if (computed.ok() && has_shared) computed = shared_.JoinInto(stream);
  RETURN_IF_ERROR(Cuda(cudaEventRecord(events_[2], stream), "cudaEventRecord"));
  // Combine even when this rank's compute failed: the peers wait for its
  // combine flags (the output is then not used).
  absl::Status combined = dispatcher_->Combine(
      staging_->output(), computed.ok() && has_shared ? shared_.output() : nullptr);
  RETURN_IF_ERROR(Cuda(cudaEventRecord(events_[3], stream), "cudaEventRecord"));
  RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(host_counts_, dispatcher_->send_counts(), world_ * 4,
                                       cudaMemcpyDeviceToHost, stream),
                       "cudaMemcpyAsync(send counts to host)"));
  RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(host_counts_ + world_, dispatcher_->recv_counts(),
                                       world_ * 4, cudaMemcpyDeviceToHost, stream),
                       "cudaMemcpyAsync(receive counts to host)"));
  // The bounded wait: kAborted (geometry) or kDeadlineExceeded (a peer).
  RETURN_IF_ERROR(dispatcher_->CheckStep());
  RETURN_IF_ERROR(computed);
  RETURN_IF_ERROR(combined);
  if (num_tokens > 0) {
    RETURN_IF_ERROR(Cuda(
        cudaMemcpy(output.data(), staging_->output(), num_tokens * h * 2, cudaMemcpyDeviceToHost),
        "cudaMemcpy(output to host)"));
  }

  ASSIGN_OR_RETURN(const int64_t dispatch_bytes,
                   core::DispatchBytesPerToken(options_.workspace.dtype, h, k));
  const int64_t combine_bytes = core::CombineBytesPerToken(h);
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = dispatcher_->runtime_max_tokens_per_rank();
  for (int p = 0; p < world_; ++p) {
    const int64_t sent = host_counts_[p];
    const int64_t received = host_counts_[world_ + p];
    stats.tokens_sent += sent;
    stats.tokens_received += received;
    if (p == rank_) continue;
    stats.bytes_sent_remote += sent * dispatch_bytes + received * combine_bytes;
  }
  core::ExpertLoadCounts step;
  step.tokens_per_expert.assign(options_.num_experts, 0);
  step.steps = 1;
  core::CountExpertTokens(topk_ids, options_.num_experts, absl::MakeSpan(step.tokens_per_expert));
  book_.AddLoad(layer, step);
  float ms[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    RETURN_IF_ERROR(
        Cuda(cudaEventElapsedTime(&ms[i], events_[i], events_[i + 1]), "cudaEventElapsedTime"));
  }
  stats.dispatch_us = static_cast<int64_t>(ms[0] * 1000.0f);
  stats.expert_us = static_cast<int64_t>(ms[1] * 1000.0f);
  stats.combine_us = static_cast<int64_t>(ms[2] * 1000.0f);
  if (has_shared) {
    ASSIGN_OR_RETURN(auto shared_times, shared_.Times(events_[0], events_[1]));
    stats.shared_us = shared_times.first;
    stats.shared_overlap_us = shared_times.second;
  }
  return stats;
}

absl::StatusOr<BenchmarkTimes> OneSidedDataPlane::Benchmark(
    const core::EpDispatcherOptions& options, const BenchmarkInputs& inputs, int warmup,
    int iterations, int64_t memory_cap_bytes, const std::string& data_plane) {
  ASSIGN_OR_RETURN(const std::string plane,
                   ResolveBenchmarkPlane(data_plane, this->data_plane(), {}));
  RETURN_IF_ERROR(MakeDeviceCurrent());
  const int64_t tokens = inputs.num_tokens;
  const int64_t h = options.workspace.hidden;
  const int k = options.workspace.top_k;
  const int64_t input_bytes = DeviceStepBuffers::Bytes(tokens, h, k);
  int64_t cap = 0;
  if (memory_cap_bytes > 0) {
    cap = memory_cap_bytes - input_bytes;
    if (cap <= 0) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "Benchmark: inputs and output need ", input_bytes, " device bytes, more than the ",
          memory_cap_bytes, " bytes the memory cap leaves (--memory-cap-bytes)"));
    }
  }
  ASSIGN_OR_RETURN(const int64_t window_bytes, OneSidedDispatcher::WindowBytes(options));
  ASSIGN_OR_RETURN(std::unique_ptr<kernels::onesided::PeerWindows> windows,
                   kernels::onesided::CreateIpcPeerWindows(control_.get(), device_, window_bytes));
  absl::StatusOr<BenchmarkTimes> times;
  {
    ASSIGN_OR_RETURN(std::unique_ptr<OneSidedDispatcher> bench,
                     OneSidedDispatcher::Create(windows.get(), DispatcherOptions(options, 0), cap));
    ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                     core::ExpertPlacement::Contiguous(options.num_experts, world_));
    ASSIGN_OR_RETURN(std::unique_ptr<kernels::DeviceExpertSet> identity,
                     kernels::DeviceExpertSet::Upload(core::ExpertSet::Identity(
                         placement.FirstExpert(rank_), placement.NumLocalExperts(rank_), h)));
    ASSIGN_OR_RETURN(std::unique_ptr<DeviceStepBuffers> buffers,
                     DeviceStepBuffers::Create(tokens, h, k));
    RETURN_IF_ERROR(buffers->Upload(reinterpret_cast<const uint16_t*>(inputs.hidden.data()),
                                    inputs.topk_ids.data(), inputs.topk_weights.data(), tokens,
                                    bench->stream()));
    RETURN_IF_ERROR(bench->CommitGeometry(1, tokens, tokens));
    OneSidedDispatcher* d = bench.get();
    times = TimeIdentitySteps(*d, *identity, *buffers, tokens, warmup, iterations, *control_, call_,
                              events_, [d] { return d->CheckStep(); });
    if (times.ok()) {
      ASSIGN_OR_RETURN(core::DispatchRoute route,
                       core::ComputeDispatchRoute(inputs.topk_ids, tokens, k, placement));
      times->tokens_sent = static_cast<int64_t>(route.dest_rank.size());
      times->data_plane = plane;
    }
  }
  // No peer may still store into the scratch windows once they go.
  if (times.ok()) RETURN_IF_ERROR(control_->Barrier());
  return times;
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
