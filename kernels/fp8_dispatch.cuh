#pragma once

// fp8 e4m3 dispatch on the GPU (issue 15 item 4; DESIGN §13 "Low
// precision"): the device half of core/fp8_e4m3.h. The pack kernels
// (kernels/dispatch_pack.cu, kernels/onesided/onesided_kernels.cu) quantize
// with the same per-value functions; this file holds the dequantizing pass
// the expert compute reads through (until the GEMM reads fp8 itself) and
// two small conversion launchers the GPU tests compare bit for bit with the
// host definition.
//
// fp8 wire row (one token), H a multiple of 128, K = top_k:
//   codes [H] e4m3 | scales [H / 128] fp32 | ids [K] int32 | weights [K] fp32
//   = Fp8DispatchRowBytes(H, K) = H + H/32 + 8K bytes (DESIGN §5 sizes).
// Dequantized row (what the expert compute, engines and tests read): the
// bf16 row of kernels/dispatch_pack.cuh, 2H + 8K bytes.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "core/fp8_e4m3.h"

namespace moe_ep::kernels {

// Bytes of one fp8 wire row: H + 4 * H/128 + 8K.
MOE_EP_HOST_DEVICE constexpr int64_t Fp8DispatchRowBytes(int64_t hidden, int top_k) {
  return core::fp8::QuantizedHiddenBytes(hidden) + 8 * int64_t{top_k};
}

// LaunchDequantizeDispatchRows()
//
// rows = `num_rows` fp8 wire rows at `wire` (stride Fp8DispatchRowBytes)
// -> bf16 rows at `out` (stride 2H + 8K): hidden[i] =
// core::fp8::DequantizeValue(codes[i], scales[i / 128]), ids and weights
// copied. Every row is converted, padding included (its ids are the invalid
// id and its weights 0, so its hidden values are never used). Grid: one
// block of 128 threads a row. Errors (nothing enqueued): kInvalidArgument
// for null pointers, num_rows < 0, H not a positive multiple of 128, K < 1,
// `out` not 8-byte or `wire` not 4-byte aligned; kInternal (launch).
// Never allocates or synchronises (graph-capturable).
absl::Status LaunchDequantizeDispatchRows(const uint8_t* wire, int64_t num_rows, int64_t hidden,
                                          int top_k, uint8_t* out, cudaStream_t stream);

// For the GPU tests: codes[i] = core::fp8::E4m3FromFloat(in[i]) on the
// device (CUDA's cvt on sm_89+), and values[i] = E4m3ToFloat(i) for the 256
// codes. Errors: kInvalidArgument (null, n < 0), kInternal (launch).
absl::Status LaunchE4m3FromFloat(const float* in, int64_t n, uint8_t* codes, cudaStream_t stream);
absl::Status LaunchE4m3ToFloatAllCodes(float* values, cudaStream_t stream);

#if defined(__CUDACC__)
namespace internal {

// One warp quantizes one 128-value block: lane l holds values [4l, 4l + 4)
// of the block as 4 bf16 (`v`), and gets back their 4 codes packed little-
// endian; lane 0's `scale` out is the block's scale. The amax is the warp's
// max of |v| (NaN ignored, as core::fp8::QuantizeRow), so the scale and the
// codes equal the host's bit for bit.
__device__ inline uint32_t QuantizeWarpBlock(const uint16_t (&v)[4], float* scale) {
  float amax = 0.0f;
  for (int j = 0; j < 4; ++j) {
    const float a = core::fp8::Bf16Abs(v[j]);
    amax = a > amax ? a : amax;
  }
  for (int offset = 16; offset > 0; offset >>= 1) {
    const float other = __shfl_xor_sync(0xffffffffu, amax, offset);
    amax = other > amax ? other : amax;
  }
  const float s = core::fp8::BlockScale(amax);
  *scale = s;
  uint32_t packed = 0;
  for (int j = 0; j < 4; ++j) {
    packed |= static_cast<uint32_t>(core::fp8::QuantizeValue(v[j], s)) << (8 * j);
  }
  return packed;
}

}  // namespace internal
#endif  // __CUDACC__
}  // namespace moe_ep::kernels
