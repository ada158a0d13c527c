#pragma once

// Host launchers of the kernels around the fp8 block-scaled expert GEMMs
// (kernels/fp8_grouped_gemm.cuh; DESIGN §7; issue 35 item 3): the
// activation's quantization per row per 128 channels fused with the gather
// of each expert's rows, the weighted per-row sum of bf16 expert outputs,
// and seeded fp8 weights for benches. Grouping (entries, offsets, positions)
// is kernels/expert_kernels.cuh's.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/expert_kernels.cuh"

namespace moe_ep::kernels {

// LaunchGatherQuantizeExpertRows()
//
// For sorted positions i < offsets[L] (read on the device), the received
// row r = sorted_values[i] / K of `recv` ([rows, 2H + 8K] bf16 hidden |
// ids | weights) is quantized by core::fp8::QuantizeRow's rule (per 128
// channels: scale = amax / 448, codes round-to-nearest-even, saturating):
//   x[i, :] = codes, x_scale[b * x_scale_stride + i] = scale of block b.
// x: device [max_entries, H] e4m3; x_scale: device [H / 128,
// x_scale_stride] fp32 (the A operand layout of kernels/fp8_grouped_gemm.cuh).
// With `scale_input` (Llama-4, issue 35 item 5) the row quantized is
// bf16(w * hidden), w the entry's router weight: the expert computes e(w * x).
// Grid: one block of 256 threads per position (grid-stride), one warp per
// 128-value block; or, with buffers.position set, no `scale_input` and
// max_entries = rows * K, one block per received row that quantizes it once
// and writes the codes to each of its local positions (same bits; the row
// is read once, not K times). Rows i >= offsets[L] are not written.
// Errors (nothing enqueued): kInvalidArgument (null pointers, H not a
// positive multiple of 128, K out of range, x_scale_stride < max_entries,
// x not 4-byte aligned), kInternal (launch). Never allocates or
// synchronises (capturable).
absl::Status LaunchGatherQuantizeExpertRows(const uint8_t* recv, int64_t max_entries,
                                            int64_t hidden, int top_k,
                                            const ExpertEntryBuffers& buffers,
                                            int num_local_experts, uint8_t* x, float* x_scale,
                                            int64_t x_scale_stride, cudaStream_t stream,
                                            bool scale_input = false);

// LaunchWeightedExpertSumBf16()
//
// As LaunchWeightedExpertSum with bf16 expert outputs: for each received row
// r < num_rows with a local entry, out[r, :] = bf16( sum over k ascending
// with position[r*K+k] >= 0 of weights[r, k] * y[position[r*K+k], :] ), fp32
// sum. y: device [entries, H] bf16; out: device [rows, H] bf16. Rows with no
// local entry are not written. `unit_weights`: every weight is 1 (the
// weights scaled the experts' inputs: LaunchGatherQuantizeExpertRows'
// scale_input). Errors: kInvalidArgument (null pointers, H not a positive
// multiple of 4, K out of range), kInternal. Never allocates or synchronises.
absl::Status LaunchWeightedExpertSumBf16(const uint8_t* recv, int64_t num_rows, int64_t hidden,
                                         int top_k, const int32_t* position, const uint16_t* y,
                                         uint16_t* out, cudaStream_t stream,
                                         bool unit_weights = false);

// LaunchQuantizeFp8BlockMatrices()
//
// The fp8 block-scaled form of `num_matrices` bf16 matrices w [num_matrices,
// rows, cols] (row-major), bit for bit core::quant::QuantizeFp8Block of each:
// per 128 x 128 block (partial at the edges) scale_inv = BlockScale(amax)
// and codes QuantizeValue(w, scale_inv). codes: device [num_matrices, rows,
// cols] e4m3; scale_inv: device [num_matrices, ceil(rows/128),
// ceil(cols/128)] fp32. With gate_up [L, 2I, H] as 2L matrices [I, H] this
// is the gate_up / gate_up_scale layout of kernels/expert_compute.h's
// Fp8SwiGluExperts; down [L, H, I] as L matrices [H, I]. Seeded bf16 experts
// (kernels/seeded_weights.cuh) quantized here equal
// core::quant::GenerateFp8SwiGlu's. Grid: one block of 256 threads per
// scale block. Errors (nothing enqueued): kInvalidArgument (null pointers,
// sizes < 1), kInternal (launch). Never allocates or synchronises.
absl::Status LaunchQuantizeFp8BlockMatrices(const uint16_t* w, int64_t num_matrices, int64_t rows,
                                            int64_t cols, uint8_t* codes, float* scale_inv,
                                            cudaStream_t stream);

}  // namespace moe_ep::kernels
