#include "server/gpu_step_buffers.h"

#ifdef MOE_EP_HAVE_CUDA

#include <vector>

#include "core/workspace.h"
#include "kernels/cuda_status.h"

namespace moe_ep::server {
int64_t DeviceStepBuffers::Bytes(int64_t capacity, int64_t hidden, int top_k) {
  return 2 * core::AlignTo128(capacity * hidden * 2) + 2 * core::AlignTo128(capacity * top_k * 4);
}

absl::StatusOr<std::unique_ptr<DeviceStepBuffers>> DeviceStepBuffers::Create(int64_t capacity,
                                                                             int64_t hidden,
                                                                             int top_k) {
  std::unique_ptr<DeviceStepBuffers> b(new DeviceStepBuffers());
  b->bytes_ = Bytes(capacity, hidden, top_k);
  b->hidden_size_ = hidden;
  b->top_k_ = top_k;
  RETURN_IF_ERROR(
      kernels::CudaStatus(cudaMalloc(&b->base_, b->bytes_),
                          absl::StrCat("cudaMalloc(step buffers, ", b->bytes_, " bytes)")));
  const int64_t hidden_bytes = core::AlignTo128(capacity * hidden * 2);
  const int64_t k_bytes = core::AlignTo128(capacity * top_k * 4);
  b->hidden_ = reinterpret_cast<uint16_t*>(b->base_);
  b->ids_ = reinterpret_cast<int32_t*>(b->base_ + hidden_bytes);
  b->weights_ = reinterpret_cast<float*>(b->base_ + hidden_bytes + k_bytes);
  b->output_ = reinterpret_cast<uint16_t*>(b->base_ + hidden_bytes + 2 * k_bytes);
  return b;
}

DeviceStepBuffers::~DeviceStepBuffers() { cudaFree(base_); }

absl::Status DeviceStepBuffers::Upload(const uint16_t* hidden, const int32_t* topk_ids,
                                       const float* topk_weights, int64_t num_tokens,
                                       cudaStream_t stream) const {
  if (num_tokens <= 0) return absl::OkStatus();
  RETURN_IF_ERROR(
      kernels::CudaStatus(cudaMemcpyAsync(hidden_, hidden, num_tokens * hidden_size_ * 2,
                                          cudaMemcpyHostToDevice, stream),
                          "cudaMemcpyAsync(hidden to device)"));
  RETURN_IF_ERROR(kernels::CudaStatus(
      cudaMemcpyAsync(ids_, topk_ids, num_tokens * top_k_ * 4, cudaMemcpyHostToDevice, stream),
      "cudaMemcpyAsync(topk_ids to device)"));
  return kernels::CudaStatus(cudaMemcpyAsync(weights_, topk_weights, num_tokens * top_k_ * 4,
                                             cudaMemcpyHostToDevice, stream),
                             "cudaMemcpyAsync(topk_weights to device)");
}

absl::StatusOr<core::StepStats> StepCountStats(const int32_t* counts, int members, int self,
                                               const core::WorkspaceSpec& ws, int64_t runtime_max) {
  ASSIGN_OR_RETURN(const int64_t dispatch_bytes,
                   core::DispatchBytesPerToken(ws.dtype, ws.hidden, ws.top_k));
  const int64_t combine_bytes = core::CombineBytesPerToken(ws.hidden);
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = runtime_max;
  for (int p = 0; p < members; ++p) {
    const int64_t sent = counts[p];
    const int64_t received = counts[members + p];
    stats.tokens_sent += sent;
    stats.tokens_received += received;
    if (p == self) continue;
    stats.bytes_sent_remote += sent * dispatch_bytes + received * combine_bytes;
  }
  return stats;
}

absl::StatusOr<int64_t> DeviceTokensSent(const int32_t* send_counts, int members,
                                         cudaStream_t stream) {
  std::vector<int32_t> counts(members);
  RETURN_IF_ERROR(
      kernels::CudaStatus(cudaMemcpyAsync(counts.data(), send_counts, members * sizeof(int32_t),
                                          cudaMemcpyDeviceToHost, stream),
                          "cudaMemcpyAsync(send counts to host)"));
  RETURN_IF_ERROR(kernels::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  int64_t sent = 0;
  for (const int32_t c : counts) sent += c;
  return sent;
}

absl::Status AddStepTimes(const cudaEvent_t events[4], const GpuSharedExperts* shared,
                          core::StepStats* stats) {
  float ms[3] = {0, 0, 0};
  for (int i = 0; i < 3; ++i) {
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventElapsedTime(&ms[i], events[i], events[i + 1]),
                                        "cudaEventElapsedTime"));
  }
  stats->dispatch_us = static_cast<int64_t>(ms[0] * 1000.0f);
  stats->expert_us = static_cast<int64_t>(ms[1] * 1000.0f);
  stats->combine_us = static_cast<int64_t>(ms[2] * 1000.0f);
  if (shared != nullptr) {
    ASSIGN_OR_RETURN(auto shared_times, shared->Times(events[0], events[1]));
    stats->shared_us = shared_times.first;
    stats->shared_overlap_us = shared_times.second;
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
