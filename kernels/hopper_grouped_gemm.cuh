#pragma once

// Hopper (sm_90a) grouped expert GEMMs with device-side per-expert row counts
// (DESIGN §7, §10; issue 14): nothing is read on the host, so the SwiGLU
// expert compute stays graph-capturable, and the tensor cores are driven by
// wgmma fed by the bulk tensor copy engine (TMA).
//
// Rows: expert l (of L local experts) owns rows [offsets[l], offsets[l+1]) of
// A. Two tile shapes, K in steps of 64, picked on the host from the average
// rows per expert max_rows / L (so fixed for a captured bucket):
//   wide (< 192 rows per expert: decode): 128 rows x 256 B-rows (fused: 128
//     gate and the same 128 up rows, i.e. 128 output columns; plain: 256);
//   tall (>= 192: prefill, L <= ~490): up to 320 rows x 128 B-rows (fused:
//     64 output columns; plain: 128); an expert of R rows is cut into
//     ceil(R / 320) equal m-tiles (multiples of 64 rows), so an expert of <= 320 rows
//     reads each weight tile once without relying on CTAs sharing it
//     through L2, and no expert pays a nearly empty second pass.
// The kernels are persistent (one CTA per SM); each CTA reads the L+1
// offsets into shared memory, derives the per-expert m-tile counts and walks
// the tiles (expert, n-tile, m-tile), m-tile fastest, in a static stride.
// CTA: 3 warpgroups; warpgroup 0 is the producer (one thread issues TMA
// loads into a ring of stages guarded by mbarriers: wide 4 x 48 KB, tall
// 4 x 56 KB), warpgroups 1 and 2 each own half of the tile's m64 sub-tiles
// (wide: one each; tall: up to three and two, alternating) and issue m64n128k16 wgmma from
// shared memory, one k-block in flight, fp32 accumulators in registers, and
// write the epilogue straight from registers. An m64 sub-tile whose rows are
// past its expert's end is neither loaded nor multiplied (decode shapes: an
// expert with few rows costs weight bandwidth, not tensor time). No split
// along K: every output element is one fp32 sum in a fixed order, so results
// repeat bit for bit.
//
// Requirements (else kInvalidArgument): K % 8 == 0 (TMA row stride a multiple
// of 16 bytes), a and b 16-byte aligned, L <= kHopperGemmMaxExperts.
// Availability (else kFailedPrecondition): built for sm_90a, the current
// device is compute capability 9.0, and the driver's cuTensorMapEncodeTiled
// was found through cudaGetDriverEntryPointByVersion (no libcuda link, so
// binaries still load where there is no driver).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

inline constexpr int kHopperGemmMaxExperts = 2048;

struct HopperGemmParams {
  const uint16_t* a = nullptr;       // device [max_rows, K] bf16, row-major
  int64_t max_rows = 0;              // rows of a (bound of the tile walk)
  const uint16_t* b = nullptr;       // device [L, b_rows, K] bf16, row-major
  const int32_t* offsets = nullptr;  // device [L+1], non-decreasing, offsets[L] <= max_rows
  int num_local_experts = 0;         // L
  int64_t n = 0;                     // output columns N
  int64_t k = 0;                     // reduction length K
};

// HopperGroupedGemmAvailable()
//
// OK when the Hopper kernels can run on the current device (see above), else
// kFailedPrecondition saying which condition failed. Thread-safe; the driver
// lookup happens once per process.
absl::Status HopperGroupedGemmAvailable();

// LaunchHopperGroupedSwiGlu()
//
// b is gate_up [L, 2N, K] (rows [0, N) gate, [N, 2N) up). For every row i of
// expert l and column j < N:
//   act[i, j] = bf16( silu(g) * u ), g = sum_k a[i,k] * b[l, j, k],
//               u = sum_k a[i,k] * b[l, N + j, k]   (fp32), silu(g) = g/(1+e^-g)
// act: device [max_rows, N] bf16; rows >= offsets[L] are not written.
// Errors: kInvalidArgument (null pointers, sizes < 1, requirements above),
// kFailedPrecondition (not available), kInternal (tensor map, launch).
// Never allocates or synchronises; capturable.
absl::Status LaunchHopperGroupedSwiGlu(const HopperGemmParams& params, uint16_t* act,
                                       cudaStream_t stream);

// LaunchHopperGroupedGemm()
//
// b is [L, N, K]: y[i, j] = sum_k a[i,k] * b[l, j, k] in fp32 for every row i
// of expert l, j < N. y: device [max_rows, N] fp32; rows >= offsets[L] are
// not written. Errors and guarantees as LaunchHopperGroupedSwiGlu.
absl::Status LaunchHopperGroupedGemm(const HopperGemmParams& params, float* y, cudaStream_t stream);

}  // namespace moe_ep::kernels
