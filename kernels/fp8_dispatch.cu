#include "absl/strings/str_format.h"
#include "kernels/fp8_dispatch.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"

namespace moe_ep::kernels {
namespace {

constexpr int kDequantThreads = 128;

// Block b: wire row b -> bf16 row b. Thread t handles groups of 4 values
// (one uint32 of codes -> one uint2 of bf16).
__global__ void DequantizeDispatchRowsKernel(const uint8_t* __restrict__ wire, int64_t hidden,
                                             int top_k, uint8_t* __restrict__ out) {
  const int64_t b = blockIdx.x;
  const int64_t wire_bytes = Fp8DispatchRowBytes(hidden, top_k);
  const int64_t out_bytes = 2 * hidden + 8 * int64_t{top_k};
  const uint8_t* src = wire + b * wire_bytes;
  uint8_t* dst = out + b * out_bytes;
  const float* scales = reinterpret_cast<const float*>(src + hidden);
  for (int64_t g = threadIdx.x; g < hidden / 4; g += blockDim.x) {
    const uint32_t codes = reinterpret_cast<const uint32_t*>(src)[g];
    const float scale = scales[(4 * g) / core::fp8::kBlockSize];
    uint16_t v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = core::fp8::DequantizeValue(static_cast<uint8_t>(codes >> (8 * j)), scale);
    }
    uint2 packed;
    packed.x = static_cast<uint32_t>(v[0]) | (static_cast<uint32_t>(v[1]) << 16);
    packed.y = static_cast<uint32_t>(v[2]) | (static_cast<uint32_t>(v[3]) << 16);
    reinterpret_cast<uint2*>(dst)[g] = packed;
  }
  const int64_t src_tail = core::fp8::QuantizedHiddenBytes(hidden);
  for (int i = threadIdx.x; i < 2 * top_k; i += blockDim.x) {
    reinterpret_cast<uint32_t*>(dst + 2 * hidden)[i] =
        reinterpret_cast<const uint32_t*>(src + src_tail)[i];
  }
}

__global__ void E4m3FromFloatKernel(const float* __restrict__ in, int64_t n,
                                    uint8_t* __restrict__ codes) {
  const int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (i < n) codes[i] = core::fp8::E4m3FromFloat(in[i]);
}

__global__ void E4m3ToFloatKernel(float* values) {
  values[threadIdx.x] = core::fp8::E4m3ToFloat(static_cast<uint8_t>(threadIdx.x));
}

}  // namespace

absl::Status LaunchDequantizeDispatchRows(const uint8_t* wire, int64_t num_rows, int64_t hidden,
                                          int top_k, uint8_t* out, cudaStream_t stream) {
  if (num_rows < 0 || (num_rows > 0 && (wire == nullptr || out == nullptr))) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchDequantizeDispatchRows: %d rows with null pointers", num_rows));
  }
  if (hidden < core::fp8::kBlockSize || hidden % core::fp8::kBlockSize != 0 || top_k < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchDequantizeDispatchRows: hidden expected a positive multiple of 128 and top_k >= 1, "
        "got %d and %d",
        hidden, top_k));
  }
  if (reinterpret_cast<uintptr_t>(out) % 8 != 0 || reinterpret_cast<uintptr_t>(wire) % 4 != 0) {
    return absl::InvalidArgumentError(
        "LaunchDequantizeDispatchRows: out must be 8-byte and wire 4-byte aligned");
  }
  if (num_rows == 0) return absl::OkStatus();
  DequantizeDispatchRowsKernel<<<static_cast<unsigned>(num_rows), kDequantThreads, 0, stream>>>(
      wire, hidden, top_k, out);
  return internal::LaunchStatus("DequantizeDispatchRowsKernel");
}

absl::Status LaunchE4m3FromFloat(const float* in, int64_t n, uint8_t* codes, cudaStream_t stream) {
  if (n < 0 || (n > 0 && (in == nullptr || codes == nullptr))) {
    return absl::InvalidArgumentError("LaunchE4m3FromFloat: null pointers or n < 0");
  }
  if (n == 0) return absl::OkStatus();
  constexpr int kThreads = 256;
  E4m3FromFloatKernel<<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0,
                        stream>>>(in, n, codes);
  return internal::LaunchStatus("E4m3FromFloatKernel");
}

absl::Status LaunchE4m3ToFloatAllCodes(float* values, cudaStream_t stream) {
  if (values == nullptr) return absl::InvalidArgumentError("LaunchE4m3ToFloatAllCodes: null");
  E4m3ToFloatKernel<<<1, 256, 0, stream>>>(values);
  return internal::LaunchStatus("E4m3ToFloatKernel");
}

const void* internal::Fp8DispatchModule() {
  return reinterpret_cast<const void*>(&DequantizeDispatchRowsKernel);
}

}  // namespace moe_ep::kernels
