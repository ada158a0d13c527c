#include <cuda_bf16.h>

#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/shared_expert.h"

namespace moe_ep::kernels {
namespace {

constexpr int kPackThreads = 256;

__device__ __forceinline__ float Bf16ToF(uint16_t v) {
  return __uint_as_float(static_cast<uint32_t>(v) << 16);
}

// Block t packs token t: copies its hidden row, writes id 0 and its gate.
__global__ void PackSharedRowsKernel(const uint16_t* __restrict__ hidden,
                                     const uint16_t* __restrict__ gate, int64_t hidden_size,
                                     int64_t row_bytes, uint8_t* __restrict__ rows) {
  __shared__ float partial[kPackThreads];
  const int64_t t = blockIdx.x;
  const uint16_t* x = hidden + t * hidden_size;
  uint8_t* row = rows + t * row_bytes;
  uint16_t* row_hidden = reinterpret_cast<uint16_t*>(row);
  float dot = 0.0f;
  for (int64_t h = threadIdx.x; h < hidden_size; h += blockDim.x) {
    const uint16_t v = x[h];
    row_hidden[h] = v;
    if (gate != nullptr) dot += Bf16ToF(gate[h]) * Bf16ToF(v);
  }
  partial[threadIdx.x] = dot;
  __syncthreads();
  for (int stride = kPackThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] += partial[threadIdx.x + stride];
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    float g = 1.0f;
    if (gate != nullptr) {
      const float z = partial[0];
      // Stable sigmoid, as core::StableSigmoid.
      g = z >= 0.0f ? 1.0f / (1.0f + expf(-z)) : expf(z) / (1.0f + expf(z));
    }
    *reinterpret_cast<int32_t*>(row + 2 * hidden_size) = 0;
    *reinterpret_cast<float*>(row + 2 * hidden_size + 4) = g;
  }
}

}  // namespace

absl::Status LaunchPackSharedRows(const uint16_t* hidden, const uint16_t* gate, int64_t num_tokens,
                                  int64_t hidden_size, uint8_t* rows, cudaStream_t stream) {
  if (num_tokens <= 0) return absl::OkStatus();
  PackSharedRowsKernel<<<static_cast<unsigned>(num_tokens), kPackThreads, 0, stream>>>(
      hidden, gate, hidden_size, 2 * hidden_size + 8, rows);
  return internal::LaunchStatus("PackSharedRowsKernel");
}

const void* internal::SharedExpertPackModule() {
  return reinterpret_cast<const void*>(&PackSharedRowsKernel);
}

}  // namespace moe_ep::kernels
