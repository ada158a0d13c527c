#include <cuda_bf16.h>

#include <climits>
#include <cub/device/device_radix_sort.cuh>

#include "absl/strings/str_format.h"
#include "core/expert_slots.h"
#include "kernels/expert_kernels.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/route.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxGridBlocks = 65535;

__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

int GridFor(int64_t items, int per_block) {
  const int64_t blocks = (items + per_block - 1) / per_block;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > kMaxGridBlocks ? kMaxGridBlocks : blocks));
}

// Grid-stride over entries e: key = local slot of ids[e / K, e % K] among
// slot_ids [L] (core::LocalSlot), or L.
__global__ void ExpertKeysKernel(const uint8_t* __restrict__ recv, int64_t num_entries,
                                 int64_t row_bytes, int64_t hidden_size, int top_k,
                                 const int32_t* __restrict__ slot_ids, int num_local_experts,
                                 int32_t* keys, int32_t* values) {
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < num_entries;
       e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t r = e / top_k;
    const int k = static_cast<int>(e % top_k);
    const int32_t id = reinterpret_cast<const int32_t*>(recv + r * row_bytes + 2 * hidden_size)[k];
    const int l = core::LocalSlot(slot_ids, num_local_experts, id);
    keys[e] = l >= 0 ? l : num_local_experts;
    values[e] = static_cast<int32_t>(e);
  }
}

// Thread l <= L: offsets[l] = lower_bound(sorted_keys, l). Then grid-stride:
// position[sorted_values[i]] = i for local entries, -1 otherwise.
__global__ void ExpertOffsetsKernel(const int32_t* __restrict__ sorted_keys,
                                    const int32_t* __restrict__ sorted_values, int64_t num_entries,
                                    int num_local_experts, int32_t* offsets, int32_t* position) {
  const int64_t tid = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (tid <= num_local_experts) {
    int64_t lo = 0;
    int64_t hi = num_entries;
    while (lo < hi) {
      const int64_t mid = (lo + hi) / 2;
      if (sorted_keys[mid] < tid)
        lo = mid + 1;
      else
        hi = mid;
    }
    offsets[tid] = static_cast<int32_t>(lo);
  }
  for (int64_t i = tid; i < num_entries; i += int64_t{gridDim.x} * blockDim.x) {
    position[sorted_values[i]] = sorted_keys[i] < num_local_experts ? static_cast<int32_t>(i) : -1;
  }
}

// Block-stride over local entries i < offsets[L]; uint2 = 4 bf16 per thread.
// scale_input: the entry's router weight times each value, rounded to bf16.
__global__ void GatherRowsKernel(const uint8_t* __restrict__ recv, int64_t row_bytes,
                                 int64_t hidden_size, int top_k, bool scale_input,
                                 const int32_t* __restrict__ sorted_values,
                                 const int32_t* __restrict__ num_entries,
                                 uint16_t* __restrict__ x) {
  const int64_t n = *num_entries;
  const int64_t vecs = hidden_size / 4;
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int32_t entry = sorted_values[i];
    const uint8_t* row = recv + entry / top_k * row_bytes;
    const uint2* src = reinterpret_cast<const uint2*>(row);
    uint2* dst = reinterpret_cast<uint2*>(x + i * hidden_size);
    if (!scale_input) {
      for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) dst[v] = src[v];
      continue;
    }
    const float w =
        reinterpret_cast<const float*>(row + 2 * hidden_size + 4 * top_k)[entry % top_k];
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      const uint2 s = src[v];
      dst[v] = make_uint2(PackBf16(w * Bf16Lo(s.x), w * Bf16Hi(s.x)),
                          PackBf16(w * Bf16Lo(s.y), w * Bf16Hi(s.y)));
    }
  }
}

__global__ void SiluMulKernel(const float* __restrict__ gate_up,
                              const int32_t* __restrict__ num_entries, int64_t intermediate,
                              uint16_t* __restrict__ act) {
  const int64_t total = *num_entries * intermediate;
  for (int64_t idx = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    const int64_t i = idx / intermediate;
    const int64_t j = idx % intermediate;
    const float g = gate_up[i * 2 * intermediate + j];
    const float u = gate_up[i * 2 * intermediate + intermediate + j];
    const float v = g / (1.0f + __expf(-g)) * u;
    const __nv_bfloat16 b = __float2bfloat16_rn(v);
    act[idx] = *reinterpret_cast<const uint16_t*>(&b);
  }
}

// Block r = received row r (grid-stride). Shared: the row's K positions and
// weights. Skips rows with no local entry.
__global__ void WeightedExpertSumKernel(const uint8_t* __restrict__ recv, int64_t num_rows,
                                        int64_t row_bytes, int64_t hidden_size, int top_k,
                                        bool unit_weights, const int32_t* __restrict__ position,
                                        const float* __restrict__ y, uint16_t* __restrict__ out) {
  __shared__ int32_t pos[kMaxTopK];
  __shared__ float w[kMaxTopK];
  __shared__ int any_local;
  const int64_t vecs = hidden_size / 4;
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    const uint8_t* row = recv + r * row_bytes;
    if (threadIdx.x == 0) any_local = 0;
    __syncthreads();
    if (threadIdx.x < top_k) {
      pos[threadIdx.x] = position[r * top_k + threadIdx.x];
      w[threadIdx.x] =
          unit_weights
              ? 1.0f
              : reinterpret_cast<const float*>(row + 2 * hidden_size + 4 * top_k)[threadIdx.x];
      if (pos[threadIdx.x] >= 0) any_local = 1;
    }
    __syncthreads();
    if (any_local) {
      uint2* dst = reinterpret_cast<uint2*>(out + r * hidden_size);
      for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (y == nullptr) {
          float ws = 0.f;
          for (int k = 0; k < top_k; ++k) ws += pos[k] >= 0 ? w[k] : 0.f;
          const uint2 x = reinterpret_cast<const uint2*>(row)[v];
          acc[0] = ws * Bf16Lo(x.x);
          acc[1] = ws * Bf16Hi(x.x);
          acc[2] = ws * Bf16Lo(x.y);
          acc[3] = ws * Bf16Hi(x.y);
        } else {
          for (int k = 0; k < top_k; ++k) {
            if (pos[k] < 0) continue;
            const float4 yv = reinterpret_cast<const float4*>(y + pos[k] * hidden_size)[v];
            acc[0] += w[k] * yv.x;
            acc[1] += w[k] * yv.y;
            acc[2] += w[k] * yv.z;
            acc[3] += w[k] * yv.w;
          }
        }
        dst[v] = make_uint2(PackBf16(acc[0], acc[1]), PackBf16(acc[2], acc[3]));
      }
    }
    __syncthreads();  // pos / w / any_local are rewritten for the next row
  }
}

absl::Status CheckCommon(int64_t rows, int64_t hidden_size, int top_k, const char* who) {
  if (rows < 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: rows expected >= 0, got %d", who, rows));
  }
  if (hidden_size < 4 || hidden_size % 4 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: hidden expected a positive multiple of 4, got %d", who, hidden_size));
  }
  if (top_k < 1 || top_k > kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: top_k expected in [1, %d], got %d", who, kMaxTopK, top_k));
  }
  if (rows * top_k > INT_MAX) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: rows * top_k = %d exceeds int32 entry indices", who, rows * top_k));
  }
  return absl::OkStatus();
}

int KeyBits(int num_local_experts) {
  int bits = 1;
  while ((1 << bits) <= num_local_experts) ++bits;
  return bits;
}

}  // namespace

absl::StatusOr<size_t> SortTempBytes(int64_t num_entries, int num_local_experts) {
  if (num_entries < 0 || num_entries > INT_MAX || num_local_experts < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SortTempBytes: num_entries %d (expected in [0, INT_MAX]) or num_local_experts %d "
        "(expected >= 1) out of range",
        num_entries, num_local_experts));
  }
  size_t bytes = 0;
  const cudaError_t err = cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr),
      static_cast<int>(num_entries), 0, KeyBits(num_local_experts));
  absl::Status s = internal::CudaStatus(err, "cub::DeviceRadixSort::SortPairs (size query)");
  if (!s.ok()) return s;
  return bytes;
}

absl::Status LaunchGroupEntriesByExpert(const uint8_t* recv, int64_t num_rows, int64_t hidden_size,
                                        int top_k, const int32_t* slot_ids, int num_local_experts,
                                        const ExpertEntryBuffers& b, cudaStream_t stream) {
  absl::Status s = CheckCommon(num_rows, hidden_size, top_k, "LaunchGroupEntriesByExpert");
  if (!s.ok()) return s;
  if (num_local_experts < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchGroupEntriesByExpert: num_local_experts %d (expected >= 1)", num_local_experts));
  }
  const int64_t n = num_rows * top_k;
  if (b.offsets == nullptr || slot_ids == nullptr ||
      (n > 0 &&
       (recv == nullptr || b.keys == nullptr || b.values == nullptr || b.sorted_keys == nullptr ||
        b.sorted_values == nullptr || b.position == nullptr || b.sort_temp == nullptr))) {
    return absl::InvalidArgumentError("LaunchGroupEntriesByExpert: null device pointer");
  }
  auto need = SortTempBytes(n, num_local_experts);
  if (!need.ok()) return need.status();
  if (b.sort_temp_bytes < *need) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchGroupEntriesByExpert: sort_temp_bytes expected >= %d, got %d", *need,
                        b.sort_temp_bytes));
  }
  const int64_t row_bytes = 2 * hidden_size + 8 * top_k;
  if (n > 0) {
    ExpertKeysKernel<<<GridFor(n, kThreads), kThreads, 0, stream>>>(
        recv, n, row_bytes, hidden_size, top_k, slot_ids, num_local_experts, b.keys, b.values);
    if (absl::Status st = internal::LaunchStatus("ExpertKeysKernel"); !st.ok()) return st;
    size_t temp_bytes = b.sort_temp_bytes;
    if (absl::Status st = internal::CudaStatus(
            cub::DeviceRadixSort::SortPairs(b.sort_temp, temp_bytes, b.keys, b.sorted_keys,
                                            b.values, b.sorted_values, static_cast<int>(n), 0,
                                            KeyBits(num_local_experts), stream),
            "cub::DeviceRadixSort::SortPairs");
        !st.ok()) {
      return st;
    }
  }
  const int64_t threads_needed = n > num_local_experts + 1 ? n : num_local_experts + 1;
  ExpertOffsetsKernel<<<GridFor(threads_needed, kThreads), kThreads, 0, stream>>>(
      b.sorted_keys, b.sorted_values, n, num_local_experts, b.offsets, b.position);
  return internal::LaunchStatus("ExpertOffsetsKernel");
}

absl::Status LaunchGatherExpertRows(const uint8_t* recv, int64_t max_entries, int64_t hidden_size,
                                    int top_k, const ExpertEntryBuffers& b, int num_local_experts,
                                    uint16_t* x, cudaStream_t stream, bool scale_input) {
  absl::Status s = CheckCommon(max_entries, hidden_size, top_k, "LaunchGatherExpertRows");
  if (!s.ok()) return s;
  if (max_entries == 0) return absl::OkStatus();
  if (recv == nullptr || b.sorted_values == nullptr || b.offsets == nullptr || x == nullptr) {
    return absl::InvalidArgumentError("LaunchGatherExpertRows: null device pointer");
  }
  GatherRowsKernel<<<GridFor(max_entries, 1), kThreads, 0, stream>>>(
      recv, 2 * hidden_size + 8 * top_k, hidden_size, top_k, scale_input, b.sorted_values,
      b.offsets + num_local_experts, x);
  return internal::LaunchStatus("GatherRowsKernel");
}

absl::Status LaunchSiluMul(const float* gate_up, const int32_t* num_entries, int64_t max_entries,
                           int64_t intermediate, uint16_t* act, cudaStream_t stream) {
  if (max_entries < 0 || intermediate < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchSiluMul: max_entries %d (expected >= 0), intermediate %d (expected >= 1)",
        max_entries, intermediate));
  }
  if (max_entries == 0) return absl::OkStatus();
  if (gate_up == nullptr || num_entries == nullptr || act == nullptr) {
    return absl::InvalidArgumentError("LaunchSiluMul: null device pointer");
  }
  SiluMulKernel<<<GridFor(max_entries * intermediate, kThreads), kThreads, 0, stream>>>(
      gate_up, num_entries, intermediate, act);
  return internal::LaunchStatus("SiluMulKernel");
}

absl::Status LaunchWeightedExpertSum(const uint8_t* recv, int64_t num_rows, int64_t hidden_size,
                                     int top_k, const int32_t* position, const float* y,
                                     uint16_t* out, cudaStream_t stream, bool unit_weights) {
  absl::Status s = CheckCommon(num_rows, hidden_size, top_k, "LaunchWeightedExpertSum");
  if (!s.ok()) return s;
  if (num_rows == 0) return absl::OkStatus();
  if (recv == nullptr || position == nullptr || out == nullptr) {
    return absl::InvalidArgumentError("LaunchWeightedExpertSum: null device pointer");
  }
  WeightedExpertSumKernel<<<GridFor(num_rows, 1), kThreads, 0, stream>>>(
      recv, num_rows, 2 * hidden_size + 8 * top_k, hidden_size, top_k, unit_weights && y != nullptr,
      position, y, out);
  return internal::LaunchStatus("WeightedExpertSumKernel");
}

const void* internal::ExpertKernelsModule() {
  return reinterpret_cast<const void*>(&ExpertKeysKernel);
}

}  // namespace moe_ep::kernels
