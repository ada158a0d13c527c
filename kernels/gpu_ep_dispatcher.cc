#include "kernels/gpu_ep_dispatcher.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "core/expert_source.h"
#include "core/geometry.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "kernels/combine_reduce.cuh"
#include "kernels/dispatch_pack.cuh"
#include "kernels/expert_id_error.h"
#include "kernels/fp8_dispatch.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/kernel_preload.h"
#include "kernels/peer_refusal.h"
#include "kernels/route.cuh"
#include "kernels/step_header.cuh"

namespace moe_ep::kernels {

using internal::CudaStatus;

absl::StatusOr<std::unique_ptr<GpuEpDispatcher>> GpuEpDispatcher::Create(
    StreamCollective* collective, const GpuEpDispatcherOptions& options, int64_t memory_cap_bytes) {
  if (collective == nullptr) return absl::InvalidArgumentError("collective: must not be null");
  const core::EpDispatcherOptions& o = options.dispatcher;
  const core::WorkspaceSpec& ws = o.workspace;
  RETURN_IF_ERROR(core::ValidateEpOptions(o, collective->size(), kGpuLimits));
  RETURN_IF_ERROR(core::ValidateMaxIntermediate(options.max_intermediate));
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(o.num_experts, ws.ep_size));
  ASSIGN_OR_RETURN(GpuWorkspaceLayout layout, GpuWorkspaceLayout::For(ws));

  std::unique_ptr<GpuEpDispatcher> d(new GpuEpDispatcher(collective, ws.capacity_tokens));
  d->layout_ = layout;
  d->options_ = options;
  d->ep_size_ = ws.ep_size;
  d->rank_ = collective->rank();
  d->capacity_ = ws.capacity_tokens;
  d->hidden_ = ws.hidden;
  d->top_k_ = ws.top_k;
  d->row_bytes_ = layout.wire_row_bytes;
  d->dtype_ = ws.dtype;
  d->counts_.assign(ws.ep_size, 0);
  d->header_counts_.assign(ws.ep_size, 3 * static_cast<int64_t>(sizeof(int64_t)));
  d->count_bytes_.assign(ws.ep_size, static_cast<int64_t>(sizeof(int32_t)));

  const int64_t e = ws.ep_size;
  const int64_t n = ws.capacity_tokens;
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective->device()), "cudaSetDevice"));
  if (options.tail_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("tail_bytes: expected >= 0, got %d", options.tail_bytes));
  }
  // Under a placement table a rank holds up to the slot budget's experts.
  const int max_local = std::max(placement.NumLocalExperts(d->rank_), core::SlotBudgetPerRank(o));
  ASSIGN_OR_RETURN(
      const int64_t scratch,
      ExpertCompute::ScratchBytes(e * n, ws.top_k, ws.hidden, options.max_intermediate, max_local));
  d->max_slots_ = ws.ep_size * core::SlotBudgetPerRank(o);
  const int64_t offsets_bytes = core::AlignTo128((o.num_experts + 1) * int64_t{4});
  const int64_t ranks_bytes = core::AlignTo128(d->max_slots_ * int64_t{4});
  const int64_t counters_bytes = core::AlignTo128(o.num_experts * int64_t{8});
  d->placement_bytes_ = offsets_bytes + ranks_bytes + counters_bytes;
  const int64_t total = layout.total_bytes;
  // Layout regions and scratch parts are multiples of 128 bytes, so the
  // scratch and the tail follow the layout 128-byte aligned, without padding.
  const int64_t scratch_offset = total;
  const int64_t tail_offset = total + scratch;
  const int64_t placement_offset = tail_offset + core::AlignTo128(options.tail_bytes);
  const int64_t with_scratch = placement_offset + d->placement_bytes_;
  d->placement_offset_ = placement_offset;
  if (memory_cap_bytes > 0 && with_scratch > memory_cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "GPU data plane of rank %d needs %d bytes (buffers %d + expert scratch %d + staging %d + "
        "placement table %d), cap is %d",
        d->rank_, with_scratch, total, scratch, options.tail_bytes, d->placement_bytes_,
        memory_cap_bytes));
  }
  // No lazy load on the step path (kernels/kernel_preload.h); after every
  // argument check, so bad input pays nothing.
  RETURN_IF_ERROR(PreloadStepKernels());
  // One cudaMalloc for buffers, expert scratch and the caller's tail: the
  // free-memory drop is the reported total, not three roundings of it.
  RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&d->base_, with_scratch),
                 absl::StrFormat("cudaMalloc(data plane workspace, %d bytes)", with_scratch)));
  RETURN_IF_ERROR(CudaStatus(cudaMemset(d->base_, 0, total), "cudaMemset(data plane buffers)"));
  ASSIGN_OR_RETURN(d->expert_compute_,
                   ExpertCompute::Create(e * n, ws.top_k, ws.hidden, options.max_intermediate,
                                         max_local, d->base_ + scratch_offset));
  if (options.tail_bytes > 0) d->tail_ = d->base_ + tail_offset;
  char* table_base = d->base_ + placement_offset;
  d->replica_offsets_ = reinterpret_cast<int32_t*>(table_base);
  d->replica_ranks_ = reinterpret_cast<int32_t*>(table_base + offsets_bytes);
  d->expert_tokens_ =
      reinterpret_cast<unsigned long long*>(table_base + offsets_bytes + ranks_bytes);
  RETURN_IF_ERROR(CudaStatus(cudaMemset(table_base, 0, d->placement_bytes_),
                             "cudaMemset(placement table and load counters)"));
  ASSIGN_OR_RETURN(core::PlacementTable contiguous,
                   core::PlacementTable::Contiguous(o.num_experts, ws.ep_size));
  RETURN_IF_ERROR(d->SetPlacement(contiguous));
  d->send_ = layout.dispatch_send.At<uint8_t>(d->base_);
  d->wire_recv_ = layout.dispatch_recv.At<uint8_t>(d->base_);
  d->recv_ = ws.dtype == core::DispatchDType::kFP8E4M3
                 ? layout.dispatch_dequant.At<uint8_t>(d->base_)
                 : d->wire_recv_;
  d->combine_send_ = layout.combine_send.At<uint16_t>(d->base_);
  d->combine_recv_ = layout.combine_recv.At<uint16_t>(d->base_);
  d->token_slot_ = layout.token_slot.At<int32_t>(d->base_);
  d->send_counts_ = layout.send_counts.At<int32_t>(d->base_);
  d->header_ = layout.header.At<int64_t>(d->base_);
  d->gathered_ = layout.gathered_headers.At<int64_t>(d->base_);
  d->error_ = layout.error.At<StepHeaderError>(d->base_);
  d->header_replicas_ = layout.header_replicas.At<int64_t>(d->base_);
  RETURN_IF_ERROR(d->expert_compute_->set_gemm(options.expert_gemm));
  return d;
}

GpuEpDispatcher::~GpuEpDispatcher() {
  for (auto& [bucket, exec] : graphs_) cudaGraphExecDestroy(exec);
  cudaFree(base_);
}

absl::Status GpuEpDispatcher::SetPlacement(const core::PlacementTable& table) {
  if (geometry_.in_step()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "SetPlacement on rank %d: a step is in flight; install a table between steps", rank_));
  }
  const uint64_t fingerprint = table.Fingerprint();
  if (fingerprint == placement_fingerprint_ && replica_offsets_ != nullptr &&
      placement_fingerprint_ != 0) {
    return absl::OkStatus();
  }
  RETURN_IF_ERROR(core::ValidatePlacement(table, options_.dispatcher));
  // Any set of logical experts (DESIGN §17): the expert compute finds a
  // received id's slot in the device expert set's slot ids.
  std::vector<int> mine = core::DistinctSlotExperts(table, rank_);
  std::vector<int32_t> offsets(table.num_experts() + 1, 0);
  std::vector<int32_t> ranks;
  ranks.reserve(table.num_slots());
  for (int e = 0; e < table.num_experts(); ++e) {
    // Live replicas only (all of them without a rank mask): a lost expert
    // gets none, which the route and pack kernels send nowhere (DESIGN §15).
    for (const core::ReplicaSlot& replica : table.LiveReplicas(e)) ranks.push_back(replica.rank);
    offsets[e + 1] = static_cast<int32_t>(ranks.size());
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  // A step boundary: no kernel of an earlier step still reads the table.
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(collective_->stream()),
                             "cudaStreamSynchronize(before the placement copy)"));
  RETURN_IF_ERROR(CudaStatus(cudaMemcpy(replica_offsets_, offsets.data(),
                                        offsets.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                             "cudaMemcpy(replica offsets)"));
  RETURN_IF_ERROR(CudaStatus(cudaMemcpy(replica_ranks_, ranks.data(),
                                        ranks.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                             "cudaMemcpy(replica ranks)"));
  local_experts_ = std::move(mine);
  placement_fingerprint_ = fingerprint;
  return absl::OkStatus();
}

absl::StatusOr<core::ExpertLoadCounts> GpuEpDispatcher::ReadExpertLoad(bool reset) {
  const int num_experts = options_.dispatcher.num_experts;
  std::vector<unsigned long long> raw(num_experts, 0);
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  RETURN_IF_ERROR(collective_->Synchronize());
  RETURN_IF_ERROR(CudaStatus(
      cudaMemcpy(raw.data(), expert_tokens_, raw.size() * sizeof(raw[0]), cudaMemcpyDeviceToHost),
      "cudaMemcpy(load counters)"));
  core::ExpertLoadCounts counts;
  counts.tokens_per_expert.assign(raw.begin(), raw.end());
  counts.steps = counted_steps_;
  if (reset) {
    RETURN_IF_ERROR(CudaStatus(
        cudaMemsetAsync(expert_tokens_, 0, raw.size() * sizeof(raw[0]), collective_->stream()),
        "cudaMemsetAsync(load counters)"));
    counted_steps_ = 0;
  }
  return counts;
}

absl::StatusOr<std::vector<int64_t>> GpuEpDispatcher::SyncTokenCounts(int64_t local_tokens) {
  RETURN_IF_ERROR(core::ValidateLocalTokens(local_tokens, rank_));
  return core::AllGatherInt64(control_, local_tokens);
}

absl::Status GpuEpDispatcher::CommitGeometry(int64_t epoch, int64_t r, int64_t local_tokens) {
  return geometry_.Commit(epoch, r, local_tokens);
}

absl::Status GpuEpDispatcher::CheckExperts(const DeviceExpertSet& experts) const {
  return core::ValidateExpertSlice(rank_, {hidden_, local_experts_},
                                   {experts.hidden(), experts.slot_ids()});
}

absl::Status GpuEpDispatcher::WriteHeader(int64_t epoch, int64_t r, int64_t num_tokens,
                                          HeaderRefusal sent) {
  // A one-thread kernel with the values as arguments: no host copy, no wait.
  return LaunchWriteStepHeader(header_, header_replicas_, ep_size_, epoch, r, num_tokens, sent,
                               collective_->stream());
}

absl::Status GpuEpDispatcher::EnqueueDispatch(int64_t r, const uint16_t* hidden,
                                              const int32_t* topk_ids, const float* topk_weights) {
  cudaStream_t s = collective_->stream();
  // Null inputs are allowed for T == 0: the kernels read no row then, so any
  // aligned device address stands in.
  const uint16_t* in_hidden = hidden ? hidden : reinterpret_cast<const uint16_t*>(send_);
  const int32_t* in_ids = topk_ids ? topk_ids : reinterpret_cast<const int32_t*>(send_);
  const float* in_weights = topk_weights ? topk_weights : reinterpret_cast<const float*>(send_);
  const int64_t* num_tokens = header_ + 2;
  const DevicePlacement placement{replica_offsets_, replica_ranks_, rank_};
  RouteParams route;
  route.topk_ids = in_ids;
  route.num_tokens = num_tokens;
  route.max_tokens = r;
  route.top_k = top_k_;
  route.num_experts = options_.dispatcher.num_experts;
  route.ep_size = ep_size_;
  route.token_slot = token_slot_;
  route.send_counts = send_counts_;
  route.placement = placement;
  route.expert_tokens = expert_tokens_;
  route.invalid_expert_id = options_.dispatcher.invalid_expert_id;
  route.id_error = &error_->ids;
  RETURN_IF_ERROR(LaunchRoute(route, s));
  PackDispatchParams pack;
  pack.hidden = in_hidden;
  pack.topk_ids = in_ids;
  pack.topk_weights = in_weights;
  pack.token_slot = token_slot_;
  pack.send_counts = send_counts_;
  pack.num_tokens = num_tokens;
  pack.max_tokens = r;
  pack.hidden_size = hidden_;
  pack.top_k = top_k_;
  pack.ep_size = ep_size_;
  pack.invalid_expert_id = options_.dispatcher.invalid_expert_id;
  pack.send = send_;
  pack.placement = placement;
  pack.num_experts = options_.dispatcher.num_experts;
  pack.dtype = dtype_;
  RETURN_IF_ERROR(LaunchPackDispatch(pack, s));
  std::fill(counts_.begin(), counts_.end(), r * row_bytes_);
  // The step header rides in the payload's NCCL group (one launch), then one
  // thread compares all ranks' (epoch, R) with ours (DESIGN §6). So does
  // send_counts[d] to rank d, which lands in row 1 of step_counts().
  const AllToAllVPart parts[3] = {
      {header_replicas_, header_counts_, gathered_, header_counts_},
      {send_counts_, count_bytes_, send_counts_ + ep_size_, count_bytes_},
      {send_, counts_, wire_recv_, counts_}};
  RETURN_IF_ERROR(collective_->GroupedAllToAllV(parts));
  RETURN_IF_ERROR(LaunchCheckStepHeaders(gathered_, ep_size_, rank_, header_, error_, s));
  // fp8: the dequantizing pass the expert compute reads through.
  if (recv_ == wire_recv_) return absl::OkStatus();
  return LaunchDequantizeDispatchRows(wire_recv_, ep_size_ * r, hidden_, top_k_, recv_, s);
}

absl::Status GpuEpDispatcher::EnqueueCombine(int64_t r, uint16_t* output,
                                             const uint16_t* shared_out,
                                             const uint16_t* expert_out) {
  std::fill(counts_.begin(), counts_.end(), r * hidden_ * 2);
  // The step header rides in the combine's NCCL group too (the dispatch's
  // replicas, unless RefuseCombine rewrote their T): the reduction reads
  // it, so a peer's refused combine ends this rank's step without output
  // instead of waiting (issue 30 item 1). 24 bytes a peer, no launch.
  const AllToAllVPart parts[2] = {
      {header_replicas_, header_counts_, gathered_, header_counts_},
      {expert_out != nullptr ? expert_out : combine_send_, counts_, combine_recv_, counts_}};
  RETURN_IF_ERROR(collective_->GroupedAllToAllV(parts));
  CombineReduceParams combine;
  combine.headers = gathered_;
  combine.rank = rank_;
  combine.error = error_;
  combine.recv = combine_recv_;
  combine.token_slot = token_slot_;
  combine.num_tokens = header_ + 2;
  combine.max_tokens = r;
  combine.hidden_size = hidden_;
  combine.ep_size = ep_size_;
  combine.output = output ? output : combine_send_;
  combine.shared = shared_out;
  return LaunchCombineReduce(combine, collective_->stream());
}

absl::Status GpuEpDispatcher::CheckForwardArgs(const char* call, int64_t num_tokens,
                                               const void* hidden, const void* topk_ids,
                                               const void* topk_weights) const {
  RETURN_IF_ERROR(geometry_.CheckStep(call, num_tokens));
  return core::ValidateStepPointers(call, rank_, num_tokens, hidden, topk_ids, topk_weights);
}

absl::Status GpuEpDispatcher::AgreeAndWriteHeader(int64_t num_tokens, bool refused) {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  // (epoch, R) agreement before any payload moves (DESIGN §6).
  const int64_t epoch = geometry_.epoch();
  const int64_t runtime_max = geometry_.runtime_max_tokens_per_rank();
  const int64_t mine[2] = {epoch, runtime_max};
  std::vector<int64_t> all(2 * ep_size_);
  RETURN_IF_ERROR(control_.AllGather(mine, sizeof(mine), all.data()));
  for (int r = 0; r < ep_size_; ++r) {
    if (!control_.IsLive(r)) continue;  // masked (DESIGN §15): its row is zero
    if (all[2 * r] != epoch || all[2 * r + 1] != runtime_max) {
      return absl::AbortedError(absl::StrFormat(
          "geometry mismatch: rank %d has (epoch %d, R %d), this rank (rank %d) has (epoch %d, R "
          "%d); commit the same geometry on every rank",
          r, all[2 * r], all[2 * r + 1], rank_, epoch, runtime_max));
    }
  }
  return WriteHeader(epoch, runtime_max, num_tokens,
                     refused ? HeaderRefusal::kStep : HeaderRefusal::kNone);
}

absl::Status GpuEpDispatcher::BeginStep(int64_t num_tokens, bool refused) {
  if (options_.geometry_check == GeometryCheck::kHostAllGather) {
    return AgreeAndWriteHeader(num_tokens, refused);
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  return WriteHeader(geometry_.epoch(), geometry_.runtime_max_tokens_per_rank(), num_tokens,
                     refused ? HeaderRefusal::kStep : HeaderRefusal::kNone);
}

absl::Status GpuEpDispatcher::Forward(const uint16_t* hidden, const int32_t* topk_ids,
                                      const float* topk_weights, int64_t num_tokens,
                                      const DeviceExpertSet& experts, uint16_t* output) {
  RETURN_IF_ERROR(geometry_.BeginDispatch("Forward"));
  RETURN_IF_ERROR(CheckForwardArgs("Forward", num_tokens, hidden, topk_ids, topk_weights));
  RETURN_IF_ERROR(core::ValidateStepOutput("Forward", rank_, num_tokens, output));
  RETURN_IF_ERROR(CheckExperts(experts));
  RETURN_IF_ERROR(BeginStep(num_tokens));
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  RETURN_IF_ERROR(EnqueueDispatch(r, hidden, topk_ids, topk_weights));
  ++counted_steps_;
  RETURN_IF_ERROR(expert_compute_->Run(recv_, ep_size_ * r, experts, combine_send_, stream()));
  return EnqueueCombine(r, output);
}

absl::Status GpuEpDispatcher::Dispatch(const uint16_t* hidden, const int32_t* topk_ids,
                                       const float* topk_weights, int64_t num_tokens) {
  RETURN_IF_ERROR(geometry_.BeginDispatch("Dispatch"));
  RETURN_IF_ERROR(CheckForwardArgs("Dispatch", num_tokens, hidden, topk_ids, topk_weights));
  RETURN_IF_ERROR(BeginStep(num_tokens));
  RETURN_IF_ERROR(
      EnqueueDispatch(geometry_.runtime_max_tokens_per_rank(), hidden, topk_ids, topk_weights));
  ++counted_steps_;
  geometry_.MarkDispatched();
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::RefuseStep() {
  RETURN_IF_ERROR(geometry_.BeginDispatch("Dispatch"));
  if (!geometry_.committed()) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "RefuseStep on rank %d: no geometry committed, so the step's transfer sizes are unknown; "
        "call CommitGeometry",
        rank_));
  }
  // The peers' step in full (the same transfer sizes, or NCCL's channels
  // would be misaligned): a header whose T the peers read as "refused", a
  // dispatch of no token (padding rows, zero counts) and the combine after
  // it, which writes no row (T = 0 here, and on the peers after the header
  // check).
  RETURN_IF_ERROR(BeginStep(0, /*refused=*/true));
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  // The step never becomes dispatched here (BeginDispatch found it idle).
  RETURN_IF_ERROR(EnqueueDispatch(r, nullptr, nullptr, nullptr));
  return EnqueueCombine(r, nullptr);
}

absl::Status GpuEpDispatcher::RefuseCombine() {
  RETURN_IF_ERROR(geometry_.RequireDispatched("Combine"));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  // The step's combine transfers as the peers make them, its header's T
  // kRefusedCombineTokens: every rank's reduction (this one's too) then
  // writes no row. T = 0 here: nothing after the combine reads it.
  RETURN_IF_ERROR(WriteHeader(geometry_.epoch(), r, 0, HeaderRefusal::kCombine));
  geometry_.MarkIdle();
  return EnqueueCombine(r, nullptr);
}

absl::Status GpuEpDispatcher::ComputeExperts(const DeviceExpertSet& experts) {
  RETURN_IF_ERROR(geometry_.RequireDispatched("ComputeExperts"));
  RETURN_IF_ERROR(CheckExperts(experts));
  RETURN_IF_ERROR(expert_compute_->Run(recv_, ep_size_ * geometry_.runtime_max_tokens_per_rank(),
                                       experts, combine_send_, stream()));
  geometry_.MarkComputed();
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::Combine(uint16_t* output, const uint16_t* shared_out,
                                      const uint16_t* expert_out) {
  // The GPU plane combines even when its expert compute failed, to keep the
  // ranks' NCCL sequence aligned (server/gpu_data_plane.cc), so only a
  // dispatched step is required here.
  RETURN_IF_ERROR(geometry_.RequireDispatched("Combine"));
  geometry_.MarkIdle();
  return EnqueueCombine(geometry_.runtime_max_tokens_per_rank(), output, shared_out, expert_out);
}

absl::Status GpuEpDispatcher::CaptureForward(int64_t bucket, const uint16_t* hidden,
                                             const int32_t* topk_ids, const float* topk_weights,
                                             const DeviceExpertSet& experts, uint16_t* output) {
  RETURN_IF_ERROR(
      core::ValidateCaptureArgs(rank_, bucket, capacity_, hidden, topk_ids, topk_weights, output));
  RETURN_IF_ERROR(CheckExperts(experts));
  RETURN_IF_ERROR(CheckCapturable(rank_, experts.kind(), options_.expert_gemm));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  ASSIGN_OR_RETURN(std::vector<int64_t> buckets, core::AllGatherInt64(control_, bucket));
  for (int r = 0; r < ep_size_; ++r) {
    if (!control_.IsLive(r)) continue;  // masked (DESIGN §15): its row is zero
    if (buckets[r] != bucket) {
      return absl::AbortedError(
          absl::StrFormat("CaptureForward: rank %d captures bucket %d, rank %d bucket %d", r,
                          buckets[r], rank_, bucket));
    }
  }
  cudaStream_t s = collective_->stream();
  RETURN_IF_ERROR(CudaStatus(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal),
                             "cudaStreamBeginCapture"));
  absl::Status captured = EnqueueDispatch(bucket, hidden, topk_ids, topk_weights);
  if (captured.ok()) {
    captured = expert_compute_->Run(recv_, ep_size_ * bucket, experts, combine_send_, s);
  }
  if (captured.ok()) captured = EnqueueCombine(bucket, output);
  cudaGraph_t graph = nullptr;
  const cudaError_t end = cudaStreamEndCapture(s, &graph);
  RETURN_IF_ERROR(captured);
  RETURN_IF_ERROR(CudaStatus(end, "cudaStreamEndCapture"));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  RETURN_IF_ERROR(CudaStatus(inst, "cudaGraphInstantiate"));
  auto it = graphs_.find(bucket);
  if (it != graphs_.end()) {
    cudaGraphExecDestroy(it->second);
    it->second = exec;
  } else {
    graphs_.emplace(bucket, exec);
  }
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::ReplayForward(int64_t bucket, int64_t epoch, int64_t num_tokens) {
  auto it = graphs_.find(bucket);
  if (it == graphs_.end()) {
    return absl::NotFoundError(absl::StrFormat(
        "ReplayForward on rank %d: no graph captured for bucket %d", rank_, bucket));
  }
  RETURN_IF_ERROR(core::ValidateReplayTokens(rank_, bucket, num_tokens));
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  RETURN_IF_ERROR(WriteHeader(epoch, bucket, num_tokens));
  RETURN_IF_ERROR(
      CudaStatus(cudaGraphLaunch(it->second, collective_->stream()), "cudaGraphLaunch"));
  ++counted_steps_;
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::CheckReplay() { return CheckStep(); }

absl::Status GpuEpDispatcher::CheckStep() {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  RETURN_IF_ERROR(collective_->Synchronize());
  StepHeaderError error;
  RETURN_IF_ERROR(CudaStatus(cudaMemcpy(&error, error_, sizeof(error), cudaMemcpyDeviceToHost),
                             "cudaMemcpy(step error record)"));
  if (error.rank_plus_1 == 0 && error.ids.count == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(cudaMemset(error_, 0, sizeof(error)), "cudaMemset(error record)"));
  if (error.rank_plus_1 == 0) {
    // Only this rank's input was wrong: the payload moved with those choices
    // masked, so the communicator is intact and the next step may run.
    return ExpertIdErrorStatus(error.ids, top_k_, options_.dispatcher.num_experts,
                               options_.dispatcher.invalid_expert_id, rank_);
  }
  if (error.refused != 0) {
    // The refusing rank ran the same transfers (RefuseStep, RefuseCombine):
    // the communicator is intact (issue 30 item 1).
    const bool combine = error.combine != 0;
    return PeerRefusalError(error.rank_plus_1 - 1, error.their_epoch,
                            combine ? RefusedPhase::kCombine : RefusedPhase::kDispatch,
                            combine ? "the step wrote no output here (its expert outputs lack "
                                      "that rank's)"
                                    : "the step wrote no output here (its received rows lack "
                                      "that rank's)");
  }
  std::string what = absl::StrFormat(
      "geometry mismatch: rank %d has (epoch %d, R %d), rank %d has (epoch %d, R %d); the step "
      "wrote no output",
      error.rank_plus_1 - 1, error.their_epoch, error.their_r, rank_, error.my_epoch, error.my_r);
  if (error.r_differs) {
    // The payload transfers were sized by different R on the two ranks, so
    // the communicator's channels can no longer be trusted.
    collective_->Abort();
    what += "; R differed, so the NCCL transfers were mismatched and the communicator was aborted";
  }
  return absl::AbortedError(what);
}

absl::StatusOr<ReceivedRowsForTest> GpuEpDispatcher::CopyReceivedForTest() {
  RETURN_IF_ERROR(collective_->Synchronize());
  const int64_t r = geometry_.runtime_max_tokens_per_rank();
  const int64_t row_bytes = DispatchRowBytes(hidden_, top_k_);  // recv_ holds bf16 rows
  std::vector<uint8_t> raw(ep_size_ * r * row_bytes);
  if (!raw.empty()) {
    RETURN_IF_ERROR(CudaStatus(cudaMemcpy(raw.data(), recv_, raw.size(), cudaMemcpyDeviceToHost),
                               "cudaMemcpy(recv)"));
  }
  return UnpackReceivedRows(raw.data(), ep_size_ * r, hidden_, top_k_, r);
}

ReceivedRowsForTest UnpackReceivedRows(const uint8_t* raw, int64_t rows, int64_t hidden, int top_k,
                                       int64_t runtime_max_tokens_per_rank) {
  const int64_t row_bytes = DispatchRowBytes(hidden, top_k);
  ReceivedRowsForTest out;
  out.runtime_max_tokens_per_rank = runtime_max_tokens_per_rank;
  out.hidden.resize(rows * hidden);
  out.ids.resize(rows * top_k);
  out.weights.resize(rows * top_k);
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = raw + i * row_bytes;
    std::memcpy(out.hidden.data() + i * hidden, row, hidden * 2);
    std::memcpy(out.ids.data() + i * top_k, row + 2 * hidden, top_k * 4);
    std::memcpy(out.weights.data() + i * top_k, row + 2 * hidden + 4 * top_k, top_k * 4);
  }
  return out;
}

}  // namespace moe_ep::kernels
