#include <climits>

#include "absl/strings/str_format.h"
#include "core/fp8_e4m3.h"
#include "kernels/fp8_dispatch.cuh"
#include "kernels/fp8_expert_kernels.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/route.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 65535;

int GridFor(int64_t items, int per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

// Block-stride over positions i < *num_entries; warp w of the block
// quantizes the 128-value blocks b = w, w + 8, ... of the row: lane l reads
// values [4l, 4l + 4) of block b (8 bytes), writes their 4 codes (4 bytes,
// so the warp's 128 bytes are contiguous) and lane 0 the block's scale.
__global__ void GatherQuantizeRowsKernel(const uint8_t* __restrict__ recv, int64_t row_bytes,
                                         int64_t hidden, int top_k, bool scale_input,
                                         const int32_t* __restrict__ sorted_values,
                                         const int32_t* __restrict__ num_entries,
                                         uint8_t* __restrict__ x, float* __restrict__ x_scale,
                                         int64_t x_scale_stride) {
  const int64_t n = *num_entries;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t blocks = hidden / core::fp8::kBlockSize;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int32_t entry = sorted_values[i];
    const uint8_t* src = recv + entry / top_k * row_bytes;
    // Llama-4 (scale_input): quantize bf16(w * x), w the entry's router weight.
    const float w =
        scale_input ? reinterpret_cast<const float*>(src + 2 * hidden + 4 * top_k)[entry % top_k]
                    : 1.0f;
    for (int64_t b = warp; b < blocks; b += kThreads / 32) {
      const uint2 raw = reinterpret_cast<const uint2*>(src + b * 2 * core::fp8::kBlockSize)[lane];
      uint16_t v[4] = {static_cast<uint16_t>(raw.x), static_cast<uint16_t>(raw.x >> 16),
                       static_cast<uint16_t>(raw.y), static_cast<uint16_t>(raw.y >> 16)};
      if (scale_input) {
        for (uint16_t& value : v) {
          value = core::fp8::Bf16FromFloat(w * __uint_as_float(static_cast<uint32_t>(value) << 16));
        }
      }
      float scale = 0.0f;
      const uint32_t codes = internal::QuantizeWarpBlock(v, &scale);
      reinterpret_cast<uint32_t*>(x + i * hidden + b * core::fp8::kBlockSize)[lane] = codes;
      if (lane == 0) x_scale[b * x_scale_stride + i] = scale;
    }
  }
}

// Token-major form of the above (no input scaling): block-stride over
// received rows r < rows; each 128-value block of the row is quantized once
// (warp w: blocks w, w + 8, ..., four loads in flight per lane) and its codes
// and scale are written to every local sorted position of the row
// (position[r * K + k] >= 0). The codes are those of GatherQuantizeRowsKernel
// (the same rule on the same values); each row is read once instead of once
// per local entry (at 4096 tokens x top-8: 59 MB read instead of 470 MB).
constexpr int kScatterUnroll = 4;
__global__ void QuantizeScatterRowsKernel(const uint8_t* __restrict__ recv, int64_t row_bytes,
                                          int64_t hidden, int top_k, int64_t rows,
                                          const int32_t* __restrict__ position,
                                          uint8_t* __restrict__ x, float* __restrict__ x_scale,
                                          int64_t x_scale_stride) {
  __shared__ int32_t pos[kMaxTopK];
  __shared__ int any_local;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int64_t blocks = hidden / core::fp8::kBlockSize;
  for (int64_t r = blockIdx.x; r < rows; r += gridDim.x) {
    if (threadIdx.x == 0) any_local = 0;
    __syncthreads();
    if (threadIdx.x < top_k) {
      pos[threadIdx.x] = position[r * top_k + threadIdx.x];
      if (pos[threadIdx.x] >= 0) any_local = 1;
    }
    __syncthreads();
    if (any_local) {
      const uint8_t* src = recv + r * row_bytes;
      for (int64_t b0 = warp; b0 < blocks; b0 += kScatterUnroll * (kThreads / 32)) {
        uint2 raw[kScatterUnroll];
#pragma unroll
        for (int u = 0; u < kScatterUnroll; ++u) {
          const int64_t b = b0 + u * (kThreads / 32);
          if (b < blocks) {
            raw[u] = reinterpret_cast<const uint2*>(src + b * 2 * core::fp8::kBlockSize)[lane];
          }
        }
#pragma unroll
        for (int u = 0; u < kScatterUnroll; ++u) {
          const int64_t b = b0 + u * (kThreads / 32);
          if (b >= blocks) break;  // warp-uniform
          const uint16_t v[4] = {
              static_cast<uint16_t>(raw[u].x), static_cast<uint16_t>(raw[u].x >> 16),
              static_cast<uint16_t>(raw[u].y), static_cast<uint16_t>(raw[u].y >> 16)};
          float scale = 0.0f;
          const uint32_t codes = internal::QuantizeWarpBlock(v, &scale);
          for (int k = 0; k < top_k; ++k) {
            const int32_t p = pos[k];
            if (p < 0) continue;
            reinterpret_cast<uint32_t*>(x + int64_t{p} * hidden + b * core::fp8::kBlockSize)[lane] =
                codes;
            if (lane == 0) x_scale[b * x_scale_stride + p] = scale;
          }
        }
      }
    }
    __syncthreads();  // pos / any_local are rewritten for the next row
  }
}

__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }

// Block r = received row r (grid-stride); thread t sums groups of 4 columns
// (uint2 of bf16) over the row's local entries in ascending k.
__global__ void WeightedSumBf16Kernel(const uint8_t* __restrict__ recv, int64_t num_rows,
                                      int64_t row_bytes, int64_t hidden, int top_k,
                                      bool unit_weights, const int32_t* __restrict__ position,
                                      const uint16_t* __restrict__ y, uint16_t* __restrict__ out) {
  __shared__ int32_t pos[kMaxTopK];
  __shared__ float w[kMaxTopK];
  __shared__ int any_local;
  const int64_t vecs = hidden / 4;
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const uint8_t* row = recv + r * row_bytes;
    if (threadIdx.x == 0) any_local = 0;
    __syncthreads();
    if (threadIdx.x < top_k) {
      pos[threadIdx.x] = position[r * top_k + threadIdx.x];
      w[threadIdx.x] =
          unit_weights ? 1.0f
                       : reinterpret_cast<const float*>(row + 2 * hidden + 4 * top_k)[threadIdx.x];
      if (pos[threadIdx.x] >= 0) any_local = 1;
    }
    __syncthreads();
    if (any_local) {
      uint2* dst = reinterpret_cast<uint2*>(out + r * hidden);
      for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int k = 0; k < top_k; ++k) {
          if (pos[k] < 0) continue;
          const uint2 yv = reinterpret_cast<const uint2*>(y + pos[k] * hidden)[v];
          acc[0] += w[k] * Bf16Lo(yv.x);
          acc[1] += w[k] * Bf16Hi(yv.x);
          acc[2] += w[k] * Bf16Lo(yv.y);
          acc[3] += w[k] * Bf16Hi(yv.y);
        }
        uint2 packed;
        packed.x = core::fp8::Bf16FromFloat(acc[0]) |
                   (static_cast<uint32_t>(core::fp8::Bf16FromFloat(acc[1])) << 16);
        packed.y = core::fp8::Bf16FromFloat(acc[2]) |
                   (static_cast<uint32_t>(core::fp8::Bf16FromFloat(acc[3])) << 16);
        dst[v] = packed;
      }
    }
    __syncthreads();  // pos / w / any_local are rewritten for the next row
  }
}

// Block = one 128 x 128 scale block (matrix m, row block rb, column block
// cb, flattened in that order); warp w covers rows r0 + w, r0 + w + 8, ...,
// lane l columns c0 + l, c0 + l + 32, ... (scalar bf16 loads: any cols).
// Pass 1 takes the block's amax (warp shuffles, then one shared slot per
// warp), pass 2 writes the codes.
__global__ void QuantizeFp8BlocksKernel(const uint16_t* __restrict__ w, int64_t rows, int64_t cols,
                                        int64_t row_blocks, int64_t col_blocks,
                                        uint8_t* __restrict__ codes,
                                        float* __restrict__ scale_inv) {
  __shared__ float warp_max[kThreads / 32];
  const int64_t blk = blockIdx.x;
  const int64_t m = blk / (row_blocks * col_blocks);
  const int64_t rb = (blk / col_blocks) % row_blocks;
  const int64_t cb = blk % col_blocks;
  const int64_t r0 = rb * core::fp8::kBlockSize;
  const int64_t c0 = cb * core::fp8::kBlockSize;
  const int64_t r1 = r0 + core::fp8::kBlockSize < rows ? r0 + core::fp8::kBlockSize : rows;
  const int64_t c1 = c0 + core::fp8::kBlockSize < cols ? c0 + core::fp8::kBlockSize : cols;
  const uint16_t* src = w + m * rows * cols;
  uint8_t* dst = codes + m * rows * cols;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  float amax = 0.0f;
  for (int64_t r = r0 + warp; r < r1; r += kThreads / 32) {
    for (int64_t c = c0 + lane; c < c1; c += 32) {
      amax = fmaxf(amax, core::fp8::Bf16Abs(src[r * cols + c]));
    }
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, offset));
  }
  if (lane == 0) warp_max[warp] = amax;
  __syncthreads();
  amax = 0.0f;
  for (int i = 0; i < kThreads / 32; ++i) amax = fmaxf(amax, warp_max[i]);
  const float scale = core::fp8::BlockScale(amax);
  if (threadIdx.x == 0) scale_inv[blk] = scale;
  for (int64_t r = r0 + warp; r < r1; r += kThreads / 32) {
    for (int64_t c = c0 + lane; c < c1; c += 32) {
      dst[r * cols + c] = core::fp8::QuantizeValue(src[r * cols + c], scale);
    }
  }
}

}  // namespace

absl::Status LaunchGatherQuantizeExpertRows(const uint8_t* recv, int64_t max_entries,
                                            int64_t hidden, int top_k, const ExpertEntryBuffers& b,
                                            int num_local_experts, uint8_t* x, float* x_scale,
                                            int64_t x_scale_stride, cudaStream_t stream,
                                            bool scale_input) {
  if (max_entries < 0 || max_entries > INT_MAX || hidden < core::fp8::kBlockSize ||
      hidden % core::fp8::kBlockSize != 0 || top_k < 1 || top_k > kMaxTopK ||
      num_local_experts < 1 || x_scale_stride < max_entries) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchGatherQuantizeExpertRows: expected max_entries in [0, INT_MAX] (got %d), hidden a "
        "positive multiple of 128 (got %d), top_k in [1, %d] (got %d), num_local_experts >= 1 "
        "(got %d), x_scale_stride >= max_entries (got %d)",
        max_entries, hidden, kMaxTopK, top_k, num_local_experts, x_scale_stride));
  }
  if (max_entries == 0) return absl::OkStatus();
  if (recv == nullptr || b.sorted_values == nullptr || b.offsets == nullptr || x == nullptr ||
      x_scale == nullptr) {
    return absl::InvalidArgumentError("LaunchGatherQuantizeExpertRows: null device pointer");
  }
  if (reinterpret_cast<uintptr_t>(x) % 4 != 0) {
    return absl::InvalidArgumentError("LaunchGatherQuantizeExpertRows: x must be 4-byte aligned");
  }
  if (!scale_input && b.position != nullptr && max_entries % top_k == 0) {
    QuantizeScatterRowsKernel<<<GridFor(max_entries / top_k, 1), kThreads, 0, stream>>>(
        recv, 2 * hidden + 8 * top_k, hidden, top_k, max_entries / top_k, b.position, x, x_scale,
        x_scale_stride);
    return internal::LaunchStatus("QuantizeScatterRowsKernel");
  }
  GatherQuantizeRowsKernel<<<GridFor(max_entries, 1), kThreads, 0, stream>>>(
      recv, 2 * hidden + 8 * top_k, hidden, top_k, scale_input, b.sorted_values,
      b.offsets + num_local_experts, x, x_scale, x_scale_stride);
  return internal::LaunchStatus("GatherQuantizeRowsKernel");
}

absl::Status LaunchWeightedExpertSumBf16(const uint8_t* recv, int64_t num_rows, int64_t hidden,
                                         int top_k, const int32_t* position, const uint16_t* y,
                                         uint16_t* out, cudaStream_t stream, bool unit_weights) {
  if (num_rows < 0 || hidden < 4 || hidden % 4 != 0 || top_k < 1 || top_k > kMaxTopK ||
      num_rows * top_k > INT_MAX) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchWeightedExpertSumBf16: expected num_rows >= 0 (got %d) with num_rows * top_k in "
        "int32, hidden a positive multiple of 4 (got %d), top_k in [1, %d] (got %d)",
        num_rows, hidden, kMaxTopK, top_k));
  }
  if (num_rows == 0) return absl::OkStatus();
  if (recv == nullptr || position == nullptr || y == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("LaunchWeightedExpertSumBf16: null device pointer");
  }
  WeightedSumBf16Kernel<<<GridFor(num_rows, 1), kThreads, 0, stream>>>(
      recv, num_rows, 2 * hidden + 8 * top_k, hidden, top_k, unit_weights, position, y, out);
  return internal::LaunchStatus("WeightedSumBf16Kernel");
}

absl::Status LaunchQuantizeFp8BlockMatrices(const uint16_t* w, int64_t num_matrices, int64_t rows,
                                            int64_t cols, uint8_t* codes, float* scale_inv,
                                            cudaStream_t stream) {
  if (num_matrices < 1 || rows < 1 || cols < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchQuantizeFp8BlockMatrices: expected num_matrices, rows, cols >= 1, got %d, %d, %d",
        num_matrices, rows, cols));
  }
  if (w == nullptr || codes == nullptr || scale_inv == nullptr) {
    return absl::InvalidArgumentError("LaunchQuantizeFp8BlockMatrices: null device pointer");
  }
  const int64_t row_blocks = (rows + core::fp8::kBlockSize - 1) / core::fp8::kBlockSize;
  const int64_t col_blocks = (cols + core::fp8::kBlockSize - 1) / core::fp8::kBlockSize;
  const int64_t blocks = num_matrices * row_blocks * col_blocks;
  if (blocks > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchQuantizeFp8BlockMatrices: %d scale blocks exceed one grid", blocks));
  }
  QuantizeFp8BlocksKernel<<<static_cast<int>(blocks), kThreads, 0, stream>>>(
      w, rows, cols, row_blocks, col_blocks, codes, scale_inv);
  return internal::LaunchStatus("QuantizeFp8BlocksKernel");
}

const void* internal::Fp8ExpertKernelsModule() {
  return reinterpret_cast<const void*>(&GatherQuantizeRowsKernel);
}

}  // namespace moe_ep::kernels
