#include "absl/strings/str_format.h"
#include "kernels/dispatch_pack.cuh"
#include "kernels/fp8_dispatch.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/device_placement.cuh"
#include "kernels/internal/expert_id_check.cuh"
#include "kernels/internal/kernel_modules.h"
#include "kernels/route.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int kPackThreads = 256;

// The top-k tail of the pack kernels (both wire rows end with ids [K] int32
// and weights [K] fp32 at byte `tail` of the row): token b's ids and weights
// into its slot of each destination in dest_slot (b < n; a replicated
// expert's id stays only in the copy for the rank that serves it, the
// others get the invalid id, and so do all copies of a lost expert's id), then the invalid-id /
// zero-weight tail of padding slot b of every destination with counts[d] <= b. Row (d, slot) is at
// send + (d * max_tokens + slot) * row_bytes.
__device__ void PackTopKTails(const int32_t* __restrict__ topk_ids,
                              const float* __restrict__ topk_weights, int64_t b, int64_t n,
                              const int32_t* dest_slot, const int32_t* counts, int top_k,
                              int ep_size, int32_t invalid_expert_id, uint8_t* __restrict__ send,
                              int64_t max_tokens, int64_t row_bytes, int64_t tail,
                              const DevicePlacement& placement, int num_experts) {
  auto row = [&](int d, int64_t slot) { return send + (d * max_tokens + slot) * row_bytes; };
  if (b < n) {
    for (int k = threadIdx.x; k < top_k; k += blockDim.x) {
      const int32_t id = topk_ids[b * top_k + k];
      const float w = topk_weights[b * top_k + k];
      for (int d = 0; d < ep_size; ++d) {
        if (dest_slot[d] < 0) continue;
        uint8_t* r = row(d, dest_slot[d]);
        int32_t out_id = internal::ExpertOrInvalid(id, num_experts, invalid_expert_id);
        if (placement.replica_offsets != nullptr && id >= 0 && id < num_experts &&
            internal::NumReplicas(placement, id) != 1 &&
            internal::DestinationRank(placement, b, id, 0, 0) != d) {
          out_id = invalid_expert_id;
        }
        reinterpret_cast<int32_t*>(r + tail)[k] = out_id;
        reinterpret_cast<float*>(r + tail + 4 * top_k)[k] = w;
      }
    }
  }
  for (int d = 0; d < ep_size; ++d) {
    if (b < counts[d]) continue;
    uint8_t* r = row(d, b);
    for (int k = threadIdx.x; k < top_k; k += blockDim.x) {
      reinterpret_cast<int32_t*>(r + tail)[k] = invalid_expert_id;
      reinterpret_cast<float*>(r + tail + 4 * top_k)[k] = 0.0f;
    }
  }
}

// Block b: token b and padding slot b (see the header for the layout).
// Hidden rows move as uint2 (4 bf16); H % 4 == 0 and 2H + 8K being a multiple
// of 8 keep every vector 8-byte aligned.
__global__ void PackDispatchKernel(
    const uint16_t* __restrict__ hidden, const int32_t* __restrict__ topk_ids,
    const float* __restrict__ topk_weights, const int32_t* __restrict__ token_slot,
    const int32_t* __restrict__ send_counts, const int64_t* num_tokens, int64_t max_tokens,
    int64_t hidden_size, int top_k, int ep_size, int32_t invalid_expert_id,
    uint8_t* __restrict__ send, DevicePlacement placement, int num_experts) {
  __shared__ int32_t dest_slot[kMaxEpSize];
  __shared__ int32_t counts[kMaxEpSize];
  const int64_t b = blockIdx.x;
  const int64_t n = *num_tokens < max_tokens ? *num_tokens : max_tokens;
  const int64_t row_bytes = 2 * hidden_size + 8 * top_k;
  if (threadIdx.x < ep_size) {
    dest_slot[threadIdx.x] = b < n ? token_slot[b * ep_size + threadIdx.x] : -1;
    counts[threadIdx.x] = send_counts[threadIdx.x];
  }
  __syncthreads();
  auto row = [&](int d, int64_t slot) { return send + (d * max_tokens + slot) * row_bytes; };
  if (b < n) {
    const uint2* src = reinterpret_cast<const uint2*>(hidden + b * hidden_size);
    const int64_t vecs = hidden_size / 4;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const uint2 x = src[v];
      for (int d = 0; d < ep_size; ++d) {
        if (dest_slot[d] >= 0) reinterpret_cast<uint2*>(row(d, dest_slot[d]))[v] = x;
      }
    }
  }
  PackTopKTails(topk_ids, topk_weights, b, n, dest_slot, counts, top_k, ep_size, invalid_expert_id,
                send, max_tokens, row_bytes, 2 * hidden_size, placement, num_experts);
}

// The fp8 twin of PackDispatchKernel: block b quantizes token b (one warp a
// 128-value block) into each destination's fp8 wire row
// (kernels/fp8_dispatch.cuh) and sanitizes padding slot b.
__global__ void PackDispatchFp8Kernel(
    const uint16_t* __restrict__ hidden, const int32_t* __restrict__ topk_ids,
    const float* __restrict__ topk_weights, const int32_t* __restrict__ token_slot,
    const int32_t* __restrict__ send_counts, const int64_t* num_tokens, int64_t max_tokens,
    int64_t hidden_size, int top_k, int ep_size, int32_t invalid_expert_id,
    uint8_t* __restrict__ send, DevicePlacement placement, int num_experts) {
  __shared__ int32_t dest_slot[kMaxEpSize];
  __shared__ int32_t counts[kMaxEpSize];
  const int64_t b = blockIdx.x;
  const int64_t n = *num_tokens < max_tokens ? *num_tokens : max_tokens;
  const int64_t row_bytes = Fp8DispatchRowBytes(hidden_size, top_k);
  const int64_t tail = core::fp8::QuantizedHiddenBytes(hidden_size);  // ids start here
  if (threadIdx.x < ep_size) {
    dest_slot[threadIdx.x] = b < n ? token_slot[b * ep_size + threadIdx.x] : -1;
    counts[threadIdx.x] = send_counts[threadIdx.x];
  }
  __syncthreads();
  auto row = [&](int d, int64_t slot) { return send + (d * max_tokens + slot) * row_bytes; };
  if (b < n) {
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int warps = blockDim.x / 32;
    const int64_t blocks = hidden_size / core::fp8::kBlockSize;
    for (int64_t blk = warp; blk < blocks; blk += warps) {
      const uint2 x = reinterpret_cast<const uint2*>(hidden + b * hidden_size +
                                                     blk * core::fp8::kBlockSize)[lane];
      const uint16_t v[4] = {static_cast<uint16_t>(x.x), static_cast<uint16_t>(x.x >> 16),
                             static_cast<uint16_t>(x.y), static_cast<uint16_t>(x.y >> 16)};
      float scale = 0.0f;
      const uint32_t codes = internal::QuantizeWarpBlock(v, &scale);
      for (int d = 0; d < ep_size; ++d) {
        if (dest_slot[d] < 0) continue;
        uint8_t* r = row(d, dest_slot[d]);
        reinterpret_cast<uint32_t*>(r + blk * core::fp8::kBlockSize)[lane] = codes;
        if (lane == 0) reinterpret_cast<float*>(r + hidden_size)[blk] = scale;
      }
    }
  }
  PackTopKTails(topk_ids, topk_weights, b, n, dest_slot, counts, top_k, ep_size, invalid_expert_id,
                send, max_tokens, row_bytes, tail, placement, num_experts);
}

}  // namespace

absl::Status LaunchPackDispatch(const PackDispatchParams& p, cudaStream_t stream) {
  if (p.num_tokens == nullptr || p.send_counts == nullptr ||
      (p.max_tokens > 0 &&
       (p.hidden == nullptr || p.topk_ids == nullptr || p.topk_weights == nullptr ||
        p.token_slot == nullptr || p.send == nullptr))) {
    return absl::InvalidArgumentError("LaunchPackDispatch: null device pointer");
  }
  if (p.max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchPackDispatch: max_tokens expected >= 0, got %d", p.max_tokens));
  }
  if (p.hidden_size < 4 || p.hidden_size % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchPackDispatch: hidden expected a positive multiple of 4, got %d", p.hidden_size));
  }
  if (p.top_k < 1 || p.top_k > kMaxTopK) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchPackDispatch: top_k expected in [1, %d], got %d", kMaxTopK, p.top_k));
  }
  if (p.ep_size < 1 || p.ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchPackDispatch: ep_size expected in [1, %d], got %d", kMaxEpSize, p.ep_size));
  }
  if (p.num_experts < p.ep_size) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchPackDispatch: num_experts expected >= ep_size %d, got %d", p.ep_size,
                        p.num_experts));
  }
  if (reinterpret_cast<uintptr_t>(p.send) % 8 != 0 ||
      reinterpret_cast<uintptr_t>(p.hidden) % 8 != 0) {
    return absl::InvalidArgumentError("LaunchPackDispatch: send and hidden must be 8-byte aligned");
  }
  const bool fp8 = p.dtype == core::DispatchDType::kFP8E4M3;
  if (!fp8 && p.dtype != core::DispatchDType::kBF16) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchPackDispatch: dtype expected bf16 or fp8_e4m3, got %s",
                        core::DispatchDTypeName(p.dtype)));
  }
  if (fp8 && p.hidden_size % core::fp8::kBlockSize != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchPackDispatch: fp8_e4m3 needs hidden a multiple of 128, got %d", p.hidden_size));
  }
  if (p.max_tokens == 0) return absl::OkStatus();
  if (fp8) {
    PackDispatchFp8Kernel<<<static_cast<unsigned>(p.max_tokens), kPackThreads, 0, stream>>>(
        p.hidden, p.topk_ids, p.topk_weights, p.token_slot, p.send_counts, p.num_tokens,
        p.max_tokens, p.hidden_size, p.top_k, p.ep_size, p.invalid_expert_id, p.send, p.placement,
        p.num_experts);
    return internal::LaunchStatus("PackDispatchFp8Kernel");
  }
  PackDispatchKernel<<<static_cast<unsigned>(p.max_tokens), kPackThreads, 0, stream>>>(
      p.hidden, p.topk_ids, p.topk_weights, p.token_slot, p.send_counts, p.num_tokens, p.max_tokens,
      p.hidden_size, p.top_k, p.ep_size, p.invalid_expert_id, p.send, p.placement, p.num_experts);
  return internal::LaunchStatus("PackDispatchKernel");
}

const void* internal::DispatchPackModule() {
  return reinterpret_cast<const void*>(&PackDispatchKernel);
}

}  // namespace moe_ep::kernels
