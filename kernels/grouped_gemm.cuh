#pragma once

// Host launchers of the grouped expert GEMMs whose per-expert row counts stay
// on the device (DESIGN §7, §10): nothing is read on the host, so the SwiGLU
// expert compute can be captured in a CUDA graph and replayed at any token
// count <= the bucket.
//
// Rows: expert l (of L local experts) owns rows [offsets[l], offsets[l+1]) of
// A (entries grouped by expert, kernels/expert_kernels.cuh). Tiles: BM = 64
// rows x BN = 64 columns; expert l's m-tiles are [tile_offsets[l],
// tile_offsets[l+1]) with tile_offsets[l+1] - tile_offsets[l] =
// ceil(rows_l / 64). The grid is sized on the host for the worst case
// (ceil(max_rows / 64) + L m-tiles, fastest varying, so the blocks that share
// a weight tile run together and hit L2); blocks past tile_offsets[L] exit.
// Block: 128 threads = 4 warps in 2 x 2, each warp 32 x 32 of the tile with
// bf16 WMMA 16x16x16 and fp32 accumulation; K advances by 32 through a
// 3-deep cp.async ring in shared memory (two slices in flight while one is
// multiplied).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

// Rows of one m-tile of the grouped GEMMs.
inline constexpr int kGroupedGemmTileRows = 64;

// LaunchExpertTileOffsets()
//
// One thread: tile_offsets[l] = sum over l' < l of ceil((offsets[l'+1] -
// offsets[l']) / 64), for l in [0, L]. offsets, tile_offsets: device [L+1]
// int32. Errors: kInvalidArgument (null pointers, L < 1), kInternal.
absl::Status LaunchExpertTileOffsets(const int32_t* offsets, int num_local_experts,
                                     int32_t* tile_offsets, cudaStream_t stream);

struct GroupedGemmParams {
  const uint16_t* a = nullptr;            // device [max_rows, K] bf16, row-major
  int64_t max_rows = 0;                   // rows of a (bound for the grid)
  const uint16_t* b = nullptr;            // device [L, b_rows, K] bf16, row-major
  const int32_t* offsets = nullptr;       // device [L+1]
  const int32_t* tile_offsets = nullptr;  // device [L+1] (LaunchExpertTileOffsets)
  int num_local_experts = 0;              // L
  int64_t n = 0;                          // output columns N
  int64_t k = 0;                          // reduction length K
};

// LaunchGroupedSwiGlu()
//
// b is gate_up [L, 2N, K] (rows [0, N) gate, [N, 2N) up). For every row i of
// expert l and column j < N:
//   act[i, j] = bf16( silu(g) * u ), g = sum_k a[i,k] * b[l, j, k],
//               u = sum_k a[i,k] * b[l, N + j, k]   (fp32), silu(g) = g/(1+e^-g)
// act: device [max_rows, N] bf16; rows >= offsets[L] are not written.
// Errors: kInvalidArgument (null pointers, sizes < 1, L < 1, grid too large),
// kInternal (launch). Never allocates or synchronises.
absl::Status LaunchGroupedSwiGlu(const GroupedGemmParams& params, uint16_t* act,
                                 cudaStream_t stream);

// LaunchGroupedGemm()
//
// b is [L, N, K]: y[i, j] = sum_k a[i,k] * b[l, j, k] in fp32 for every row i
// of expert l, j < N. y: device [max_rows, N] fp32; rows >= offsets[L] are
// not written. Errors and guarantees as LaunchGroupedSwiGlu.
absl::Status LaunchGroupedGemm(const GroupedGemmParams& params, float* y, cudaStream_t stream);

}  // namespace moe_ep::kernels
