#pragma once

// The CPU reference of quantized expert compute (DESIGN §7; issue 35 item 3),
// the ground truth of the GPU kernels: the fp8 block-scaled GEMM and
// DeepSeek-style SwiGLU expert with activations quantized per token per 128
// channels, and the mxfp4 GEMM with bf16 activations under gpt-oss's expert
// function. The arithmetic is the contract of core/quantized_formats.h, in
// the fixed order written there, so results are deterministic (independent
// of the thread count) and a strict error bound holds against fp64.
//
// fp8 SwiGLU expert, x [rows, H] -> out [rows, H]:
//   x_q      = Fp8QuantizeActivationRow(x)             per token, per 128 of H
//   g, u     = Fp8BlockGemm(x_q, gate), (x_q, up)      fp32 [rows, I]
//   h        = SwiGluSilu(g) * u                       fp32 [rows, I]
//   h_q      = Fp8QuantizeActivationRow(h)             per token, per 128 of I
//   out      = Fp8BlockGemm(h_q, down)                 fp32 [rows, H]
// The intermediate is re-quantized from its fp32 value, as DeepSeek-V3 does
// before its down projection (act_quant on w2's input). DeepSeek's own
// PyTorch model rounds g, u and h to bf16 first; moe-ep does not (each such
// rounding moves a value by at most 2^-9 of itself, below e4m3's 2^-4, and
// skipping it lets the GPU quantize straight from its fp32 epilogue).
//
// gpt-oss mxfp4 expert, x [rows, H] -> out [rows, H]:
//   a        = bf16(x)                                 (bf16 activations)
//   y        = Mxfp4Gemm(a, gate_up) + gate_up_bias    fp32 [rows, 2I]
//   h_j      = GptOssGlu(y[2j], y[2j + 1], alpha, limit)   fp32 [rows, I]
//   out      = Mxfp4Gemm(bf16(h), down) + down_bias    fp32 [rows, H]
// where Mxfp4Gemm(a, w)[m, n] = sum over k ascending of a[m, k] * w[n, k] in
// fp32 (each product exact: bf16 times a 2-bit-significand value), and the
// bias (bf16 -> fp32) is added once after the sum. The down GEMM reads
// bf16(h), as the GPU's bf16 wgmma does.
//
// Every function is pure and thread-safe (they may use all cores through
// core/parallel_for.h for large operands).
// Source: core/quantized_formats.h; DESIGN §7; issue 35.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/quantized_formats.h"
#include "core/quantized_weights.h"

namespace moe_ep::core::quant {

// fp8 activations of `rows` tokens of `cols` channels: codes [rows, cols],
// scales [rows, Fp8ScaleBlocks(cols)].
struct Fp8Activations {
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> codes;
  std::vector<float> scales;
};

// Fp8QuantizeActivations()
//
// Fp8QuantizeActivationRow of each row of x [rows, cols] fp32.
// REQUIRES: x.size() >= rows * cols, rows >= 0, cols >= 1.
Fp8Activations Fp8QuantizeActivations(absl::Span<const float> x, int64_t rows, int64_t cols);

// Fp8BlockGemm()
//
// out [a.rows, w.rows] fp32 (overwritten) = the fp8 block-scaled GEMM of
// core/quantized_formats.h: a.codes x w.codes^T with per-block promotion.
// Errors: kInvalidArgument when a.cols != w.cols or out is too short.
// Error bound (what tests check against the fp64 sum of the dequantized
// operands, exact = sum_k A[m,k] W[n,k] with A = e4m3(q_a) s_a, W =
// e4m3(q_w) scale_inv):
//   |out - exact| <= gamma(128 + nkb + 2) * sum_k |A[m,k] W[n,k]|,
//   gamma(n) = n u / (1 - n u), u = 2^-24, nkb = ceil(K / 128)
// (the partial sum of at most 128 exact products, two roundings of the
// scale product and of p * s, and nkb accumulations).
absl::Status Fp8BlockGemm(const Fp8Activations& a, const Fp8BlockMatrix& w, absl::Span<float> out);

// Mxfp4Gemm()
//
// out [rows, w.rows] fp32 (overwritten) = (sum over k ascending of a[m, k] *
// w[n, k]) + bias[n], with a [rows, w.cols] fp32 (callers pass bf16 values)
// and bias [w.rows] bf16 (empty = none).
// Errors: kInvalidArgument when a, bias or out have the wrong size.
// Error bound against the fp64 sum (the products are exact): |out - exact|
// <= gamma(K + 1) * (sum_k |a w| + |bias|).
absl::Status Mxfp4Gemm(absl::Span<const float> a, int64_t rows, const Mxfp4Matrix& w,
                       absl::Span<const bf16_t> bias, absl::Span<float> out);

// What Fp8SwiGluForward computed on the way (for tests and kernel checks).
struct Fp8SwiGluTrace {
  Fp8Activations x_q;    // [rows, H]
  std::vector<float> g;  // [rows, I]
  std::vector<float> u;  // [rows, I]
  std::vector<float> h;  // [rows, I] silu(g) * u
  Fp8Activations h_q;    // [rows, I]
};

// Fp8SwiGluForward()
//
// out [rows, H] fp32 (overwritten) = the fp8 SwiGLU expert of the header
// comment for x [rows, H] fp32. `trace` (may be null) receives the
// intermediates. Errors: kInvalidArgument for weights that are not gate/up
// [I, H] and down [H, I] (naming the projection), or short spans.
absl::Status Fp8SwiGluForward(const Fp8SwiGluWeights& w, absl::Span<const float> x, int64_t rows,
                              absl::Span<float> out, Fp8SwiGluTrace* trace = nullptr);

// gpt-oss's activation parameters (config swiglu_limit; alpha is fixed in
// the model code).
struct GptOssActivation {
  float alpha = kGptOssAlpha;
  float limit = kGptOssSwiGluLimit;
};

// What GptOssExpertForward computed on the way.
struct GptOssTrace {
  std::vector<float> a;  // [rows, H] bf16(x)
  std::vector<float> y;  // [rows, 2I] gate_up(a) + bias, interleaved
  std::vector<float> h;  // [rows, I] bf16(GptOssGlu(...)) (the down GEMM's input)
};

// GptOssExpertForward()
//
// out [rows, H] fp32 (overwritten) = the gpt-oss expert of the header
// comment. Errors: kInvalidArgument for weights that are not gate_up
// [2I, H] (bias [2I]) and down [H, I] (bias [H]), or short spans.
absl::Status GptOssExpertForward(const GptOssExpertWeights& w, absl::Span<const float> x,
                                 int64_t rows, const GptOssActivation& act, absl::Span<float> out,
                                 GptOssTrace* trace = nullptr);

}  // namespace moe_ep::core::quant
