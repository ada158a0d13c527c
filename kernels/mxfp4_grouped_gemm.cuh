#pragma once

// mxfp4 grouped expert GEMMs with bf16 activations, gpt-oss's experts
// (DESIGN §7 "Weight formats"; issue 35 items 3 and 4): the weights stay in
// the checkpoint's format on the device (blocks [N, K/32, 16] of e2m1
// values, 4 bits each, and one E8M0 scale a block,
// core/quantized_formats.h), the e2m1 codes of each aligned 4-byte word
// rearranged once at upload (Mxfp4BlocksToDeviceOrder: same bytes, same
// words, so the weight-streaming bound is unchanged) so that the kernels
// dequantize 8 values with 11 integer operations and 4 bf16 multiplies. The
// dequantization to bf16 is exact (an e2m1 value times a power of two has
// at most two significant bits); the products run on the tensor cores
// (mma.sync m16n8k16 bf16, fp32 accumulation) and the bias is added once
// after the sum, as core::quant::Mxfp4Gemm does.
//
// Shape: the rows of the weight matrix are the MMA's M side and the tokens
// its N side (8 a tile), so an expert with a handful of rows reads each
// weight once and multiplies it by every row it has: the decode and
// small-prefill regime, where the weights' bytes bound the time. A CTA of 4
// warps owns 64 weight rows of one expert (the GLU: 32 (gate, up) pairs) and
// walks that expert's rows in chunks of 8 * tile_tokens (chunks of 8: while
// more than 8 rows are left, passes of 16, see pair_chunks); a warp walks K in
// steps of 64 (32 contiguous bytes of a row a step, loaded ahead), the K
// order inside a step permuted identically on both operands so every load
// is one aligned vector. Each output is one fixed-order sum: results repeat
// bit for bit.
//
// Device-side per-expert row counts, as kernels/hopper_grouped_gemm.cuh:
// expert l (of L) owns rows [offsets[l], offsets[l+1]) of A; nothing is read
// on the host, so the compute stays graph-capturable.
//
// Requirements (else kInvalidArgument): K % 64 == 0 (H and I of the
// experts; gpt-oss's 2880 is 45 * 64), n >= 1, a 16-byte aligned, sizes
// within int32, tile_tokens 0, 1, 2, 4 or 8, prefetch_steps 0, 3, 4, 5 or 6,
// min_ctas_per_sm 0, 1, 4 or 5.
// Any CUDA device of compute capability 8.0 or later (mma.sync bf16).
// Source: issue 35 item 3; OCP Microscaling Formats v1.0; openai/gpt-oss.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

// K per step of the mxfp4 kernels: H and I of their experts are multiples.
inline constexpr int kMxfp4KStep = 64;

struct Mxfp4GemmParams {
  const uint16_t* a = nullptr;       // device [max_rows, K] bf16, row-major, 16-byte aligned
  int64_t max_rows = 0;              // rows of a
  const uint8_t* blocks = nullptr;   // device [L, b_rows, K / 32, 16] e2m1, device order
  const uint8_t* scales = nullptr;   // device [L, b_rows, K / 32] E8M0
  const uint16_t* bias = nullptr;    // device [L, b_rows] bf16, or null (no bias)
  const int32_t* offsets = nullptr;  // device [L+1], non-decreasing, offsets[L] <= max_rows
  int num_local_experts = 0;         // L
  int64_t n = 0;                     // output columns (see the launchers)
  int64_t k = 0;                     // reduction length K
  // Tokens of a chunk in 8s: 0 picks from the average rows per expert
  // (max_rows / L: 1 up to 8 rows, 2 up to 16, 4 up to 32, else 8); 1, 2, 4
  // or 8 forces one (tests, benches).
  int tile_tokens = 0;
  // Steps of operands in a warp's register ring (loaded up to this many
  // minus one steps ahead): 0 picks (see PickDepth); 3, 4, 5 or 6 forces one
  // (benches).
  int prefetch_steps = 0;
  // Whether chunks of up to 16 tokens carry their activations in the ring
  // too: 0 or 1 yes, -1 no (benches). Larger chunks load them at use.
  int ring_activations = 0;
  // Chunks of up to 16 tokens: the CTAs an SM the kernel's registers are
  // capped for (__launch_bounds__'s minimum; 4 caps them at 128, 5 at 96):
  // 0 or 1 no cap; 4 or 5 forces one (benches).
  int min_ctas_per_sm = 0;
  // Chunks of 8 tokens: whether an expert with more than 8 rows left takes
  // them 16 at a time (one pass over its weights, activations loaded at
  // use): 0 or 1 yes, -1 no (benches).
  int pair_chunks = 0;
};

// LaunchMxfp4GroupedGptOssGlu()
//
// gpt-oss's gate_up projection and clamped SwiGLU, fused: b_rows = 2n (n =
// I), weight row 2j the gate and 2j + 1 the up of feature j (the
// checkpoint's interleaving). For every row i of expert l and j < n:
//   g = sum_k a[i, k] w[2j, k] + bias[2j],  u = likewise with row 2j + 1
//   act[i, j] = bf16(core::quant::GptOssGlu(g, u, alpha, limit))
// act: device [max_rows, n] bf16; rows >= offsets[L] are not written.
// Errors: kInvalidArgument (null pointers, sizes, requirements above),
// kInternal (launch). Never allocates or synchronises; capturable.
absl::Status LaunchMxfp4GroupedGptOssGlu(const Mxfp4GemmParams& params, float alpha, float limit,
                                         uint16_t* act, cudaStream_t stream);

// LaunchMxfp4GroupedGemm()
//
// y[i, j] = sum_k a[i, k] w[j, k] + bias[j] (fp32) for every row i of expert
// l and j < n (b_rows = n): the down projection. y: device [max_rows, n]
// fp32; rows >= offsets[L] are not written. Errors and properties as above.
absl::Status LaunchMxfp4GroupedGemm(const Mxfp4GemmParams& params, float* y, cudaStream_t stream);

// Mxfp4BlocksToDeviceOrder()
//
// Rearranges checkpoint mxfp4 blocks (two e2m1 values a byte, low nibble
// first) in place into the kernels' device order: within each aligned
// 4-byte word (8 values), value 2s and 2s + 1 sit where the kernels'
// pair-s extraction takes them (signs and magnitudes at fixed bits of the
// word's low and high 16-bit halves). `bytes` a multiple of 4 (every row of
// K % 64 == 0 is). Host code; Mxfp4BlocksFromDeviceOrder is its inverse.
void Mxfp4BlocksToDeviceOrder(uint8_t* blocks, int64_t bytes);
void Mxfp4BlocksFromDeviceOrder(uint8_t* blocks, int64_t bytes);

}  // namespace moe_ep::kernels
