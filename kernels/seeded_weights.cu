#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/seeded_stream.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/seeded_weights.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int kThreads = 256;
// Blocks per tensor; each thread strides over the tensor's pairs.
constexpr int64_t kMaxBlocksPerTensor = 1024;
// gridDim.y limit: tensors (3 per expert) per launch.
constexpr int kMaxExpertsPerLaunch = 65535 / 3;

// One grid row (blockIdx.y) per tensor: t = 3 * l + p for local expert l and
// projection p (0 gate, 1 up, 2 down). The tensor's n = I * H elements are
// n / 2 pairs (one SplitMix64 output each), spread over the x blocks with a
// grid-stride loop; for odd n, thread 0 of block 0 writes the last element.
// Tensor bases: gate gate_up + 2nl, up gate_up + 2nl + n, down down + nl;
// for even n every base is 4-byte aligned and a pair is one 32-bit store
// (little-endian: element 2c in the low half).
__global__ void SeededSwiGluKernel(uint64_t seed, int layer, int first_expert, int64_t n,
                                   core::SeededUniform in_range, core::SeededUniform down_range,
                                   uint16_t* gate_up, uint16_t* down) {
  const int t = blockIdx.y;
  const int64_t l = t / 3;
  const int p = t % 3;
  uint16_t* out = p == 2 ? down + l * n : gate_up + l * 2 * n + (p == 1 ? n : 0);
  const core::SeededUniform range = p == 2 ? down_range : in_range;
  const uint64_t key = core::SeededTensorKey(seed, layer, first_expert + static_cast<int>(l),
                                             static_cast<core::SeededProjection>(p + 1));
  const int64_t num_pairs = n / 2;
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  if (n % 2 == 0) {
    uint32_t* out32 = reinterpret_cast<uint32_t*>(out);
    for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < num_pairs; c += stride) {
      const core::SeededBf16Pair pair = core::SeededPair(key, c, range);
      out32[c] = uint32_t{pair.first} | (uint32_t{pair.second} << 16);
    }
  } else {
    for (int64_t c = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; c < num_pairs; c += stride) {
      const core::SeededBf16Pair pair = core::SeededPair(key, c, range);
      out[2 * c] = pair.first;
      out[2 * c + 1] = pair.second;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) out[n - 1] = core::SeededElement(key, n - 1, range);
  }
}

}  // namespace

absl::Status LaunchSeededSwiGluWeights(const SeededSwiGluParams& params, cudaStream_t stream) {
  if (params.hidden < 1 || params.intermediate < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchSeededSwiGluWeights: hidden and intermediate expected >= 1, got %d and %d",
        params.hidden, params.intermediate));
  }
  if (params.num_experts < 0 || params.first_expert < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchSeededSwiGluWeights: num_experts and first_expert expected >= 0, got %d and %d",
        params.num_experts, params.first_expert));
  }
  if (params.num_experts == 0) return absl::OkStatus();
  if (params.gate_up == nullptr || params.down == nullptr) {
    return absl::InvalidArgumentError("LaunchSeededSwiGluWeights: null gate_up or down pointer");
  }
  const int64_t n = params.hidden * params.intermediate;
  const int64_t pairs = std::max<int64_t>(1, n / 2);
  const int blocks_x =
      static_cast<int>(std::min(kMaxBlocksPerTensor, (pairs + kThreads - 1) / kThreads));
  const core::SeededUniform in_range = core::SeededUniformFor(params.hidden);
  const core::SeededUniform down_range = core::SeededUniformFor(params.intermediate);
  for (int l0 = 0; l0 < params.num_experts; l0 += kMaxExpertsPerLaunch) {
    const int count = std::min(kMaxExpertsPerLaunch, params.num_experts - l0);
    const dim3 grid(blocks_x, 3 * count);
    SeededSwiGluKernel<<<grid, kThreads, 0, stream>>>(
        params.seed, params.layer, params.first_expert + l0, n, in_range, down_range,
        params.gate_up + int64_t{l0} * 2 * n, params.down + int64_t{l0} * n);
    if (absl::Status st = internal::LaunchStatus("SeededSwiGluKernel"); !st.ok()) return st;
  }
  return absl::OkStatus();
}

const void* internal::SeededWeightsModule() {
  return reinterpret_cast<const void*>(&SeededSwiGluKernel);
}

}  // namespace moe_ep::kernels
