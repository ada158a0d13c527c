#pragma once

// fp8 e4m3 block-scaled grouped expert GEMMs on Hopper (sm_90a), the
// DeepSeek-V3 format (DESIGN §7 "Weight formats", §10; issue 35 item 3):
// weights e4m3 with one fp32 scale per 128 x 128 block, activations e4m3
// with one fp32 scale per row per 128 K (amax / 448, core/fp8_e4m3.h), and
// for every 128-wide K block an fp32 partial sum of code products promoted
// into the fp32 accumulator with both scales:
//   acc += partial_kb * (s_a[row, kb] * s_w[n / 128, kb]),
//   partial_kb = sum_{k in block kb} q_a[row, k] * q_w[n, k].
// Device-side per-expert row counts, as kernels/hopper_grouped_gemm.cuh:
// expert l (of L) owns rows [offsets[l], offsets[l+1]) of A; nothing is read
// on the host, so the compute stays graph-capturable.
//
// Kernel shape: persistent (one CTA per SM), tiles (expert, n-tile, m-tile)
// walked m-tile fastest in a static stride; a tile is 128 or 256 rows (m64
// sub-tiles dealt to the two consumer warpgroups alternately; a sub-tile
// past its expert's rows is neither loaded nor multiplied; an expert's rows
// are cut into equal m-tiles) times 128 B rows. CTA = 3 warpgroups: one
// thread of warpgroup 0 issues TMA loads (A: up to 2 or 4 boxes of 64 x 128
// bytes, B: two, 128-byte swizzle) into a ring of stages (128 rows: 6 of
// 32 KB, 5 when fused; 256 rows: 4 of 48 KB, 3 when fused), one stage per
// 128-wide K block; warpgroups 1 and 2 each run, per sub-tile, 4 m64n128k32
// e4m3 wgmma into a partial accumulator, wait for it, release the stage
// after the last sub-tile and promote: one FFMA per element with the
// combined scale s_a * s_w (core/quantized_formats.h's reference rounds
// p * s and the sum apart: one rounding of 2^-24 fewer, below the tensor
// cores' own order inside a block). With 128-row tiles a warpgroup issues
// two k-blocks' products before waiting for the first (two partial sums),
// so its first promotion overlaps the second's products; the two consumer
// warpgroups' promotions overlap each other's tensor work.
// No split along K and a fixed order of every sum: results repeat bit for
// bit.
//
// Requirements (else kInvalidArgument): K % 128 == 0, N % 128 == 0,
// tile_rows 0, 128 or 256, the weight and activation codes 16-byte aligned,
// L <= kHopperGemmMaxExperts, sizes within int32. Availability as HopperGroupedGemmAvailable()
// (kFailedPrecondition).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

// Values of K (and of N) per fp32 scale, both operands.
inline constexpr int kFp8ScaleBlock = 128;

struct Fp8GemmParams {
  const uint8_t* a = nullptr;        // device [max_rows, K] e4m3 codes, row-major
  const float* a_scale = nullptr;    // device [K / 128, a_scale_stride]: s_a[kb * stride + row]
  int64_t a_scale_stride = 0;        // >= max_rows
  int64_t max_rows = 0;              // rows of a (bound of the tile walk)
  const uint8_t* b = nullptr;        // device [L, b_rows, K] e4m3 codes (see the launchers)
  const float* b_scale = nullptr;    // device, the launcher's layout
  const int32_t* offsets = nullptr;  // device [L+1], non-decreasing, offsets[L] <= max_rows
  int num_local_experts = 0;         // L
  int64_t n = 0;                     // output columns N
  int64_t k = 0;                     // reduction length K
  // Rows of a tile: 0 picks from the average rows per expert (256 from 192
  // max_rows / L up, else 128); 128 or 256 forces one (tests, benches).
  int tile_rows = 0;
  // 2, either tile height: pairs of adjacent n-tiles in 2-CTA clusters
  // whose CTAs each load half of the shared A boxes and multicast them to
  // both (half the L2 reads of A; N / 128 odd: one CTA a tile); 1 one CTA
  // per tile; 0 picks (1: 128-row pairs measured no faster,
  // bench/results/fp8-speed; 256-row pairs, issue 35: bench/results/fp8-ncu).
  // 3, either tile height: pairs of adjacent m-tiles of one expert and
  // n-tile in 2-CTA clusters sharing B (the weights): an expert's rows are
  // cut into an even number of m-tiles (ceil(rows / tile) rounded up), CTA r
  // of a pair takes m-tile 2j + r, loads its own A boxes and B box r of
  // each stage, multicast to both (half the L2 reads of B, and the pair
  // reads the weights at the same time). Same products, same order: the
  // same bits in every mode.
  int cluster = 0;
  // k-blocks (128 K) by which the producer prefetches each tile's B boxes
  // (the weights) into L2 ahead of its shared-memory loads; -1 the default
  // (0: measured slower with any distance, bench/results/fp8-speed).
  int l2_prefetch = -1;
  // L2 eviction priority of the TMA loads (PTX createpolicy, the
  // .L2::cache_hint copies), so that tiles other CTAs will read again stay
  // in L2 while the weights stream past: 0 none (the loads carry no policy),
  // 1 A evict_last and B evict_normal, 2 A evict_last and B evict_first,
  // 3 A evict_normal and B evict_first. Placement in L2 only: the same bits
  // in every mode.
  int l2_hint = 0;
};

// LaunchFp8GroupedSwiGlu()
//
// Gate/up of the fp8 SwiGLU with the activation's re-quantization fused in
// the epilogue. b is gate_up [L, 2N, K] (rows [0, N) gate, [N, 2N) up),
// b_scale [L, 2, N / 128, K / 128] (gate block scales, then up). For every
// row i of expert l and column j < N (g, u block-promoted as above):
//   h[i, j] = core::quant::SwiGluSilu(g) * u                    (fp32)
// then per 128 columns (block jb = j / 128) core::quant's activation rule
// (Fp8QuantizeActivationRow): act_scale[jb * act_scale_stride + i] =
// BlockScale(max_j |h|), act[i, j] = Fp8QuantizeActivation(h[i, j], scale).
// act: device [max_rows, N] e4m3; act_scale: device [N / 128,
// act_scale_stride] fp32 (act_scale_stride >= max_rows): the layout the
// down GEMM reads as its A. Rows >= offsets[L] are not written.
// Errors: kInvalidArgument (null pointers, sizes, requirements above),
// kFailedPrecondition (not available), kInternal (tensor map, launch).
// Never allocates or synchronises; capturable. Source: issue 35 item 3.
absl::Status LaunchFp8GroupedSwiGlu(const Fp8GemmParams& params, uint8_t* act, float* act_scale,
                                    int64_t act_scale_stride, cudaStream_t stream);

// LaunchFp8GroupedGemm()
//
// b is [L, N, K] with b_scale [L, N / 128, K / 128]:
// y[i, j] = bf16( block-promoted sum over k of a[i, k] * b[l, j, k] ) for
// every row i of expert l, j < N. y: device [max_rows, N] bf16; rows >=
// offsets[L] are not written. Errors and guarantees as
// LaunchFp8GroupedSwiGlu. Source: issue 35 item 3.
absl::Status LaunchFp8GroupedGemm(const Fp8GemmParams& params, uint16_t* y, cudaStream_t stream);

}  // namespace moe_ep::kernels
