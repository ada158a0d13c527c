#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/engine_rows.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"

namespace moe_ep::kernels {
namespace {

constexpr int kUnpackThreads = 128;

// Block b: output slot b of [E * rows] (UnpackSlot).
__global__ void UnpackReceivedKernel(UnpackReceivedParams p) {
  __shared__ int local;
  if (threadIdx.x == 0) local = 0;
  __syncthreads();
  if (UnpackSlot(p, blockIdx.x, threadIdx.x, blockDim.x)) local = 1;  // every writer stores 1
  __syncthreads();
  if (threadIdx.x == 0 && local) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p.source_counts + blockIdx.x / p.rows), 1ull);
  }
}

}  // namespace

absl::Status CheckUnpackReceived(const UnpackReceivedParams& p) {
  if (p.ep_size < 1 || p.top_k < 1 || p.num_local_experts < 0 || p.runtime_max < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchUnpackReceived: expected E >= 1, K >= 1, L >= 0, R >= 0, got %d, %d, %d, %d",
        p.ep_size, p.top_k, p.num_local_experts, p.runtime_max));
  }
  if (p.rows < p.runtime_max) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchUnpackReceived: rows %d < R %d", p.rows, p.runtime_max));
  }
  if (p.hidden_size < 4 || p.hidden_size % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchUnpackReceived: hidden expected a positive multiple of 4, got %d", p.hidden_size));
  }
  if (p.source_counts == nullptr || (p.expert_counts == nullptr && p.num_local_experts > 0) ||
      (p.rows > 0 && (p.hidden == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr ||
                      (p.runtime_max > 0 && p.recv == nullptr)))) {
    return absl::InvalidArgumentError("LaunchUnpackReceived: null device pointer");
  }
  return absl::OkStatus();
}

absl::Status LaunchUnpackReceived(const UnpackReceivedParams& p, cudaStream_t stream) {
  RETURN_IF_ERROR(CheckUnpackReceived(p));
  if (!p.counts_zeroed) {
    RETURN_IF_ERROR(internal::CudaStatus(
        cudaMemsetAsync(p.source_counts, 0, p.ep_size * sizeof(int64_t), stream),
        "cudaMemsetAsync(source_counts)"));
    if (p.num_local_experts > 0) {
      RETURN_IF_ERROR(internal::CudaStatus(
          cudaMemsetAsync(p.expert_counts, 0, p.num_local_experts * sizeof(int64_t), stream),
          "cudaMemsetAsync(expert_counts)"));
    }
  }
  const int64_t blocks = p.ep_size * p.rows;
  if (blocks == 0) return absl::OkStatus();
  UnpackReceivedKernel<<<static_cast<unsigned>(blocks), kUnpackThreads, 0, stream>>>(p);
  return internal::LaunchStatus("UnpackReceivedKernel");
}

absl::Status EnqueueExpertOutputsPack(const void* expert_out, int64_t rows, void* dst,
                                      int64_t runtime_max, int64_t hidden, int ep_size,
                                      cudaStream_t stream) {
  const int64_t row_bytes = hidden * 2;
  return internal::CudaStatus(
      cudaMemcpy2DAsync(dst, runtime_max * row_bytes, expert_out, rows * row_bytes,
                        runtime_max * row_bytes, ep_size, cudaMemcpyDeviceToDevice, stream),
      "cudaMemcpy2DAsync(expert outputs)");
}

const void* internal::EngineRowsModule() {
  return reinterpret_cast<const void*>(&UnpackReceivedKernel);
}

}  // namespace moe_ep::kernels
