#include <cmath>
#include <cstdint>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/nccl_collective.h"
#include "kernels/rms_norm.cuh"
#include "kernels/stream_collective.h"

namespace moe_ep::kernels {
namespace {

constexpr int kMaxNormThreads = 256;
// Rows whose fp32 copy fits the default 48 KiB of shared memory (less 1 KiB
// kept for the static reduction scratch) stay there between the two halves
// of the pass.
constexpr int64_t kMaxCachedHidden = (48 * 1024 - 1024) / static_cast<int64_t>(sizeof(float));
constexpr int64_t kMaxGridBlocks = int64_t{1} << 20;
constexpr int kElementwiseThreads = 256;

// What the norm kernel does with the residual.
enum NormMode : uint8_t {
  kNormOnly = 0,       // out = norm(in)
  kAddResidual = 1,    // residual += x; x = norm(residual)   (in == out == x)
  kStoreResidual = 2,  // residual = x;  x = norm(x)          (in == out == x)
};

template <int kVec>
struct VecOf;
template <>
struct VecOf<1> {
  using type = float;
};
template <>
struct VecOf<4> {
  using type = float4;
};

__device__ __forceinline__ float Get(const float& v, int) { return v; }
__device__ __forceinline__ float Get(const float4& v, int k) {
  return k == 0 ? v.x : (k == 1 ? v.y : (k == 2 ? v.z : v.w));
}
__device__ __forceinline__ void Set(float& v, int, float f) { v = f; }
__device__ __forceinline__ void Set(float4& v, int k, float f) {
  if (k == 0) v.x = f;
  if (k == 1) v.y = f;
  if (k == 2) v.z = f;
  if (k == 3) v.w = f;
}

// Sum of `v` over the block; every thread gets the result. `scratch` holds
// one float per warp. Starts with a barrier so `scratch` can be reused by the
// next row.
__device__ float BlockSum(float v, float* scratch) {
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int num_warps = (blockDim.x + 31) / 32;
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.0f;
  for (int w = 0; w < num_warps; ++w) total += scratch[w];
  return total;
}

// RmsNormKernel: block b handles rows b, b + gridDim.x, ...; its threads walk
// the row in vectors of kVec floats (vector j of the row by thread j mod
// blockDim). Pass 1 forms v (in, in + residual, or in), writes the residual
// when kMode != kNormOnly, caches v in shared memory when kCache, and sums
// v^2; the block sum gives inv; pass 2 writes out = v * inv * weight. Each
// thread re-reads only elements it wrote itself, so no barrier is needed
// between the passes beyond the one in BlockSum.
// Dynamic shared memory: kCache ? hidden * 4 bytes : 0.
template <int kMode, int kVec, bool kCache>
__global__ void __launch_bounds__(kMaxNormThreads)
    RmsNormKernel(const float* in, float* out, float* residual, const float* __restrict__ weight,
                  int64_t rows, int64_t hidden, float eps) {
  using V = typename VecOf<kVec>::type;
  extern __shared__ __align__(16) float cache_storage[];
  __shared__ float warp_sums[kMaxNormThreads / 32];
  V* cache = reinterpret_cast<V*>(cache_storage);
  const int64_t vecs = hidden / kVec;
  const V* w = reinterpret_cast<const V*>(weight);
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const V* src = reinterpret_cast<const V*>(in + row * hidden);
    V* dst = reinterpret_cast<V*>(out + row * hidden);
    V* res = reinterpret_cast<V*>(residual + row * hidden);
    float sum_sq = 0.0f;
    for (int64_t j = threadIdx.x; j < vecs; j += blockDim.x) {
      V v = src[j];
      if constexpr (kMode == kAddResidual) {
        const V r = res[j];
        for (int k = 0; k < kVec; ++k) Set(v, k, Get(v, k) + Get(r, k));
      }
      if constexpr (kMode != kNormOnly) res[j] = v;
      if constexpr (kCache) cache[j] = v;
      for (int k = 0; k < kVec; ++k) sum_sq += Get(v, k) * Get(v, k);
    }
    const float total = BlockSum(sum_sq, warp_sums);
    const float inv = 1.0f / sqrtf(total / static_cast<float>(hidden) + eps);
    for (int64_t j = threadIdx.x; j < vecs; j += blockDim.x) {
      V v;
      if constexpr (kCache) {
        v = cache[j];
      } else if constexpr (kMode == kNormOnly) {
        v = src[j];
      } else {
        v = res[j];
      }
      const V g = w[j];
      V o;
      for (int k = 0; k < kVec; ++k) Set(o, k, Get(v, k) * inv * Get(g, k));
      dst[j] = o;
    }
  }
}

// Grid-stride: thread i adds src[i] into dst[i].
template <int kVec>
__global__ void AddInPlaceKernel(float* dst, const float* src, int64_t vecs) {
  using V = typename VecOf<kVec>::type;
  V* d = reinterpret_cast<V*>(dst);
  const V* s = reinterpret_cast<const V*>(src);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    V a = d[i];
    const V b = s[i];
    for (int k = 0; k < kVec; ++k) Set(a, k, Get(a, k) + Get(b, k));
    d[i] = a;
  }
}

// Grid-stride: out[i] = in[i] + in[count + i] + ... in ascending chunk order.
template <int kVec>
__global__ void SumChunksKernel(const float* __restrict__ in, int num_chunks, int64_t vecs,
                                float* __restrict__ out) {
  using V = typename VecOf<kVec>::type;
  const V* src = reinterpret_cast<const V*>(in);
  V* dst = reinterpret_cast<V*>(out);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    V acc = src[i];
    for (int c = 1; c < num_chunks; ++c) {
      const V b = src[c * vecs + i];
      for (int k = 0; k < kVec; ++k) Set(acc, k, Get(acc, k) + Get(b, k));
    }
    dst[i] = acc;
  }
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

unsigned GridFor(int64_t items, int threads) {
  const int64_t blocks = (items + threads - 1) / threads;
  return static_cast<unsigned>(blocks < kMaxGridBlocks ? blocks : kMaxGridBlocks);
}

absl::Status CheckNormArgs(const char* who, const void* in, const void* out, const void* residual,
                           bool needs_residual, const float* weight, int64_t rows, int64_t hidden,
                           float eps) {
  if (rows < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: rows expected >= 0, got %d", who, rows));
  }
  if (hidden < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: hidden expected >= 1, got %d", who, hidden));
  }
  if (!(eps > 0.0f) || !std::isfinite(eps)) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: eps expected finite and > 0, got %g", who, eps));
  }
  if (rows == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr || weight == nullptr ||
      (needs_residual && residual == nullptr)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: null device pointer (x/in %p, out %p, residual %p, weight %p) with rows %d", who, in,
        out, residual, weight, rows));
  }
  if (needs_residual && residual == in) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: x and residual must be different buffers", who));
  }
  return absl::OkStatus();
}

template <int kMode, int kVec>
absl::Status LaunchNormVariant(const float* in, float* out, float* residual, const float* weight,
                               int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  const int64_t vecs = hidden / kVec;
  int threads = static_cast<int>(vecs < kMaxNormThreads ? (vecs + 31) / 32 * 32 : kMaxNormThreads);
  const unsigned grid = static_cast<unsigned>(rows < kMaxGridBlocks ? rows : kMaxGridBlocks);
  if (hidden <= kMaxCachedHidden) {
    const size_t smem = static_cast<size_t>(hidden) * sizeof(float);
    RmsNormKernel<kMode, kVec, true>
        <<<grid, threads, smem, stream>>>(in, out, residual, weight, rows, hidden, eps);
  } else {
    RmsNormKernel<kMode, kVec, false>
        <<<grid, threads, 0, stream>>>(in, out, residual, weight, rows, hidden, eps);
  }
  return internal::LaunchStatus("RmsNormKernel");
}

template <int kMode>
absl::Status LaunchNorm(const float* in, float* out, float* residual, const float* weight,
                        int64_t rows, int64_t hidden, float eps, cudaStream_t stream) {
  const bool vec4 = hidden % 4 == 0 && Aligned16(in) && Aligned16(out) && Aligned16(weight) &&
                    (kMode == kNormOnly || Aligned16(residual));
  if (vec4) {
    return LaunchNormVariant<kMode, 4>(in, out, residual, weight, rows, hidden, eps, stream);
  }
  return LaunchNormVariant<kMode, 1>(in, out, residual, weight, rows, hidden, eps, stream);
}

}  // namespace

absl::Status LaunchRmsNorm(const float* in, float* out, const float* weight, int64_t rows,
                           int64_t hidden, float eps, cudaStream_t stream) {
  RETURN_IF_ERROR(
      CheckNormArgs("LaunchRmsNorm", in, out, nullptr, false, weight, rows, hidden, eps));
  if (rows == 0) return absl::OkStatus();
  return LaunchNorm<kNormOnly>(in, out, nullptr, weight, rows, hidden, eps, stream);
}

absl::Status LaunchAddResidualRmsNorm(float* x, float* residual, const float* weight, int64_t rows,
                                      int64_t hidden, float eps, cudaStream_t stream) {
  RETURN_IF_ERROR(
      CheckNormArgs("LaunchAddResidualRmsNorm", x, x, residual, true, weight, rows, hidden, eps));
  if (rows == 0) return absl::OkStatus();
  return LaunchNorm<kAddResidual>(x, x, residual, weight, rows, hidden, eps, stream);
}

absl::Status LaunchStoreResidualRmsNorm(float* x, float* residual, const float* weight,
                                        int64_t rows, int64_t hidden, float eps,
                                        cudaStream_t stream) {
  RETURN_IF_ERROR(
      CheckNormArgs("LaunchStoreResidualRmsNorm", x, x, residual, true, weight, rows, hidden, eps));
  if (rows == 0) return absl::OkStatus();
  return LaunchNorm<kStoreResidual>(x, x, residual, weight, rows, hidden, eps, stream);
}

absl::Status LaunchAddInPlace(float* dst, const float* src, int64_t count, cudaStream_t stream) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchAddInPlace: count expected >= 0, got %d", count));
  }
  if (count == 0) return absl::OkStatus();
  if (dst == nullptr || src == nullptr) {
    return absl::InvalidArgumentError("LaunchAddInPlace: null device pointer");
  }
  if (count % 4 == 0 && Aligned16(dst) && Aligned16(src)) {
    AddInPlaceKernel<4>
        <<<GridFor(count / 4, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(dst, src,
                                                                                      count / 4);
  } else {
    AddInPlaceKernel<1>
        <<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(dst, src, count);
  }
  return internal::LaunchStatus("AddInPlaceKernel");
}

absl::Status LaunchSumChunks(const float* in, int num_chunks, int64_t count, float* out,
                             cudaStream_t stream) {
  if (num_chunks < 1 || count < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchSumChunks: num_chunks expected >= 1 and count >= 0, got %d and %d",
                        num_chunks, count));
  }
  if (count == 0) return absl::OkStatus();
  if (in == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("LaunchSumChunks: null device pointer");
  }
  if (count % 4 == 0 && Aligned16(in) && Aligned16(out)) {
    SumChunksKernel<4><<<GridFor(count / 4, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
        in, num_chunks, count / 4, out);
  } else {
    SumChunksKernel<1><<<GridFor(count, kElementwiseThreads), kElementwiseThreads, 0, stream>>>(
        in, num_chunks, count, out);
  }
  return internal::LaunchStatus("SumChunksKernel");
}

const char* AllReduceNormImplName(AllReduceNormImpl impl) {
  switch (impl) {
    case AllReduceNormImpl::kFused:
      return "fused";
    case AllReduceNormImpl::kUnfused:
      return "unfused";
  }
  return "unknown";
}

absl::Status AllReduceAddRmsNorm(StreamCollective& group, AllReduceNormImpl impl, float* x,
                                 float* residual, const float* weight, int64_t rows, int64_t hidden,
                                 float eps) {
  RETURN_IF_ERROR(
      CheckNormArgs("AllReduceAddRmsNorm", x, x, residual, true, weight, rows, hidden, eps));
  if (impl != AllReduceNormImpl::kFused && impl != AllReduceNormImpl::kUnfused) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AllReduceAddRmsNorm: impl expected fused or unfused, got %d", static_cast<int>(impl)));
  }
  if (rows == 0) return absl::OkStatus();
  if (!IsDevicePointer(x) || !IsDevicePointer(residual) || !IsDevicePointer(weight)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AllReduceAddRmsNorm on rank %d: x, residual and weight must be device memory",
        group.rank()));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(group.device()), "cudaSetDevice"));
  // Both paths: the all-reduce first, never skipped.
  RETURN_IF_ERROR(group.AllReduceSum(x, rows * hidden));
  const cudaStream_t stream = group.stream();
  if (impl == AllReduceNormImpl::kFused) {
    return LaunchAddResidualRmsNorm(x, residual, weight, rows, hidden, eps, stream);
  }
  RETURN_IF_ERROR(LaunchAddInPlace(residual, x, rows * hidden, stream));
  return LaunchRmsNorm(residual, x, weight, rows, hidden, eps, stream);
}

const void* internal::RmsNormModule() {
  return reinterpret_cast<const void*>(&AddInPlaceKernel<4>);
}

}  // namespace moe_ep::kernels
