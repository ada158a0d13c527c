#include "kernels/gpu_ep_dispatcher.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <string>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "kernels/combine_reduce.cuh"
#include "kernels/dispatch_pack.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/route.cuh"
#include "kernels/step_header.cuh"

namespace moe_ep::kernels {

using internal::CudaStatus;

absl::StatusOr<std::unique_ptr<GpuEpDispatcher>> GpuEpDispatcher::Create(
    NcclCollective* collective, const GpuEpDispatcherOptions& options, int64_t memory_cap_bytes) {
  if (collective == nullptr) return absl::InvalidArgumentError("collective: null");
  const core::EpDispatcherOptions& o = options.dispatcher;
  const core::WorkspaceSpec& ws = o.workspace;
  if (ws.ep_size != collective->size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workspace.ep_size: expected the collective's size %d, got %d",
                        collective->size(), ws.ep_size));
  }
  if (ws.ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workspace.ep_size: expected <= %d, got %d", kMaxEpSize, ws.ep_size));
  }
  if (ws.dtype != core::DispatchDType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workspace.dtype: the GPU data plane moves bf16, got %s",
                        core::DispatchDTypeName(ws.dtype)));
  }
  if (ws.capacity_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workspace.capacity_tokens: expected >= 1, got %d", ws.capacity_tokens));
  }
  if (ws.hidden < 4 || ws.hidden % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workspace.hidden: expected a positive multiple of 4, got %d", ws.hidden));
  }
  if (ws.top_k < 1 || ws.top_k > kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrFormat("workspace.top_k: expected in [1, %d], got %d", kMaxTopK, ws.top_k));
  }
  if (o.invalid_expert_id != -1 && o.invalid_expert_id != o.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("invalid_expert_id: expected -1 or num_experts (%d), got %d", o.num_experts,
                        o.invalid_expert_id));
  }
  int64_t prev = 0;
  for (int64_t b : o.cuda_graph_buckets) {
    if (b <= prev || b > ws.capacity_tokens) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "cuda_graph_buckets: expected ascending values in [1, %d], got %d after %d",
          ws.capacity_tokens, b, prev));
    }
    prev = b;
  }
  if (options.max_intermediate < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("max_intermediate: expected >= 0, got %d", options.max_intermediate));
  }
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(o.num_experts, ws.ep_size));

  std::unique_ptr<GpuEpDispatcher> d(new GpuEpDispatcher());
  d->collective_ = collective;
  d->options_ = options;
  d->ep_size_ = ws.ep_size;
  d->rank_ = collective->rank();
  d->capacity_ = ws.capacity_tokens;
  d->hidden_ = ws.hidden;
  d->top_k_ = ws.top_k;
  d->row_bytes_ = DispatchRowBytes(ws.hidden, ws.top_k);
  d->first_expert_ = placement.FirstExpert(d->rank_);
  d->num_local_experts_ = placement.NumLocalExperts(d->rank_);
  d->counts_.assign(ws.ep_size, 0);
  d->header_counts_.assign(ws.ep_size, 3 * static_cast<int64_t>(sizeof(int64_t)));

  // Region sizes (bytes), each 128-byte aligned.
  const int64_t e = ws.ep_size;
  const int64_t n = ws.capacity_tokens;
  static_assert(sizeof(StepHeaderError) <= 128, "error record fits its region");
  const std::array<int64_t, 10> sizes = {core::AlignTo128(e * n * d->row_bytes_),
                                         core::AlignTo128(e * n * d->row_bytes_),
                                         core::AlignTo128(e * n * ws.hidden * 2),
                                         core::AlignTo128(e * n * ws.hidden * 2),
                                         core::AlignTo128(n * e * 4),
                                         core::AlignTo128(e * 4),
                                         core::AlignTo128(3 * 8),
                                         core::AlignTo128(e * 3 * 8),
                                         core::AlignTo128(sizeof(StepHeaderError)),
                                         core::AlignTo128(e * 3 * 8)};
  int64_t total = 0;
  for (int64_t s : sizes) total += s;

  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective->device()), "cudaSetDevice"));
  ASSIGN_OR_RETURN(d->expert_compute_,
                   ExpertCompute::Create(e * n, ws.top_k, ws.hidden, options.max_intermediate,
                                         d->num_local_experts_));
  const int64_t with_scratch = total + d->expert_compute_->allocated_bytes();
  if (memory_cap_bytes > 0 && with_scratch > memory_cap_bytes) {
    return absl::ResourceExhaustedError(absl::StrFormat(
        "GPU data plane of rank %d needs %d bytes (buffers %d + expert scratch %d), cap is %d",
        d->rank_, with_scratch, total, d->expert_compute_->allocated_bytes(), memory_cap_bytes));
  }
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&d->base_, total), "cudaMalloc(data plane buffers)"));
  RETURN_IF_ERROR(CudaStatus(cudaMemset(d->base_, 0, total), "cudaMemset(data plane buffers)"));
  d->allocated_bytes_ = with_scratch;
  char* p = d->base_;
  auto take = [&p](int64_t bytes) {
    char* at = p;
    p += bytes;
    return at;
  };
  d->send_ = reinterpret_cast<uint8_t*>(take(sizes[0]));
  d->recv_ = reinterpret_cast<uint8_t*>(take(sizes[1]));
  d->combine_send_ = reinterpret_cast<uint16_t*>(take(sizes[2]));
  d->combine_recv_ = reinterpret_cast<uint16_t*>(take(sizes[3]));
  d->token_slot_ = reinterpret_cast<int32_t*>(take(sizes[4]));
  d->send_counts_ = reinterpret_cast<int32_t*>(take(sizes[5]));
  d->header_ = reinterpret_cast<int64_t*>(take(sizes[6]));
  d->gathered_ = reinterpret_cast<int64_t*>(take(sizes[7]));
  d->error_ = reinterpret_cast<StepHeaderError*>(take(sizes[8]));
  d->header_replicas_ = reinterpret_cast<int64_t*>(take(sizes[9]));
  d->expert_compute_->set_gemm(options.expert_gemm);
  return d;
}

GpuEpDispatcher::~GpuEpDispatcher() {
  for (auto& [bucket, exec] : graphs_) cudaGraphExecDestroy(exec);
  cudaFree(base_);
}

absl::StatusOr<std::vector<int64_t>> GpuEpDispatcher::SyncTokenCounts(int64_t local_tokens) {
  if (local_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("local_tokens: expected >= 0 on rank %d, got %d", rank_, local_tokens));
  }
  return core::AllGatherInt64(*collective_, local_tokens);
}

absl::Status GpuEpDispatcher::CommitGeometry(int64_t epoch, int64_t r, int64_t local_tokens) {
  if (r > capacity_) {
    return absl::ResourceExhaustedError(
        absl::StrFormat("runtime_max_tokens_per_rank %d exceeds capacity_tokens %d on rank %d", r,
                        capacity_, rank_));
  }
  if (r < 0 || r < local_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "runtime_max_tokens_per_rank %d must be >= 0 and >= local_tokens %d on rank %d", r,
        local_tokens, rank_));
  }
  epoch_ = epoch;
  runtime_max_tokens_ = r;
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::CheckExperts(const DeviceExpertSet& experts) const {
  if (experts.hidden() != hidden_ || experts.first_expert() != first_expert_ ||
      experts.num_experts() != num_local_experts_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "experts on rank %d: expected hidden %d and experts [%d, %d), got hidden %d and [%d, %d)",
        rank_, hidden_, first_expert_, first_expert_ + num_local_experts_, experts.hidden(),
        experts.first_expert(), experts.first_expert() + experts.num_experts()));
  }
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::WriteHeader(int64_t epoch, int64_t r, int64_t num_tokens) {
  // A one-thread kernel with the values as arguments: no host copy, no wait.
  return LaunchWriteStepHeader(header_, header_replicas_, ep_size_, epoch, r, num_tokens,
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
  RETURN_IF_ERROR(LaunchRoute({in_ids, num_tokens, r, top_k_, options_.dispatcher.num_experts,
                               ep_size_, token_slot_, send_counts_},
                              s));
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
  RETURN_IF_ERROR(LaunchPackDispatch(pack, s));
  std::fill(counts_.begin(), counts_.end(), r * row_bytes_);
  // The step header rides in the payload's NCCL group (one launch), then one
  // thread compares all ranks' (epoch, R) with ours (DESIGN §6).
  const AllToAllVPart parts[2] = {{header_replicas_, header_counts_, gathered_, header_counts_},
                                  {send_, counts_, recv_, counts_}};
  RETURN_IF_ERROR(collective_->GroupedAllToAllV(parts));
  return LaunchCheckStepHeaders(gathered_, ep_size_, header_, error_, s);
}

absl::Status GpuEpDispatcher::EnqueueCombine(int64_t r, uint16_t* output,
                                             const uint16_t* shared_out) {
  std::fill(counts_.begin(), counts_.end(), r * hidden_ * 2);
  RETURN_IF_ERROR(collective_->AllToAllV(combine_send_, counts_, combine_recv_, counts_));
  CombineReduceParams combine;
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

absl::Status GpuEpDispatcher::CheckForwardArgs(int64_t num_tokens, const void* hidden,
                                               const void* topk_ids,
                                               const void* topk_weights) const {
  if (runtime_max_tokens_ < 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("Forward on rank %d: no geometry committed", rank_));
  }
  if (num_tokens < 0 || num_tokens > runtime_max_tokens_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Forward on rank %d: num_tokens expected in [0, R=%d], got %d", rank_,
                        runtime_max_tokens_, num_tokens));
  }
  if (num_tokens > 0 && (hidden == nullptr || topk_ids == nullptr || topk_weights == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "Forward on rank %d: null device pointer with %d tokens", rank_, num_tokens));
  }
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::AgreeAndWriteHeader(int64_t num_tokens) {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  // (epoch, R) agreement before any payload moves (DESIGN §6).
  const int64_t mine[2] = {epoch_, runtime_max_tokens_};
  std::vector<int64_t> all(2 * ep_size_);
  RETURN_IF_ERROR(collective_->AllGather(mine, sizeof(mine), all.data()));
  for (int r = 0; r < ep_size_; ++r) {
    if (all[2 * r] != epoch_ || all[2 * r + 1] != runtime_max_tokens_) {
      return absl::AbortedError(absl::StrFormat(
          "geometry mismatch: rank %d has (epoch %d, R %d), rank %d has (epoch %d, R %d)", r,
          all[2 * r], all[2 * r + 1], rank_, epoch_, runtime_max_tokens_));
    }
  }
  return WriteHeader(epoch_, runtime_max_tokens_, num_tokens);
}

absl::Status GpuEpDispatcher::BeginStep(int64_t num_tokens) {
  if (options_.geometry_check == GeometryCheck::kHostAllGather) {
    return AgreeAndWriteHeader(num_tokens);
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  return WriteHeader(epoch_, runtime_max_tokens_, num_tokens);
}

absl::Status GpuEpDispatcher::Forward(const uint16_t* hidden, const int32_t* topk_ids,
                                      const float* topk_weights, int64_t num_tokens,
                                      const DeviceExpertSet& experts, uint16_t* output) {
  if (dispatched_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("Forward on rank %d: a dispatch is pending its combine", rank_));
  }
  RETURN_IF_ERROR(CheckForwardArgs(num_tokens, hidden, topk_ids, topk_weights));
  if (num_tokens > 0 && output == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("Forward on rank %d: null output with %d tokens", rank_, num_tokens));
  }
  RETURN_IF_ERROR(CheckExperts(experts));
  RETURN_IF_ERROR(BeginStep(num_tokens));
  const int64_t r = runtime_max_tokens_;
  RETURN_IF_ERROR(EnqueueDispatch(r, hidden, topk_ids, topk_weights));
  RETURN_IF_ERROR(expert_compute_->Run(recv_, ep_size_ * r, experts, combine_send_, stream()));
  return EnqueueCombine(r, output);
}

absl::Status GpuEpDispatcher::Dispatch(const uint16_t* hidden, const int32_t* topk_ids,
                                       const float* topk_weights, int64_t num_tokens) {
  if (dispatched_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("Dispatch on rank %d: the previous dispatch has not been combined", rank_));
  }
  RETURN_IF_ERROR(CheckForwardArgs(num_tokens, hidden, topk_ids, topk_weights));
  RETURN_IF_ERROR(BeginStep(num_tokens));
  RETURN_IF_ERROR(EnqueueDispatch(runtime_max_tokens_, hidden, topk_ids, topk_weights));
  dispatched_ = true;
  return absl::OkStatus();
}

absl::Status GpuEpDispatcher::ComputeExperts(const DeviceExpertSet& experts) {
  if (!dispatched_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("ComputeExperts on rank %d: no dispatch pending", rank_));
  }
  RETURN_IF_ERROR(CheckExperts(experts));
  return expert_compute_->Run(recv_, ep_size_ * runtime_max_tokens_, experts, combine_send_,
                              stream());
}

absl::Status GpuEpDispatcher::Combine(uint16_t* output, const uint16_t* shared_out) {
  if (!dispatched_) {
    return absl::FailedPreconditionError(
        absl::StrFormat("Combine on rank %d: no dispatch pending", rank_));
  }
  dispatched_ = false;
  return EnqueueCombine(runtime_max_tokens_, output, shared_out);
}

absl::Status GpuEpDispatcher::CaptureForward(int64_t bucket, const uint16_t* hidden,
                                             const int32_t* topk_ids, const float* topk_weights,
                                             const DeviceExpertSet& experts, uint16_t* output) {
  if (bucket < 1 || bucket > capacity_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "CaptureForward on rank %d: bucket expected in [1, %d], got %d", rank_, capacity_, bucket));
  }
  if (hidden == nullptr || topk_ids == nullptr || topk_weights == nullptr || output == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrFormat("CaptureForward on rank %d: null device pointer", rank_));
  }
  RETURN_IF_ERROR(CheckExperts(experts));
  if (experts.kind() == core::ExpertKind::kSwiGlu &&
      options_.expert_gemm == ExpertGemm::kCublasHostCounts) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "CaptureForward on rank %d: SwiGLU expert compute with kCublasHostCounts reads "
        "per-expert row counts on the host and cannot be captured; use kGroupedDevice",
        rank_));
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  ASSIGN_OR_RETURN(std::vector<int64_t> buckets, core::AllGatherInt64(*collective_, bucket));
  for (int r = 0; r < ep_size_; ++r) {
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
  if (num_tokens < 0 || num_tokens > bucket) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ReplayForward on rank %d: num_tokens expected in [0, bucket=%d], got %d",
                        rank_, bucket, num_tokens));
  }
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  RETURN_IF_ERROR(WriteHeader(epoch, bucket, num_tokens));
  return CudaStatus(cudaGraphLaunch(it->second, collective_->stream()), "cudaGraphLaunch");
}

absl::Status GpuEpDispatcher::CheckReplay() { return CheckStep(); }

absl::Status GpuEpDispatcher::CheckStep() {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(collective_->device()), "cudaSetDevice"));
  RETURN_IF_ERROR(collective_->Synchronize());
  StepHeaderError error;
  RETURN_IF_ERROR(CudaStatus(cudaMemcpy(&error, error_, sizeof(error), cudaMemcpyDeviceToHost),
                             "cudaMemcpy(step error record)"));
  if (error.rank_plus_1 == 0) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(cudaMemset(error_, 0, sizeof(error)), "cudaMemset(error record)"));
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
  const int64_t r = runtime_max_tokens_ < 0 ? 0 : runtime_max_tokens_;
  std::vector<uint8_t> raw(ep_size_ * r * row_bytes_);
  if (!raw.empty()) {
    RETURN_IF_ERROR(CudaStatus(cudaMemcpy(raw.data(), recv_, raw.size(), cudaMemcpyDeviceToHost),
                               "cudaMemcpy(recv)"));
  }
  ReceivedRowsForTest out;
  out.runtime_max_tokens_per_rank = r;
  const int64_t rows = ep_size_ * r;
  out.hidden.resize(rows * hidden_);
  out.ids.resize(rows * top_k_);
  out.weights.resize(rows * top_k_);
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = raw.data() + i * row_bytes_;
    std::memcpy(out.hidden.data() + i * hidden_, row, hidden_ * 2);
    std::memcpy(out.ids.data() + i * top_k_, row + 2 * hidden_, top_k_ * 4);
    std::memcpy(out.weights.data() + i * top_k_, row + 2 * hidden_ + 4 * top_k_, top_k_ * 4);
  }
  return out;
}

}  // namespace moe_ep::kernels
