#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/engine_rows.cuh"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {
namespace {

constexpr int kUnpackThreads = 128;

// Block b: output slot b of [E * rows]. Hidden rows move as uint2 (4 bf16);
// H % 4 == 0 and 2H + 8K being a multiple of 8 keep the vectors aligned.
__global__ void UnpackReceivedKernel(UnpackReceivedParams p) {
  const int64_t b = blockIdx.x;
  const int64_t s = b / p.rows;
  const int64_t j = b % p.rows;
  const int64_t vecs = p.hidden_size / 4;
  uint2* dst = reinterpret_cast<uint2*>(p.hidden + b * p.hidden_size);
  int32_t* ids = p.topk_ids + b * p.top_k;
  float* weights = p.topk_weights + b * p.top_k;
  if (j >= p.runtime_max) {
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = make_uint2(0, 0);
    for (int k = threadIdx.x; k < p.top_k; k += blockDim.x) {
      ids[k] = p.invalid_expert_id;
      weights[k] = 0.0f;
    }
    return;
  }
  const int64_t row_bytes = 2 * p.hidden_size + 8 * p.top_k;
  const uint8_t* row = p.recv + (s * p.runtime_max + j) * row_bytes;
  const uint2* src = reinterpret_cast<const uint2*>(row);
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = src[v];
  const int32_t* row_ids = reinterpret_cast<const int32_t*>(row + 2 * p.hidden_size);
  const float* row_weights = reinterpret_cast<const float*>(row + 2 * p.hidden_size + 4 * p.top_k);
  __shared__ int local;
  if (threadIdx.x == 0) local = 0;
  __syncthreads();
  for (int k = threadIdx.x; k < p.top_k; k += blockDim.x) {
    const int32_t id = row_ids[k];
    ids[k] = id;
    weights[k] = row_weights[k];
    const int l = id - p.first_expert;
    if (id != p.invalid_expert_id && l >= 0 && l < p.num_local_experts) {
      atomicAdd(reinterpret_cast<unsigned long long*>(p.expert_counts + l), 1ull);
      local = 1;  // benign race: every writer stores 1
    }
  }
  __syncthreads();
  if (threadIdx.x == 0 && local) {
    atomicAdd(reinterpret_cast<unsigned long long*>(p.source_counts + s), 1ull);
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

}  // namespace moe_ep::kernels
