#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/hopper_grouped_gemm.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/hopper_ptx.cuh"
#include "kernels/internal/kernel_modules.h"
#include "kernels/internal/tensor_map.h"

namespace moe_ep::kernels {
namespace {

// Decode shape: 128-row tiles (each consumer warpgroup one m64 sub-tile)
// times 256 B rows (fused: 128 gate + 128 up). Experts with few rows keep
// every SM streaming weights.
namespace wide {
constexpr int kBM = 128;                        // tile rows: 2 consumer warpgroups x 64
constexpr int kWgRows = 64;                     // rows of one consumer warpgroup
constexpr int kBK = 64;                         // K per stage: one 128-byte swizzle row
constexpr int kBSub = 128;                      // rows of each of the two B sub-tiles
constexpr int kStages = 4;                      // TMA ring depth
constexpr int kThreads = 384;                   // producer + 2 consumer warpgroups
constexpr int kATileBytes = kWgRows * kBK * 2;  // 8 KB
constexpr int kBTileBytes = kBSub * kBK * 2;    // 16 KB
constexpr int kStageBytes = 2 * kATileBytes + 2 * kBTileBytes;  // 48 KB
constexpr int kRingBytes = kStages * kStageBytes;
constexpr int kBarrierBytes = 2 * kStages * 8;

// Dynamic shared memory: 1024 (alignment slack) + ring + barriers + the
// offsets and m-tile prefix, (L+1) int32 each.
int SmemBytes(int num_local_experts) {
  return 1024 + kRingBytes + kBarrierBytes + 2 * (num_local_experts + 1) * 4;
}

struct Tile {
  int expert;
  int32_t m_start;  // first row of the tile
  int32_t m_end;    // end of the expert's rows
  int32_t n0;       // first output column
};

// Tile t of the walk: expert-major, then n-tile, then m-tile (fastest).
__device__ __forceinline__ Tile DecodeTile(int t, const int32_t* s_off, const int32_t* s_mt,
                                           int num_local_experts, int n_tiles, int n_step) {
  int lo = 0;
  int hi = num_local_experts - 1;
  while (lo < hi) {  // last l with s_mt[l] * n_tiles <= t
    const int mid = (lo + hi + 1) / 2;
    if (s_mt[mid] * n_tiles <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int local = t - s_mt[lo] * n_tiles;
  const int m_tiles = s_mt[lo + 1] - s_mt[lo];
  Tile tile;
  tile.expert = lo;
  tile.m_start = s_off[lo] + (local % m_tiles) * kBM;
  tile.m_end = s_off[lo + 1];
  tile.n0 = (local / m_tiles) * n_step;
  return tile;
}

__device__ __forceinline__ uint16_t Bf16Bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// kFused: b is [L, 2N, K]; sub-tile 0 holds gate rows n0.., sub-tile 1 the
// up rows N + n0..; the epilogue writes bf16 silu(gate) * up for columns
// [n0, n0 + 128). Else b is [L, N, K]; sub-tiles hold rows n0.. and
// n0 + 128..; the epilogue writes fp32 columns [n0, n0 + 256).
template <bool kFused>
__global__ void __launch_bounds__(kThreads, 1)
    HopperGroupedGemmKernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b,
                            const int32_t* __restrict__ offsets, int num_local_experts, int n,
                            int k, uint16_t* __restrict__ act, float* __restrict__ y) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace internal;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kRingBytes);
  uint64_t* empty = full + kStages;
  int32_t* s_off = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* s_mt = s_off + num_local_experts + 1;
  const int tid = threadIdx.x;
  const int num_l = num_local_experts;
  for (int i = tid; i <= num_l; i += kThreads) s_off[i] = offsets[i];
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(SmemAddr(&full[s]), 1);
      MbarInit(SmemAddr(&empty[s]), 2);  // one thread of each consumer warpgroup
    }
    FenceBarrierInit();
  }
  __syncthreads();
  if (tid < 32) {  // m-tile prefix: each lane a run of experts, then a warp scan
    const int per = (num_l + 31) / 32;
    const int lo = min(num_l, tid * per);
    const int hi = min(num_l, lo + per);
    int sum = 0;
    for (int l = lo; l < hi; ++l) sum += (s_off[l + 1] - s_off[l] + kBM - 1) / kBM;
    int incl = sum;
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (tid >= d) incl += v;
    }
    int run = incl - sum;
    for (int l = lo; l < hi; ++l) {
      s_mt[l] = run;
      run += (s_off[l + 1] - s_off[l] + kBM - 1) / kBM;
    }
    if (tid == 31) s_mt[num_l] = incl;
  }
  __syncthreads();

  constexpr int n_step = kFused ? kBSub : 2 * kBSub;
  const int n_tiles = (n + n_step - 1) / n_step;
  const int num_tiles = s_mt[num_l] * n_tiles;
  const int k_blocks = (k + kBK - 1) / kBK;
  const int b_rows = kFused ? 2 * n : n;  // rows of one expert's b
  const int b1_shift = kFused ? n : kBSub;
  const int wg = tid / 128;

  if (wg == 0) {
    SetMaxRegsDec<40>();
    if (tid != 0) return;
    int it = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tile = DecodeTile(t, s_off, s_mt, num_l, n_tiles, n_step);
      const bool two = tile.m_start + kWgRows < tile.m_end;
      const uint32_t bytes = (two ? 2 : 1) * kATileBytes + 2 * kBTileBytes;
      const int32_t b0 = tile.expert * b_rows + tile.n0;
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        MbarWait(SmemAddr(&empty[s]), ((it / kStages) & 1) ^ 1);
        const uint32_t bar = SmemAddr(&full[s]);
        MbarArriveExpectTx(bar, bytes);
        uint8_t* st = ring + s * kStageBytes;
        const int32_t kc = kb * kBK;
        TmaLoad2d(SmemAddr(st), &map_a, kc, tile.m_start, bar);
        if (two) TmaLoad2d(SmemAddr(st + kATileBytes), &map_a, kc, tile.m_start + kWgRows, bar);
        TmaLoad2d(SmemAddr(st + 2 * kATileBytes), &map_b, kc, b0, bar);
        TmaLoad2d(SmemAddr(st + 2 * kATileBytes + kBTileBytes), &map_b, kc, b0 + b1_shift, bar);
      }
    }
    return;
  }

  SetMaxRegsInc<232>();
  const int cw = wg - 1;     // consumer warpgroup: rows [64 cw, 64 cw + 64) of the tile
  const int lt = tid % 128;  // thread in the warpgroup
  const int warp_row = (lt / 32) * 16 + (lt % 32) / 4;  // accumulator row of d[0]
  const int lane_col = (lt % 4) * 2;                    // accumulator column of d[0]
  int it = 0;
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Tile tile = DecodeTile(t, s_off, s_mt, num_l, n_tiles, n_step);
    const int32_t row0 = tile.m_start + cw * kWgRows;
    const bool active = row0 < tile.m_end;
    float acc0[64];
    float acc1[64];
    if (!active) {  // rows past the expert: keep the ring's phases, no products
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        MbarWait(SmemAddr(&full[s]), (it / kStages) & 1);
        MbarArriveIf(SmemAddr(&empty[s]), lt == 0);
      }
      continue;
    }
    for (int kb = 0; kb < k_blocks; ++kb, ++it) {
      const int s = it % kStages;
      MbarWait(SmemAddr(&full[s]), (it / kStages) & 1);
      const uint8_t* st = ring + s * kStageBytes;
      const uint32_t a_addr = SmemAddr(st + cw * kATileBytes);
      const uint32_t b0_addr = SmemAddr(st + 2 * kATileBytes);
      const uint32_t b1_addr = b0_addr + kBTileBytes;
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t da = SwizzledKMajorDesc(a_addr + kk * 32);
        const int scale = (kb > 0 || kk > 0) ? 1 : 0;
        Wgmma128(acc0, da, SwizzledKMajorDesc(b0_addr + kk * 32), scale);
        Wgmma128(acc1, da, SwizzledKMajorDesc(b1_addr + kk * 32), scale);
      }
      WgmmaCommit();
      // One k-block stays in flight: k-block kb - 1 has been read, release it.
      WgmmaWait<1>();
      MbarArriveIf(SmemAddr(&empty[(it + kStages - 1) % kStages]), kb > 0 && lt == 0);
    }
    WgmmaWait<0>();
    MbarArriveIf(SmemAddr(&empty[(it + kStages - 1) % kStages]), lt == 0);

    // Epilogue: d[4c + 2h + e] is row warp_row + 8h, column 8c + lane_col + e.
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = row0 + warp_row + 8 * h;
      if (row >= tile.m_end) continue;
      if constexpr (kFused) {
        uint16_t* out = act + row * n;
#pragma unroll
        for (int c = 0; c < 16; ++c) {
          const int col = tile.n0 + 8 * c + lane_col;
          const float g0 = acc0[4 * c + 2 * h];
          const float g1 = acc0[4 * c + 2 * h + 1];
          const float u0 = acc1[4 * c + 2 * h];
          const float u1 = acc1[4 * c + 2 * h + 1];
          const uint16_t v0 = Bf16Bits(g0 / (1.0f + __expf(-g0)) * u0);
          const uint16_t v1 = Bf16Bits(g1 / (1.0f + __expf(-g1)) * u1);
          if (col + 1 < n && (n % 2) == 0) {
            *reinterpret_cast<uint32_t*>(out + col) = v0 | (uint32_t{v1} << 16);
          } else {
            if (col < n) out[col] = v0;
            if (col + 1 < n) out[col + 1] = v1;
          }
        }
      } else {
        float* out = y + row * n;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
#pragma unroll
          for (int c = 0; c < 16; ++c) {
            const int col = tile.n0 + half * kBSub + 8 * c + lane_col;
            const float v0 = half == 0 ? acc0[4 * c + 2 * h] : acc1[4 * c + 2 * h];
            const float v1 = half == 0 ? acc0[4 * c + 2 * h + 1] : acc1[4 * c + 2 * h + 1];
            if (col + 1 < n && (n % 2) == 0) {
              *reinterpret_cast<float2*>(out + col) = make_float2(v0, v1);
            } else {
              if (col < n) out[col] = v0;
              if (col + 1 < n) out[col + 1] = v1;
            }
          }
        }
      }
    }
  }
#else
  __trap();  // not built for sm_90a: HopperGroupedGemmAvailable() refuses the launch
#endif
}

}  // namespace wide

// Prefill shape: up to 320-row tiles (five m64 sub-tiles, dealt to the two
// consumer warpgroups alternately: 0, 2, 4 and 1, 3) times 128 B rows
// (fused: 64 gate + 64 up), fed by a 4-deep ring of 56 KB stages. An expert
// of R rows is cut into ceil(R / 320) m-tiles of equal size (rounded up to
// 64 rows), so an expert of <= 320 rows reads each weight tile once and an
// expert just past a tile boundary does not pay a second, nearly empty pass
// over its weights (run 9's 256-row tiles: experts of 257-320 rows read
// their weights twice). Run 11: 384-row tiles with a 3-deep ring of 64 KB
// ran 6.93 ms at 4096 tokens, these 5.95 ms: the ring's depth, not the
// bytes moved, bounded the k-loop.
namespace tall {
constexpr int kBM = 320;                                // most rows of a tile (5 x m64)
constexpr int kSubRows = 64;                            // rows of one m64 sub-tile
constexpr int kMaxSubs = 3;                             // sub-tiles of one consumer warpgroup
constexpr int kBox = 64;                                // rows of one TMA box (A and B)
constexpr int kBK = 64;                                 // K per stage: one 128-byte swizzle row
constexpr int kBN = 128;                                // B rows of a tile (two 64-row boxes)
constexpr int kStages = 4;                              // TMA ring depth
constexpr int kThreads = 384;                           // producer + 2 consumer warpgroups
constexpr int kBoxBytes = kBox * kBK * 2;               // 8 KB
constexpr int kABoxes = kBM / kBox;                     // 5
constexpr int kStageBytes = (kABoxes + 2) * kBoxBytes;  // 56 KB: A boxes, then B
constexpr int kRingBytes = kStages * kStageBytes;
constexpr int kBarrierBytes = 2 * kStages * 8;

// Dynamic shared memory: 1024 (alignment slack) + ring + barriers + the
// m-tile prefix, (L+1) int32 (the offsets are read from global memory, so
// that the 4-deep ring leaves room for L up to ~490 in 227 KB).
int SmemBytes(int num_local_experts) {
  return 1024 + kRingBytes + kBarrierBytes + (num_local_experts + 1) * 4;
}

struct Tile {
  int expert;
  int32_t m_start;  // first row of the tile
  int32_t m_end;    // end of the tile's rows (<= the expert's end)
  int32_t n0;       // first output column
};

// m-tiles of an expert with `rows` rows.
__device__ __forceinline__ int MTiles(int rows) { return (rows + kBM - 1) / kBM; }

// Tile t of the walk: expert-major, then n-tile, then m-tile (fastest). The
// expert's m-tiles are equal runs of a multiple of 64 rows, the last clipped.
// off: the offsets in global memory.
__device__ __forceinline__ Tile DecodeTile(int t, const int32_t* __restrict__ off,
                                           const int32_t* s_mt, int num_local_experts, int n_tiles,
                                           int n_step) {
  int lo = 0;
  int hi = num_local_experts - 1;
  while (lo < hi) {  // last l with s_mt[l] * n_tiles <= t
    const int mid = (lo + hi + 1) / 2;
    if (s_mt[mid] * n_tiles <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  const int local = t - s_mt[lo] * n_tiles;
  const int m_tiles = s_mt[lo + 1] - s_mt[lo];
  const int32_t e0 = __ldg(off + lo);
  const int32_t e1 = __ldg(off + lo + 1);
  const int rows = e1 - e0;
  const int step = ((rows + m_tiles - 1) / m_tiles + kSubRows - 1) / kSubRows * kSubRows;
  Tile tile;
  tile.expert = lo;
  tile.m_start = e0 + (local % m_tiles) * step;
  tile.m_end = min(e1, tile.m_start + step);
  tile.n0 = (local / m_tiles) * n_step;
  return tile;
}

__device__ __forceinline__ uint16_t Bf16Bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// One consumer warpgroup's k-loop over a tile: kSubs m64 sub-tiles (A boxes
// at a_off, a_off + 16 KB, a_off + 32 KB of each stage) times the stage's
// 128 B rows, one k-block in flight; kSubs == 0 only keeps the ring's phases.
// `it` counts the ring's iterations across tiles.
template <int kSubs>
__device__ __forceinline__ void ConsumeTile(float (&acc0)[64], float (&acc1)[64], float (&acc2)[64],
                                            uint8_t* ring, uint64_t* full, uint64_t* empty,
                                            uint32_t a_off, int k_blocks, int lt, int& it) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace internal;
  for (int kb = 0; kb < k_blocks; ++kb, ++it) {
    const int s = it % kStages;
    MbarWait(SmemAddr(&full[s]), (it / kStages) & 1);
    if constexpr (kSubs == 0) {
      MbarArriveIf(SmemAddr(&empty[s]), lt == 0);
    } else {
      const uint8_t* st = ring + s * kStageBytes;
      const uint32_t a_addr = SmemAddr(st + a_off);
      const uint32_t b_addr = SmemAddr(st + kABoxes * kBoxBytes);
      WgmmaFence();
#pragma unroll
      for (int kk = 0; kk < kBK / 16; ++kk) {
        const uint64_t db = SwizzledKMajorDesc(b_addr + kk * 32);
        const int scale = (kb > 0 || kk > 0) ? 1 : 0;
        Wgmma128(acc0, SwizzledKMajorDesc(a_addr + kk * 32), db, scale);
        if constexpr (kSubs >= 2) {
          Wgmma128(acc1, SwizzledKMajorDesc(a_addr + 2 * kBoxBytes + kk * 32), db, scale);
        }
        if constexpr (kSubs >= 3) {
          Wgmma128(acc2, SwizzledKMajorDesc(a_addr + 4 * kBoxBytes + kk * 32), db, scale);
        }
      }
      WgmmaCommit();
      // One k-block stays in flight: k-block kb - 1 has been read, release it.
      WgmmaWait<1>();
      MbarArriveIf(SmemAddr(&empty[(it + kStages - 1) % kStages]), kb > 0 && lt == 0);
    }
  }
  if constexpr (kSubs > 0) {
    WgmmaWait<0>();
    MbarArriveIf(SmemAddr(&empty[(it + kStages - 1) % kStages]), lt == 0);
  }
#endif
}

// Writes one m64 sub-tile whose first row is `row0` (rows past the tile's
// end skipped). Fused: act[row, n0 + j] = bf16(silu(d[j]) * d[64 + j]) for
// j < 64; else y[row, n0 + j] = d[j] for j < 128. Columns >= n skipped.
template <bool kFused>
__device__ __forceinline__ void StoreSubTile(const float (&acc)[64], int32_t row0, const Tile& tile,
                                             int warp_row, int lane_col, int n, uint16_t* act,
                                             float* y) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int64_t row = row0 + warp_row + 8 * h;
    if (row >= tile.m_end) continue;
#pragma unroll
    for (int c = 0; c < (kFused ? 8 : 16); ++c) {
      const int col = tile.n0 + 8 * c + lane_col;
      if constexpr (kFused) {
        const float g0 = acc[4 * c + 2 * h];
        const float g1 = acc[4 * c + 2 * h + 1];
        const float u0 = acc[4 * (c + 8) + 2 * h];
        const float u1 = acc[4 * (c + 8) + 2 * h + 1];
        const uint16_t v0 = Bf16Bits(g0 / (1.0f + __expf(-g0)) * u0);
        const uint16_t v1 = Bf16Bits(g1 / (1.0f + __expf(-g1)) * u1);
        uint16_t* out = act + row * n;
        if (col + 1 < n && (n % 2) == 0) {
          *reinterpret_cast<uint32_t*>(out + col) = v0 | (uint32_t{v1} << 16);
        } else {
          if (col < n) out[col] = v0;
          if (col + 1 < n) out[col + 1] = v1;
        }
      } else {
        const float v0 = acc[4 * c + 2 * h];
        const float v1 = acc[4 * c + 2 * h + 1];
        float* out = y + row * n;
        if (col + 1 < n && (n % 2) == 0) {
          *reinterpret_cast<float2*>(out + col) = make_float2(v0, v1);
        } else {
          if (col < n) out[col] = v0;
          if (col + 1 < n) out[col + 1] = v1;
        }
      }
    }
  }
}

// kFused: b is [L, 2N, K]; the stage's B boxes hold gate rows n0.. and up
// rows N + n0.. (64 each); the epilogue writes bf16 silu(gate) * up for
// columns [n0, n0 + 64). Else b is [L, N, K]; the boxes hold rows n0.. and
// n0 + 64..; the epilogue writes fp32 columns [n0, n0 + 128).
template <bool kFused>
__global__ void __launch_bounds__(kThreads, 1)
    HopperGroupedGemmKernel(const __grid_constant__ CUtensorMap map_a,
                            const __grid_constant__ CUtensorMap map_b,
                            const int32_t* __restrict__ offsets, int num_local_experts, int n,
                            int k, uint16_t* __restrict__ act, float* __restrict__ y) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace internal;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + kRingBytes);
  uint64_t* empty = full + kStages;
  int32_t* s_mt = reinterpret_cast<int32_t*>(empty + kStages);
  const int tid = threadIdx.x;
  const int num_l = num_local_experts;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(SmemAddr(&full[s]), 1);
      MbarInit(SmemAddr(&empty[s]), 2);  // one thread of each consumer warpgroup
    }
    FenceBarrierInit();
  }
  __syncthreads();
  if (tid < 32) {  // m-tile prefix: each lane a run of experts, then a warp scan
    const int per = (num_l + 31) / 32;
    const int lo = min(num_l, tid * per);
    const int hi = min(num_l, lo + per);
    int sum = 0;
    for (int l = lo; l < hi; ++l) sum += MTiles(__ldg(offsets + l + 1) - __ldg(offsets + l));
    int incl = sum;
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (tid >= d) incl += v;
    }
    int run = incl - sum;
    for (int l = lo; l < hi; ++l) {
      s_mt[l] = run;
      run += MTiles(__ldg(offsets + l + 1) - __ldg(offsets + l));
    }
    if (tid == 31) s_mt[num_l] = incl;
  }
  __syncthreads();

  constexpr int n_step = kFused ? kBN / 2 : kBN;
  const int n_tiles = (n + n_step - 1) / n_step;
  const int num_tiles = s_mt[num_l] * n_tiles;
  const int k_blocks = (k + kBK - 1) / kBK;
  const int b_rows = kFused ? 2 * n : n;  // rows of one expert's b
  const int b1_shift = kFused ? n : kBox;
  const int wg = tid / 128;

  if (wg == 0) {
    SetMaxRegsDec<40>();
    if (tid != 0) return;
    int it = 0;
    for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
      const Tile tile = DecodeTile(t, offsets, s_mt, num_l, n_tiles, n_step);
      const int boxes = (tile.m_end - tile.m_start + kBox - 1) / kBox;  // <= kABoxes
      const uint32_t bytes = (boxes + 2) * kBoxBytes;
      const int32_t b0 = tile.expert * b_rows + tile.n0;
      for (int kb = 0; kb < k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        MbarWait(SmemAddr(&empty[s]), ((it / kStages) & 1) ^ 1);
        const uint32_t bar = SmemAddr(&full[s]);
        MbarArriveExpectTx(bar, bytes);
        uint8_t* st = ring + s * kStageBytes;
        const int32_t kc = kb * kBK;
        for (int j = 0; j < boxes; ++j) {
          TmaLoad2d(SmemAddr(st + j * kBoxBytes), &map_a, kc, tile.m_start + j * kBox, bar);
        }
        TmaLoad2d(SmemAddr(st + kABoxes * kBoxBytes), &map_b, kc, b0, bar);
        TmaLoad2d(SmemAddr(st + (kABoxes + 1) * kBoxBytes), &map_b, kc, b0 + b1_shift, bar);
      }
    }
    return;
  }

  SetMaxRegsInc<232>();
  const int cw = wg - 1;     // consumer warpgroup: sub-tiles cw, cw + 2, cw + 4 of the tile
  const int lt = tid % 128;  // thread in the warpgroup
  const int warp_row = (lt / 32) * 16 + (lt % 32) / 4;  // accumulator row of d[0]
  const int lane_col = (lt % 4) * 2;                    // accumulator column of d[0]
  int it = 0;
  for (int t = blockIdx.x; t < num_tiles; t += gridDim.x) {
    const Tile tile = DecodeTile(t, offsets, s_mt, num_l, n_tiles, n_step);
    const int32_t row0 = tile.m_start + cw * kSubRows;
    // This warpgroup's sub-tiles with rows of the tile: 0 to 3.
    const int tile_subs = (tile.m_end - tile.m_start + kSubRows - 1) / kSubRows;
    const int subs = min(kMaxSubs, (tile_subs - cw + 1) / 2);
    float acc0[64];
    float acc1[64];
    float acc2[64];
    const uint32_t a_off = cw * kBoxBytes;
    if (subs == 3) {
      ConsumeTile<3>(acc0, acc1, acc2, ring, full, empty, a_off, k_blocks, lt, it);
    } else if (subs == 2) {
      ConsumeTile<2>(acc0, acc1, acc2, ring, full, empty, a_off, k_blocks, lt, it);
    } else if (subs == 1) {
      ConsumeTile<1>(acc0, acc1, acc2, ring, full, empty, a_off, k_blocks, lt, it);
    } else {
      ConsumeTile<0>(acc0, acc1, acc2, ring, full, empty, a_off, k_blocks, lt, it);
      continue;
    }
    // Epilogue: d[4c + 2h + e] is row warp_row + 8h, column 8c + lane_col + e
    // of the sub-tile; fused: columns [0, 64) gate, [64, 128) up.
    StoreSubTile<kFused>(acc0, row0, tile, warp_row, lane_col, n, act, y);
    if (subs >= 2) {
      StoreSubTile<kFused>(acc1, row0 + 2 * kSubRows, tile, warp_row, lane_col, n, act, y);
    }
    if (subs >= 3) {
      StoreSubTile<kFused>(acc2, row0 + 4 * kSubRows, tile, warp_row, lane_col, n, act, y);
    }
  }
#else
  __trap();  // not built for sm_90a: HopperGroupedGemmAvailable() refuses the launch
#endif
}

}  // namespace tall

// Row-major bf16 [rows, cols] with a box of box_rows x 64, 128-byte swizzle;
// reads past the tensor are zero-filled.
absl::Status EncodeMap(CUtensorMap* map, const uint16_t* ptr, int64_t rows, int64_t cols,
                       int box_rows, const char* what) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * 2};
  static_assert(tall::kBK == wide::kBK && tall::kThreads == wide::kThreads);
  const cuuint32_t box[2] = {tall::kBK, static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = internal::TensorMapEncodeTiled()(
      map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, const_cast<uint16_t*>(ptr), dims, strides, box,
      elem, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrFormat("cuTensorMapEncodeTiled(%s, rows %d, cols %d) failed with CUresult %d",
                        what, rows, cols, static_cast<int>(r)));
  }
  return absl::OkStatus();
}

absl::Status Check(const HopperGemmParams& p, const void* out, const char* who) {
  if (p.a == nullptr || p.b == nullptr || p.offsets == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: null device pointer", who));
  }
  if (p.max_rows < 0 || p.n < 1 || p.k < 1 || p.num_local_experts < 1 ||
      p.num_local_experts > kHopperGemmMaxExperts) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: expected max_rows >= 0, n >= 1, k >= 1, L in [1, %d], got %d, %d, %d, %d", who,
        kHopperGemmMaxExperts, p.max_rows, p.n, p.k, p.num_local_experts));
  }
  if (p.k % 8 != 0 || reinterpret_cast<uintptr_t>(p.a) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(p.b) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: needs k %% 8 == 0 (got k %d) and 16-byte aligned a and b", who, p.k));
  }
  const int64_t b_rows = int64_t{p.num_local_experts} * p.n * 2;
  if (p.max_rows >= (int64_t{1} << 31) || b_rows >= (int64_t{1} << 31) || p.k >= (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: sizes past int32 (max_rows %d, L * 2N %d, k %d)", who, p.max_rows, b_rows, p.k));
  }
  return HopperGroupedGemmAvailable();
}

// Average rows per expert (max_rows / L) from which the tall tiles run: on
// one H200 at H 7168, I 2048, 128 experts they win at 256 rows per expert
// (4096 tokens, top-8) and lose at 8 and 32 (bench/results/run9, run11).
constexpr int64_t kTallRowsPerExpert = 192;

template <bool kFused>
absl::Status Launch(const HopperGemmParams& p, uint16_t* act, float* y, cudaStream_t stream,
                    const char* name) {
  if (p.max_rows == 0) return absl::OkStatus();
  int device = 0;
  int sms = 0;
  int smem_optin = 0;
  RETURN_IF_ERROR(internal::CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device), "SM count"));
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
      "shared memory per block"));
  // The tall tiles' m-tile prefix grows with L: past ~490 experts (227 KB)
  // the launch keeps the wide tiles, slower at prefill but the same results.
  const bool tall_tiles = p.max_rows >= kTallRowsPerExpert * p.num_local_experts &&
                          tall::SmemBytes(p.num_local_experts) <= smem_optin;
  const int a_box = tall_tiles ? tall::kBox : wide::kWgRows;
  const int b_box = tall_tiles ? tall::kBox : wide::kBSub;
  const int64_t bm = tall_tiles ? tall::kBM : wide::kBM;
  const int64_t n_step =
      tall_tiles ? (kFused ? tall::kBN / 2 : tall::kBN) : (kFused ? wide::kBSub : 2 * wide::kBSub);
  const int smem =
      tall_tiles ? tall::SmemBytes(p.num_local_experts) : wide::SmemBytes(p.num_local_experts);
  auto* kernel =
      tall_tiles ? tall::HopperGroupedGemmKernel<kFused> : wide::HopperGroupedGemmKernel<kFused>;
  CUtensorMap map_a;
  CUtensorMap map_b;
  RETURN_IF_ERROR(EncodeMap(&map_a, p.a, p.max_rows, p.k, a_box, "a"));
  const int64_t b_rows = int64_t{p.num_local_experts} * p.n * (kFused ? 2 : 1);
  RETURN_IF_ERROR(EncodeMap(&map_b, p.b, b_rows, p.k, b_box, "b"));
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
      absl::StrFormat("cudaFuncSetAttribute(%s, %d bytes of shared memory)", name, smem)));
  const int64_t most_tiles =
      ((p.max_rows + bm - 1) / bm + p.num_local_experts) * ((p.n + n_step - 1) / n_step);
  const int grid = static_cast<int>(std::min<int64_t>(sms, most_tiles));
  kernel<<<grid, tall::kThreads, smem, stream>>>(map_a, map_b, p.offsets, p.num_local_experts,
                                                 static_cast<int>(p.n), static_cast<int>(p.k), act,
                                                 y);
  return internal::LaunchStatus(name);
}

}  // namespace

absl::Status HopperGroupedGemmAvailable() {
#if !defined(MOE_EP_HAVE_SM90A)
  return absl::FailedPreconditionError(
      "Hopper grouped GEMM: kernels/ was not built for CUDA architecture 90a");
#else
  int device = 0;
  int major = 0;
  int minor = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) != cudaSuccess ||
      cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) != cudaSuccess) {
    cudaGetLastError();
    return absl::FailedPreconditionError("Hopper grouped GEMM: no CUDA device");
  }
  if (major != 9 || minor != 0) {
    return absl::FailedPreconditionError(
        absl::StrFormat("Hopper grouped GEMM: needs compute capability 9.0, device %d is %d.%d",
                        device, major, minor));
  }
  if (internal::TensorMapEncodeTiled() == nullptr) {
    return absl::FailedPreconditionError(
        "Hopper grouped GEMM: the driver has no cuTensorMapEncodeTiled");
  }
  return absl::OkStatus();
#endif
}

absl::Status LaunchHopperGroupedSwiGlu(const HopperGemmParams& p, uint16_t* act,
                                       cudaStream_t stream) {
  absl::Status s = Check(p, act, "LaunchHopperGroupedSwiGlu");
  if (!s.ok()) return s;
  return Launch<true>(p, act, nullptr, stream, "HopperGroupedGemmKernel<SwiGLU>");
}

absl::Status LaunchHopperGroupedGemm(const HopperGemmParams& p, float* y, cudaStream_t stream) {
  absl::Status s = Check(p, y, "LaunchHopperGroupedGemm");
  if (!s.ok()) return s;
  return Launch<false>(p, nullptr, y, stream, "HopperGroupedGemmKernel<plain>");
}

const void* internal::HopperGroupedGemmModule() {
  return reinterpret_cast<const void*>(&tall::HopperGroupedGemmKernel<false>);
}

}  // namespace moe_ep::kernels
