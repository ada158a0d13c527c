#pragma once

// fp8 e4m3 dispatch payload: the one quantize / dequantize contract of every
// data plane (DESIGN §5, §13 "Low precision"; issue 15 item 4). The CPU data
// plane (core/ep_dispatcher.cc), the CPU reference (core/moe_reference.h) and
// the CUDA kernels (kernels/dispatch_pack.cu, kernels/fp8_dispatch.cu,
// kernels/onesided/onesided_kernels.cu) all include this header, so a token
// quantized on one plane dequantizes to the same bits on any other.
//
// Format (DeepEP's layout): a hidden row of H values (H a multiple of 128)
// is split into H / 128 blocks; block b has one fp32 scale
//     scale_b = amax_b / 448            (amax_b = max |x| over the block; 1 when 0)
// and each value is stored as the e4m3 code of x / scale_b, rounded to
// nearest, ties to even, finite values beyond the largest e4m3 (448)
// saturating to +-448 (CUDA's __NV_SATFINITE). e4m3 (OCP / NVIDIA): 1 sign,
// 4 exponent (bias 7), 3 mantissa bits; no infinity; S.1111.111 is NaN;
// normals 2^-6 .. 448, subnormals m * 2^-9 for m in 1..7.
// The dequantized row is bf16(e4m3_value * scale_b): the expert compute reads
// bf16 rows on both planes, so the planes agree bit for bit on the expert
// input.
//
// Error bound (what the reference check derives its tolerance from): with
// 3 mantissa bits, a normal value is off by at most half an ulp = 2^-4 of its
// magnitude; a value whose quotient lies in the subnormal range (below 2^-6)
// is off by at most 2^-10 * scale_b = 2^-10 / 448 * amax_b. So
//     |dequant(x) - x| <= 2^-4 * |x| + 2^-10 / 448 * amax_b,
// before the final bf16 rounding (another 2^-9 relative).
//
// NaN inputs give the NaN code 0x7F (sign cleared, as CUDA's conversion does);
// +-Inf saturates to +-448 and makes its block's scale Inf (so the block's
// finite values dequantize to 0 or NaN). Every function is pure and
// thread-safe; __host__ __device__ under nvcc.

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp8.h>
#define MOE_EP_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_HOST_DEVICE
#endif

namespace moe_ep::core::fp8 {

// Values per fp32 scale.
inline constexpr int kBlockSize = 128;
// The largest finite e4m3 value and its code.
inline constexpr float kE4m3Max = 448.0f;
inline constexpr uint8_t kE4m3MaxCode = 0x7E;
// The NaN code this contract writes.
inline constexpr uint8_t kE4m3NaNCode = 0x7F;

MOE_EP_HOST_DEVICE inline uint32_t FloatBits(float x) {
  uint32_t bits;
  memcpy(&bits, &x, sizeof(bits));
  return bits;
}

MOE_EP_HOST_DEVICE inline float BitsToFloat(uint32_t bits) {
  float x;
  memcpy(&x, &bits, sizeof(x));
  return x;
}

// E4m3FromFloatPortable()
//
// The e4m3 code of `x`: round to nearest, ties to even, |x| beyond 448
// (Inf included) saturating to the signed 448 code, NaN -> 0x7F, values of
// magnitude <= 2^-10 -> signed zero. Pure integer and exact float
// arithmetic, independent of the rounding mode and of fast-math flags; the
// host definition of the contract.
// Examples: 448 -> 0x7E, 464 -> 0x7E (tie, even), 1.0 -> 0x38,
// 2^-9 -> 0x01, 1.5 * 2^-10 -> 0x01, 2^-10 -> 0x00, -0.0 -> 0x80.
MOE_EP_HOST_DEVICE inline uint8_t E4m3FromFloatPortable(float x) {
  const uint32_t bits = FloatBits(x);
  const uint8_t sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  const uint32_t abs_bits = bits & 0x7fffffffu;
  if (abs_bits > 0x7f800000u) return kE4m3NaNCode;
  const int exponent = static_cast<int>(abs_bits >> 23) - 127;          // of the float
  if (exponent >= 9) return static_cast<uint8_t>(sign | kE4m3MaxCode);  // >= 512, Inf
  if (exponent < -6) {
    // Subnormal range of e4m3: the value is m * 2^-9. q = |x| * 2^9 < 8 is
    // exact (a power-of-two scaling), and so is its fraction.
    const float q = BitsToFloat(abs_bits) * 512.0f;
    uint32_t m = static_cast<uint32_t>(q);
    const float frac = q - static_cast<float>(m);
    if (frac > 0.5f || (frac == 0.5f && (m & 1u) != 0)) ++m;
    return static_cast<uint8_t>(sign | m);  // m == 8 is 2^-6, the code 0x08
  }
  // Normal: keep the top 3 of the float's 23 mantissa bits, round the rest.
  const uint32_t mantissa = abs_bits & 0x7fffffu;
  uint32_t code = (static_cast<uint32_t>(exponent + 7) << 3) | (mantissa >> 20);
  const uint32_t rest = mantissa & 0xfffffu;
  constexpr uint32_t kHalf = 0x80000u;
  if (rest > kHalf || (rest == kHalf && (code & 1u) != 0)) ++code;  // carries into the exponent
  if (code > kE4m3MaxCode) code = kE4m3MaxCode;                     // 0x7F would be NaN
  return static_cast<uint8_t>(sign | code);
}

// E4m3FromFloat()
//
// E4m3FromFloatPortable(x); on devices of compute capability >= 8.9 through
// CUDA's __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3) (the cvt
// instruction), which tests/kernels/fp8_e4m3_cuda_test.cc checks bit for bit
// against the portable definition.
MOE_EP_HOST_DEVICE inline uint8_t E4m3FromFloat(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  return static_cast<uint8_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3));
#else
  return E4m3FromFloatPortable(x);
#endif
}

// E4m3ToFloat()
//
// The value of an e4m3 code, exact. 0x7F / 0xFF -> NaN.
// Examples: 0x7E -> 448, 0x38 -> 1, 0x01 -> 2^-9, 0x80 -> -0.0.
MOE_EP_HOST_DEVICE inline float E4m3ToFloat(uint8_t code) {
  const uint32_t sign = static_cast<uint32_t>(code & 0x80u) << 24;
  const uint32_t exponent = (code >> 3) & 0xfu;
  const uint32_t mantissa = code & 0x7u;
  if (exponent == 0xfu && mantissa == 0x7u) return BitsToFloat(sign | 0x7fc00000u);
  if (exponent == 0) {
    // m * 2^-9, exact in float.
    const float v = static_cast<float>(mantissa) * (1.0f / 512.0f);
    return sign != 0 ? -v : v;
  }
  return BitsToFloat(sign | ((exponent - 7 + 127) << 23) | (mantissa << 20));
}

// IEEE round-to-nearest division and multiplication, also under nvcc's
// fast-math flags, so that host and device compute the same scales.
MOE_EP_HOST_DEVICE inline float DivRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

MOE_EP_HOST_DEVICE inline float MulRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

// The scale of a block whose largest magnitude is `amax`: amax / 448, or 1
// when amax is 0 (an all-zero block; any scale encodes it as zeros).
MOE_EP_HOST_DEVICE inline float BlockScale(float amax) {
  return amax > 0.0f ? DivRn(amax, kE4m3Max) : 1.0f;
}

// |x| of a bf16 bit pattern, as float (NaN compares false in max, so a NaN
// value does not become the block's amax; it is encoded as NaN).
MOE_EP_HOST_DEVICE inline float Bf16Abs(uint16_t v) {
  return BitsToFloat((static_cast<uint32_t>(v) & 0x7fffu) << 16);
}

MOE_EP_HOST_DEVICE inline float Bf16Value(uint16_t v) {
  return BitsToFloat(static_cast<uint32_t>(v) << 16);
}

// Round-to-nearest-even float -> bf16 (NaN stays a quiet NaN), the same
// rule as core/bf16.h's FloatToBf16 and CUDA's __float2bfloat16_rn.
MOE_EP_HOST_DEVICE inline uint16_t Bf16FromFloat(float f) {
  const uint32_t bits = FloatBits(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);
  const uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>((bits + rounding) >> 16);
}

// The code of one bf16 value `v` in a block of scale `scale`.
MOE_EP_HOST_DEVICE inline uint8_t QuantizeValue(uint16_t v, float scale) {
  return E4m3FromFloat(DivRn(Bf16Value(v), scale));
}

// The dispatched (dequantized) bf16 value of `code` in a block of `scale`.
MOE_EP_HOST_DEVICE inline uint16_t DequantizeValue(uint8_t code, float scale) {
  return Bf16FromFloat(MulRn(E4m3ToFloat(code), scale));
}

// QuantizeRow()
//
// Quantizes one hidden row `in` [hidden] bf16 into `codes` [hidden] and
// `scales` [hidden / 128] as above. REQUIRES: hidden a positive multiple of
// 128. Host and device (one thread; the kernels split the blocks over
// warps with the same per-value functions).
MOE_EP_HOST_DEVICE inline void QuantizeRow(const uint16_t* in, int64_t hidden, uint8_t* codes,
                                           float* scales) {
  for (int64_t b = 0; b < hidden / kBlockSize; ++b) {
    float amax = 0.0f;
    for (int i = 0; i < kBlockSize; ++i) {
      const float a = Bf16Abs(in[b * kBlockSize + i]);
      amax = a > amax ? a : amax;
    }
    const float scale = BlockScale(amax);
    scales[b] = scale;
    for (int i = 0; i < kBlockSize; ++i) {
      codes[b * kBlockSize + i] = QuantizeValue(in[b * kBlockSize + i], scale);
    }
  }
}

// DequantizeRow()
//
// The dispatched row: out[i] = DequantizeValue(codes[i], scales[i / 128]).
// REQUIRES: hidden a positive multiple of 128.
MOE_EP_HOST_DEVICE inline void DequantizeRow(const uint8_t* codes, const float* scales,
                                             int64_t hidden, uint16_t* out) {
  for (int64_t i = 0; i < hidden; ++i) out[i] = DequantizeValue(codes[i], scales[i / kBlockSize]);
}

// Bytes of one token's quantized hidden part: H codes + H / 128 fp32 scales
// (= H + H / 32). REQUIRES: hidden a multiple of 128.
MOE_EP_HOST_DEVICE constexpr int64_t QuantizedHiddenBytes(int64_t hidden) {
  return hidden + 4 * (hidden / kBlockSize);
}

}  // namespace moe_ep::core::fp8
