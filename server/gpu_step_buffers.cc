#include "server/gpu_step_buffers.h"

#ifdef MOE_EP_HAVE_CUDA

#include "core/workspace.h"

namespace moe_ep::server {
namespace {

absl::Status Cuda(cudaError_t error, absl::string_view what) {
  if (error == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string message = absl::StrCat(what, ": ", cudaGetErrorString(error));
  if (error == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(message);
  return absl::InternalError(message);
}

}  // namespace

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
  RETURN_IF_ERROR(Cuda(cudaMalloc(&b->base_, b->bytes_),
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
  RETURN_IF_ERROR(Cuda(cudaMemcpyAsync(hidden_, hidden, num_tokens * hidden_size_ * 2,
                                       cudaMemcpyHostToDevice, stream),
                       "cudaMemcpyAsync(hidden to device)"));
  RETURN_IF_ERROR(
      Cuda(cudaMemcpyAsync(ids_, topk_ids, num_tokens * top_k_ * 4, cudaMemcpyHostToDevice, stream),
           "cudaMemcpyAsync(topk_ids to device)"));
  return Cuda(cudaMemcpyAsync(weights_, topk_weights, num_tokens * top_k_ * 4,
                              cudaMemcpyHostToDevice, stream),
              "cudaMemcpyAsync(topk_weights to device)");
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
