#pragma once

// The quantized expert-weight formats of the checkpoints moe-ep serves, and
// the scalar arithmetic of their expert compute: ONE contract for the CPU
// reference (core/quantized_expert_compute.h) and the GPU kernels
// (kernels/), which include this header (DESIGN §7 "Weight formats are the
// checkpoint's"; issue 35). Header-only, no CUDA dependency: every function
// is pure, thread-safe and __host__ __device__ under nvcc.
//
// ---- fp8 e4m3, 128 x 128 block-scaled weights (DeepSeek-V3/R1, Kimi-K2,
// MiniMax-M2.5: quantization_config {quant_method "fp8", fmt "e4m3" or
// "float8_e4m3fn", weight_block_size [128, 128], activation_scheme
// "dynamic"}) -----------------------------------------------------------
//   weight      `*.weight`           F8_E4M3 [N, K] row-major (N outputs, K inputs;
//                                    gate/up [I, H], down [H, I]), one byte a weight
//   scale_inv   `*.weight_scale_inv` F32 [ceil(N/128), ceil(K/128)] row-major
//   value       w[n, k] = e4m3(q[n, k]) * scale_inv[n / 128, k / 128]
//               (exact in fp64; e4m3 decoding is fp8::E4m3ToFloat, core/fp8_e4m3.h).
//   A trailing partial block (N or K not a multiple of 128) has its own scale.
//
// ---- fp8 activations (dynamic, per token per 128 channels, as DeepSeek-V3's
// act_quant and DeepGEMM) -------------------------------------------------
//   For one row x[0..K) of fp32 values and block b = channels
//   [128 b, min(128 b + 128, K)):
//     amax_b  = max |x| over the block (NaN entries do not raise it)
//     s_b     = amax_b / 448 (IEEE division, round to nearest); s_b = 1 when amax_b == 0
//     q[k]    = e4m3 code of x[k] / s_b: round to nearest even, saturating at
//               +-448 (fp8::E4m3FromFloat; NaN -> 0x7F)
//   so an all-zero block has scale 1 and codes 0 (every code +0 or -0 by the
//   sign of the zero). The codes dequantize to e4m3(q) * s_b.
//   This is the same rule as the fp8 dispatch payload (fp8::QuantizeRow), for
//   fp32 input and any K (not only multiples of 128).
//
// ---- fp8 block-scaled GEMM (the reference arithmetic) -------------------
//   out[m, n] for activations (q_a [M, K], s_a [M, ceil(K/128)]) and weight
//   (q_w [N, K], scale_inv [ceil(N/128), ceil(K/128)]), all in fp32, each
//   operation rounded to nearest (no fused multiply-add), in this order:
//     acc = 0
//     for kb = 0, 1, ..., ceil(K/128) - 1:                 (ascending)
//       p = 0
//       for k in [128 kb, min(128 kb + 128, K)):           (ascending)
//         p = p + e4m3(q_a[m, k]) * e4m3(q_w[n, k])        (the product is exact)
//       acc = acc + p * (s_a[m, kb] * scale_inv[n / 128, kb])   (Fp8PromoteBlock)
//   The GPU kernel sums each 128-wide block in its own order (wgmma), and
//   promotes per block the same way (DeepGEMM); it matches this up to the
//   rounding of p.
//
// ---- mxfp4 weights (gpt-oss: quantization_config {quant_method "mxfp4"}) --
//   blocks   `*_blocks` U8 [..., N, K/32, 16]: 32 e2m1 values a block, two a
//            byte: element 2j of a block is the LOW nibble of byte j, element
//            2j + 1 the HIGH nibble (gpt-oss's and Hugging Face's decoding)
//   scales   `*_scales` U8 [..., N, K/32]: one E8M0 exponent a block
//   value    w[n, k] = e2m1(nibble) * 2^(scale[n, k/32] - 127)   (Mxfp4Value)
//   e2m1 codes s.e1e0.m: 0..7 -> 0, 0.5, 1, 1.5, 2, 3, 4, 6; bit 3 the sign.
//   E8M0 255 is NaN (OCP MX v1.0); 0 is 2^-127. Finite values are exact in
//   fp32 and in bf16 (at most 2 significant bits), so "dequantized to bf16 in
//   the load path of the GEMM" loses nothing.
//
// ---- gpt-oss's expert function (openai/gpt-oss torch/model.py; Hugging
// Face GptOssExperts) ----------------------------------------------------
//   y  = gate_up(x) + gate_up_bias                 [2I]; gate = y[2j], up = y[2j + 1]
//   h_j = GptOssGlu(gate_j, up_j)                  [I]:
//         gate = min(gate, limit); up = clamp(up, -limit, limit)
//         glu  = gate * sigmoid(alpha * gate);  h = (up + 1) * glu
//         alpha = 1.702, limit = config.swiglu_limit (7.0)
//   out = down(h) + down_bias                      [H]
//   and the router weight scales `out` (w * e(x)).
//
// Source: DESIGN §7; issue 35; DeepSeek-V3 technical report §3.3 (fine-grained
// quantization, fp32 promotion per 128-K block); OCP Microscaling Formats
// v1.0 (E8M0, e2m1); openai/gpt-oss (swiglu, mxfp4 decoding).

#include <cmath>
#include <cstdint>

#include "core/fp8_e4m3.h"

namespace moe_ep::core::quant {

// The storage format of a layer's routed-expert weights (quantization_config).
enum class ExpertWeightFormat {
  kBf16,         // no quantization_config: bf16 (or f16/f32 rounded) tensors
  kFp8Block128,  // fp8 e4m3, one fp32 scale_inv per 128 x 128 block
  kMxfp4,        // mxfp4: e2m1 values, one E8M0 scale per 32 along K
};

// Rows and columns of one fp8 weight scale block; channels of one fp8
// activation scale.
inline constexpr int kFp8Block = 128;
// Values per mxfp4 block (one E8M0 scale) and bytes of its values.
inline constexpr int kMxfp4Block = 32;
inline constexpr int kMxfp4BlockBytes = 16;
// gpt-oss's sigmoid alpha (hard-coded in its model code) and the
// swiglu_limit of the published configs.
inline constexpr float kGptOssAlpha = 1.702f;
inline constexpr float kGptOssSwiGluLimit = 7.0f;

// ceil(n / 128): scale rows / columns of an fp8 block-scaled dimension of n.
MOE_EP_HOST_DEVICE constexpr int64_t Fp8ScaleBlocks(int64_t n) {
  return (n + kFp8Block - 1) / kFp8Block;
}

// IEEE round-to-nearest addition, also under nvcc's fast-math flags and
// never contracted into an FMA with a neighbouring multiply.
MOE_EP_HOST_DEVICE inline float AddRn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// One promotion step of the fp8 block-scaled GEMM (see the header comment):
// acc + partial * (a_scale * w_scale_inv), three roundings, in this order.
MOE_EP_HOST_DEVICE inline float Fp8PromoteBlock(float acc, float partial, float a_scale,
                                                float w_scale_inv) {
  return AddRn(acc, fp8::MulRn(partial, fp8::MulRn(a_scale, w_scale_inv)));
}

// The scale of the fp8 activation block [begin, end) of `x`: amax / 448, or 1
// when every |x| is 0 (fp8::BlockScale). NaN entries are skipped by the max.
MOE_EP_HOST_DEVICE inline float Fp8ActivationScale(const float* x, int64_t begin, int64_t end) {
  float amax = 0.0f;
  for (int64_t k = begin; k < end; ++k) {
    const float a = fabsf(x[k]);
    amax = a > amax ? a : amax;
  }
  return fp8::BlockScale(amax);
}

// The e4m3 code of x in a block of scale `scale`: E4m3FromFloat(x / scale).
MOE_EP_HOST_DEVICE inline uint8_t Fp8QuantizeActivation(float x, float scale) {
  return fp8::E4m3FromFloat(fp8::DivRn(x, scale));
}

// Fp8QuantizeActivationRow()
//
// Quantizes one row x [k] fp32 per 128 channels: codes [k] e4m3, scales
// [ceil(k / 128)] fp32, as the header comment says. One thread; kernels
// split the blocks with the same per-value functions (the max is order-free,
// so any reduction order gives the same scale).
// Example: x = {448, -224, 0 x 126} -> scale 1, codes {0x7E, 0xF6, 0...};
// x = 0 x 128 -> scale 1, codes 0.
MOE_EP_HOST_DEVICE inline void Fp8QuantizeActivationRow(const float* x, int64_t k, uint8_t* codes,
                                                        float* scales) {
  for (int64_t b = 0; b < Fp8ScaleBlocks(k); ++b) {
    const int64_t begin = b * kFp8Block;
    const int64_t end = begin + kFp8Block < k ? begin + kFp8Block : k;
    const float scale = Fp8ActivationScale(x, begin, end);
    scales[b] = scale;
    for (int64_t i = begin; i < end; ++i) codes[i] = Fp8QuantizeActivation(x[i], scale);
  }
}

// The value of an e2m1 code (low 4 bits of `nibble`; the rest ignored).
// Examples: 0x1 -> 0.5, 0x7 -> 6, 0x9 -> -0.5, 0x8 -> -0.0.
MOE_EP_HOST_DEVICE inline float E2m1ToFloat(uint8_t nibble) {
  // Exponent e (bias 1) and mantissa bit m: e == 0 is the subnormal m * 0.5,
  // else 2^(e - 1) * (1 + m / 2).
  const uint32_t e = (nibble >> 1) & 0x3u;
  const uint32_t m = nibble & 0x1u;
  const float v = e == 0
                      ? 0.5f * static_cast<float>(m)
                      : static_cast<float>(1u << (e - 1)) * (1.0f + 0.5f * static_cast<float>(m));
  return (nibble & 0x8u) != 0 ? -v : v;
}

// 2^(e - 127) for an E8M0 byte; 255 -> NaN. Exact (0 -> 2^-127, a float
// subnormal). Examples: 127 -> 1, 128 -> 2, 120 -> 2^-7.
MOE_EP_HOST_DEVICE inline float E8m0ToFloat(uint8_t e) {
  if (e == 255) return fp8::BitsToFloat(0x7fc00000u);
  if (e == 0) return fp8::BitsToFloat(0x00400000u);
  return fp8::BitsToFloat(static_cast<uint32_t>(e) << 23);
}

// The e2m1 code of element `index` (0..31) of one block's 16 bytes.
MOE_EP_HOST_DEVICE inline uint8_t Mxfp4Nibble(const uint8_t* block_bytes, int index) {
  const uint8_t byte = block_bytes[index / 2];
  return (index % 2 == 0) ? static_cast<uint8_t>(byte & 0x0fu) : static_cast<uint8_t>(byte >> 4);
}

// w[n, k] of an mxfp4 matrix of K columns (K a multiple of 32): `blocks`
// [N, K/32, 16], `scales` [N, K/32]. The product is exact unless it
// overflows (6 * 2^127 -> Inf) or the scale is NaN.
MOE_EP_HOST_DEVICE inline float Mxfp4Value(const uint8_t* blocks, const uint8_t* scales,
                                           int64_t k_cols, int64_t n, int64_t k) {
  const int64_t b = n * (k_cols / kMxfp4Block) + k / kMxfp4Block;
  const uint8_t nibble =
      Mxfp4Nibble(blocks + b * kMxfp4BlockBytes, static_cast<int>(k % kMxfp4Block));
  return fp8::MulRn(E2m1ToFloat(nibble), E8m0ToFloat(scales[b]));
}

// The e2m1 code of v (already divided by its block's scale): round to
// nearest, ties to even, |v| > 6 (and Inf) saturating to 6, NaN -> 6 with
// NaN's sign (e2m1 has no NaN); the sign bit follows v's (so -0.1 -> 0x8).
// Grid 0, 0.5, 1, 1.5, 2, 3, 4, 6; ties 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
// 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4.
MOE_EP_HOST_DEVICE inline uint8_t E2m1FromFloat(float v) {
  const uint8_t sign = (fp8::FloatBits(v) & 0x80000000u) != 0 ? 0x8u : 0x0u;
  const float a = fabsf(v);
  uint8_t m;
  if (a <= 0.25f) {
    m = 0;
  } else if (a < 0.75f) {
    m = 1;
  } else if (a <= 1.25f) {
    m = 2;
  } else if (a < 1.75f) {
    m = 3;
  } else if (a <= 2.5f) {
    m = 4;
  } else if (a < 3.5f) {
    m = 5;
  } else if (a <= 5.0f) {
    m = 6;
  } else {
    m = 7;  // > 5, Inf and NaN
  }
  return static_cast<uint8_t>(sign | m);
}

// The E8M0 scale byte of an mxfp4 block whose largest magnitude is `amax`
// (OCP MX v1.0 §6.3): 2^(floor(log2 amax) - 2) (e2m1's largest exponent is
// 2), clamped to the bytes 0..254; 127 (scale 1) when amax is 0 or not
// finite. Example: amax 6 -> floor(log2 6) = 2 -> byte 127 (values up to 6
// are then exact); amax 0.01 -> floor(log2) = -7 -> byte 118.
MOE_EP_HOST_DEVICE inline uint8_t Mxfp4ScaleFor(float amax) {
  const uint32_t bits = fp8::FloatBits(amax) & 0x7fffffffu;
  if (bits == 0 || bits >= 0x7f800000u) return 127;
  int exponent;  // floor(log2(amax))
  if ((bits >> 23) == 0) {
    // Subnormal: 2^-149 * mantissa.
    exponent = -150;
    for (uint32_t m = bits; m != 0; m >>= 1) ++exponent;
  } else {
    exponent = static_cast<int>(bits >> 23) - 127;
  }
  const int byte = exponent - 2 + 127;
  return static_cast<uint8_t>(byte < 0 ? 0 : byte > 254 ? 254 : byte);
}

// SiLU of the bf16 SwiGLU and fp8 SwiGLU experts: v / (1 + exp(-v)), fp32.
MOE_EP_HOST_DEVICE inline float SwiGluSilu(float v) { return v / (1.0f + expf(-v)); }

// GptOssGlu()
//
// gpt-oss's clamped SwiGLU of one (gate, up) pair, fp32:
//   gate = min(gate, limit); up = min(max(up, -limit), limit)
//   s = 1 / (1 + exp(-alpha * gate)); glu = gate * s; return (up + 1) * glu
// (NaN inputs stay NaN). Example: (gate 10, up 10, alpha 1.702, limit 7) ->
// gate 7, up 7, s = 1 / (1 + e^-11.914) -> 8 * 7 * s = 55.99963...
MOE_EP_HOST_DEVICE inline float GptOssGlu(float gate, float up, float alpha, float limit) {
  const float g = gate > limit ? limit : gate;
  const float u = up > limit ? limit : (up < -limit ? -limit : up);
  const float s = 1.0f / (1.0f + expf(-(alpha * g)));
  return (u + 1.0f) * (g * s);
}

}  // namespace moe_ep::core::quant
