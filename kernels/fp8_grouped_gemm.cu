#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/fp8_e4m3.h"
#include "core/quantized_formats.h"
#include "core/status_macros.h"
#include "kernels/fp8_grouped_gemm.cuh"
#include "kernels/hopper_grouped_gemm.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/hopper_ptx.cuh"
#include "kernels/internal/kernel_modules.h"
#include "kernels/internal/tensor_map.h"

namespace moe_ep::kernels {
namespace {

// A tile is kSubs x 128 rows (kSubs m64 sub-tiles per consumer warpgroup;
// warpgroup cw owns sub-tiles cw, cw + 2, ...) times 128 B rows; one ring
// stage is one 128-wide K block (one scale block of both operands, one
// 128-byte swizzle row of e4m3 codes): 2 kSubs A boxes and 2 B boxes of
// 64 rows x 128 codes. kSubs 1 (128 rows, 6 stages of 32 KB, 5 for the
// fused kernel, which parks pass 0's SwiGLU values in 32 KB of shared
// memory; k-blocks in wgmma ping-pong pairs) for few rows per expert
// (decode: the weights stream), kSubs 2 (256 rows, 48 KB stages: 4, or 3
// for the fused kernel, 64 KB parked) for many: half the L2 traffic of B
// per FLOP.
constexpr int kWgRows = 64;                // rows of one m64 sub-tile (one A box)
constexpr int kBK = 128;                   // K per stage (codes = bytes)
constexpr int kBoxRows = 64;               // rows of one TMA box (A and B)
constexpr int kBN = 128;                   // B rows per stage (two boxes)
constexpr int kThreads = 384;              // producer + 2 consumer warpgroups
constexpr int kBoxBytes = kBoxRows * kBK;  // 8 KB
// Arrivals that free a stage: lane 0 of each of the 8 consumer warps, each
// after its own wait. Warps of a warpgroup are not in lockstep: a stage
// freed by one thread per warpgroup (bench/results/fp8-experts, call 2) let
// warp 0 of a warpgroup that only keeps the ring's phases run a whole ring
// ahead of its other warps, whose next wait then saw a phase of the wrong
// parity and never returned.
constexpr int kEmptyArrivals = 8;
static_assert(kBK == kFp8ScaleBlock && kBN == kFp8ScaleBlock);

template <bool kFused, int kSubs>
struct Shape {
  static constexpr int kBM = 128 * kSubs;                        // most rows of a tile
  static constexpr int kABoxes = 2 * kSubs;                      // A boxes of a stage
  static constexpr int kStageBytes = (kABoxes + 2) * kBoxBytes;  // A boxes, then B0 | B1
  // Fused, kSubs 1: 5, so that pass 0's values (32 KB) and the offsets of
  // kHopperGemmMaxExperts experts fit beside the ring.
  static constexpr int kStages = kSubs == 1 ? (kFused ? 5 : 6) : (kFused ? 3 : 4);
  static constexpr int kRingBytes = kStages * kStageBytes;
  static constexpr int kBarrierBytes = 2 * kStages * 8;
  // Fused: pass 0's values, [warpgroup][value 0 .. 32 kSubs - 1][thread]
  // (kSubs 1 too: its registers hold the two ping-pong partial sums).
  static constexpr int kHeldBytes = kFused ? 2 * 32 * kSubs * 128 * 4 : 0;
  // Dynamic shared memory: 1024 (alignment slack) + ring + held values +
  // barriers + the offsets and the m-tile prefix, (L+1) int32 each.
  static int SmemBytes(int num_local_experts) {
    return 1024 + kRingBytes + kHeldBytes + kBarrierBytes + 2 * (num_local_experts + 1) * 4;
  }
};

struct Tile {
  int expert;
  int32_t m_start;  // first row of the tile
  int32_t m_end;    // end of the tile's rows (<= the expert's end)
  int32_t n0;       // first output column (a multiple of 128)
};

// m-tiles of an expert of `rows` rows, tiles of at most `bm` rows.
__device__ __forceinline__ int MTiles(int rows, int bm) { return (rows + bm - 1) / bm; }

// The expert of work unit t: the last l with s_mt[l] * n_tiles <= t
// (s_mt: the prefix of each expert's units per n-tile).
__device__ __forceinline__ int ExpertOfUnit(int t, const int32_t* s_mt, int num_local_experts,
                                            int n_tiles) {
  int lo = 0;
  int hi = num_local_experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (s_mt[mid] * n_tiles <= t)
      lo = mid;
    else
      hi = mid - 1;
  }
  return lo;
}

// Rows of each m-tile of an expert of `rows` rows cut into m_tiles equal runs
// of a multiple of 64 rows (the last clipped).
__device__ __forceinline__ int MTileStep(int32_t rows, int m_tiles) {
  return ((rows + m_tiles - 1) / m_tiles + kWgRows - 1) / kWgRows * kWgRows;
}

// Tile t of the walk: expert-major, then n-tile, then m-tile (fastest), so
// CTAs working at the same time share the expert's weight tiles in L2. An
// expert's m-tiles are equal runs of a multiple of 64 rows (the last
// clipped), so no expert pays a nearly empty last pass over its weights.
__device__ __forceinline__ Tile DecodeTile(int t, const int32_t* s_off, const int32_t* s_mt,
                                           int num_local_experts, int n_tiles) {
  const int lo = ExpertOfUnit(t, s_mt, num_local_experts, n_tiles);
  const int local = t - s_mt[lo] * n_tiles;
  const int m_tiles = s_mt[lo + 1] - s_mt[lo];
  const int32_t e0 = s_off[lo];
  const int32_t e1 = s_off[lo + 1];
  const int step = MTileStep(e1 - e0, m_tiles);
  Tile tile;
  tile.expert = lo;
  tile.m_start = e0 + (local % m_tiles) * step;
  tile.m_end = min(e1, tile.m_start + step);
  tile.n0 = (local / m_tiles) * kBN;
  return tile;
}

// B-sharing clusters (Fp8GemmParams::cluster 3): unit t is (expert, n-tile,
// pair j of m-tiles), walked as DecodeTile's tiles (pair fastest); s_pairs
// is the prefix of each expert's pairs. The expert's rows are cut into 2 *
// pairs m-tiles (DecodeTile's count rounded up to even: both CTAs of a pair
// get rows where the expert has more than 64) and CTA `rank` takes m-tile
// 2j + rank; a trailing m-tile may be empty (m_start == m_end).
__device__ __forceinline__ Tile DecodePairTile(int t, const int32_t* s_off, const int32_t* s_pairs,
                                               int num_local_experts, int n_tiles, int rank) {
  const int lo = ExpertOfUnit(t, s_pairs, num_local_experts, n_tiles);
  const int local = t - s_pairs[lo] * n_tiles;
  const int pairs = s_pairs[lo + 1] - s_pairs[lo];
  const int32_t e0 = s_off[lo];
  const int32_t e1 = s_off[lo + 1];
  const int step = MTileStep(e1 - e0, 2 * pairs);
  Tile tile;
  tile.expert = lo;
  tile.m_start = min(e1, e0 + (2 * (local % pairs) + rank) * step);
  tile.m_end = min(e1, tile.m_start + step);
  tile.n0 = (local / pairs) * kBN;
  return tile;
}

// The kernel's mbarrier waits, bounded: a phase that has not completed
// within kWaitTimeoutNs (%globaltimer, read only after a failed try_wait)
// means the ring's protocol broke, and the kernel traps (the stream then
// reports "unspecified launch failure"), so a broken step fails instead of
// hanging a replayed graph. No printf here: a call in the k-loop made ptxas
// spill up to 1.4 KB per thread (call 2 of bench/results/fp8-experts).
constexpr uint64_t kWaitTimeoutNs = 4000000000ull;

__device__ __forceinline__ uint64_t GlobalTimerNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

__device__ __forceinline__ bool MbarTryWait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  asm volatile(
      "{\n.reg .pred p;\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
      "selp.u32 %0, 1, 0, p;\n}\n"
      : "=r"(done)
      : "r"(bar), "r"(parity)
      : "memory");
  return done != 0;
}

__device__ __forceinline__ void MbarWaitBounded(uint32_t bar, uint32_t parity) {
  if (MbarTryWait(bar, parity)) return;
  const uint64_t start = GlobalTimerNs();
  while (!MbarTryWait(bar, parity)) {
    if (GlobalTimerNs() - start > kWaitTimeoutNs) __trap();
  }
}

// 2-CTA clusters (multicast of A or of B): a TMA load written to the same
// offset of every CTA in `mask` (completing there on the same barrier offset);
// the cluster helpers are in kernels/internal/hopper_ptx.cuh.
// MbarArrivePeer when `pred`, predicated as MbarArriveIf (no branch).
__device__ __forceinline__ void MbarArrivePeerIf(uint32_t bar, uint32_t peer, bool pred) {
  asm volatile(
      "{\n.reg .pred p;\n.reg .b32 remote;\nsetp.ne.b32 p, %2, 0;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "@p mbarrier.arrive.shared::cluster.b64 _, [remote];\n}\n" ::"r"(bar),
      "r"(peer), "r"(static_cast<int>(pred))
      : "memory");
}

__device__ __forceinline__ void TmaLoad2dMulticast(uint32_t dst, const CUtensorMap* map, int32_t c0,
                                                   int32_t c1, uint32_t bar, uint16_t mask) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster [%0], [%1, {%2, %3}], [%4], %5;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask)
      : "memory");
}

__device__ __forceinline__ void TmaLoad2dMulticast(uint32_t dst, const CUtensorMap* map, int32_t c0,
                                                   int32_t c1, uint32_t bar, uint16_t mask,
                                                   uint64_t policy) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
      ".multicast::cluster.L2::cache_hint [%0], [%1, {%2, %3}], [%4], %5, %6;\n" ::"r"(dst),
      "l"(reinterpret_cast<uint64_t>(map)), "r"(c0), "r"(c1), "r"(bar), "h"(mask), "l"(policy)
      : "memory");
}

// Brings a box of the tensor into L2 (no shared memory, no barrier).
__device__ __forceinline__ void TmaPrefetchL2(const CUtensorMap* map, int32_t c0, int32_t c1) {
  asm volatile("cp.async.bulk.prefetch.tensor.2d.L2.global.tile [%0, {%1, %2}];\n" ::"l"(
                   reinterpret_cast<uint64_t>(map)),
               "r"(c0), "r"(c1)
               : "memory");
}

__device__ __forceinline__ uint16_t Bf16Bits(float v) {
  const __nv_bfloat16 b = __float2bfloat16_rn(v);
  return *reinterpret_cast<const uint16_t*>(&b);
}

// kFused (gate/up): a tile is 128 act columns [n0, n0 + 128) computed in two
// passes over K, pass p with B boxes gate rows n0 + 64p.. and up rows
// N + n0 + 64p.. (accumulator columns [0, 64) gate, [64, 128) up); pass 0's
// fp32 SwiGLU values stay (registers for kSubs 1, shared memory for 2) so
// that pass 1's epilogue sees the whole 128-column scale block of each row
// and writes e4m3 codes and the row's scale (core/quantized_formats.h's
// activation rule). Else (down): one pass, B boxes rows n0.. and n0 + 64..,
// bf16 y columns [n0, n0 + 128).
// Buffers: a [max_rows, K] e4m3 (tensor map), a_scale [K/128, a_stride],
// b [L, b_rows, K] e4m3 (tensor map), b_scale [L, (2,) N/128, K/128],
// act [max_rows, N] e4m3 + act_scale [N/128, act_stride] (fused) or y
// [max_rows, N] bf16. Memory ordering: TMA completes on `full[s]`
// (expect-tx of the stage's bytes); lane 0 of each consumer warp arrives on
// `empty[s]` (kEmptyArrivals per phase) once its own wait for the wgmma
// reading stage s has returned, or, with no rows in the tile, once it has
// seen the stage land.
// kCluster 2: CTA pairs; kShareB false: a pair's tiles are adjacent n-tiles
// of the same rows, each CTA loads every other A box and multicasts it to
// both (either kSubs); kShareB true: a pair's tiles are adjacent m-tiles of the
// same n-tile, each CTA loads its own A boxes and one of the stage's two B
// boxes (rank r box r), multicast to both. Either way each CTA's expect-tx
// is the bytes that land in its own stage (its A boxes + both B boxes), and
// a CTA without rows still loads its share for the peer and keeps the
// ring's phases.
template <bool kFused, int kSubs, int kCluster, bool kShareB>
__global__ void __launch_bounds__(kThreads, 1)
    Fp8GroupedGemmKernel(const __grid_constant__ CUtensorMap map_a,
                         const __grid_constant__ CUtensorMap map_b,
                         const float* __restrict__ a_scale, int64_t a_stride,
                         const float* __restrict__ b_scale, const int32_t* __restrict__ offsets,
                         int num_local_experts, int n, int k, int prefetch, int l2_hint,
                         uint8_t* __restrict__ act, float* __restrict__ act_scale,
                         int64_t act_stride, uint16_t* __restrict__ y) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using namespace internal;
  using S = Shape<kFused, kSubs>;
  constexpr int kStages = S::kStages;
  extern __shared__ uint8_t smem_raw[];
  uint8_t* ring =
      reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});
  [[maybe_unused]] float* held_smem = reinterpret_cast<float*>(ring + S::kRingBytes);
  uint64_t* full = reinterpret_cast<uint64_t*>(ring + S::kRingBytes + S::kHeldBytes);
  uint64_t* empty = full + kStages;
  int32_t* s_off = reinterpret_cast<int32_t*>(empty + kStages);
  int32_t* s_mt = s_off + num_local_experts + 1;
  const int tid = threadIdx.x;
  const int num_l = num_local_experts;
  for (int i = tid; i <= num_l; i += kThreads) s_off[i] = offsets[i];
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      MbarInit(SmemAddr(&full[s]), 1);
      // Lane 0 of each consumer warp, of both CTAs of a cluster.
      MbarInit(SmemAddr(&empty[s]), kEmptyArrivals * kCluster);
    }
    FenceBarrierInit();
  }
  if constexpr (kCluster > 1) {
    ClusterSync();  // the peer's barriers exist before its first multicast or arrival
  } else {
    __syncthreads();
  }
  // An expert's work units per n-tile: m-tiles, or with kShareB pairs of them.
  auto units_per_n_tile = [](int rows) {
    const int m_tiles = MTiles(rows, S::kBM);
    return kShareB ? (m_tiles + 1) / 2 : m_tiles;
  };
  if (tid < 32) {  // unit prefix: each lane a run of experts, then a warp scan
    const int per = (num_l + 31) / 32;
    const int lo = min(num_l, tid * per);
    const int hi = min(num_l, lo + per);
    int sum = 0;
    for (int l = lo; l < hi; ++l) sum += units_per_n_tile(s_off[l + 1] - s_off[l]);
    int incl = sum;
    for (int d = 1; d < 32; d *= 2) {
      const int v = __shfl_up_sync(0xffffffffu, incl, d);
      if (tid >= d) incl += v;
    }
    int run = incl - sum;
    for (int l = lo; l < hi; ++l) {
      s_mt[l] = run;
      run += units_per_n_tile(s_off[l + 1] - s_off[l]);
    }
    if (tid == 31) s_mt[num_l] = incl;
  }
  __syncthreads();

  constexpr int kPasses = kFused ? 2 : 1;
  const int n_tiles = n / kBN;
  // Work units: tiles, or with kCluster 2 pairs of tiles of adjacent n-tiles
  // (same expert, same rows: the cluster's CTAs share A, each loads half of
  // its boxes and multicasts them to both), or with kShareB pairs of
  // adjacent m-tiles (same expert and n-tile: the CTAs share B).
  const int num_units = s_mt[num_l] * (kShareB ? n_tiles : n_tiles / kCluster);
  const int k_blocks = k / kBK;
  const int wg = tid / 128;
  const uint32_t rank = kCluster > 1 ? ClusterCtaRank() : 0;
  const int unit0 = blockIdx.x / kCluster;
  const int unit_stride = gridDim.x / kCluster;
  auto decode = [&](int u) {
    if constexpr (kShareB) {
      return DecodePairTile(u, s_off, s_mt, num_l, n_tiles, static_cast<int>(rank));
    }
    Tile tile = DecodeTile(u, s_off, s_mt, num_l, n_tiles / kCluster);
    tile.n0 = (tile.n0 / kBN * kCluster + static_cast<int>(rank)) * kBN;
    return tile;
  };

  if (wg == 0) {
    SetMaxRegsDec<40>();
    if (tid != 0) return;
    // Fp8GemmParams::l2_hint: the L2 policies of the A and B loads (0: the
    // loads carry none).
    const bool hinted = l2_hint != 0;
    uint64_t policy_a = 0;
    uint64_t policy_b = 0;
    if (hinted) {
      policy_a = l2_hint == 3 ? CreatePolicyEvictNormal() : CreatePolicyEvictLast();
      policy_b = l2_hint == 1 ? CreatePolicyEvictNormal() : CreatePolicyEvictFirst();
    }
    // One box into this CTA's stage, or (mask != 0) into the same offset of
    // every CTA of `mask`, with the operand's policy when hinted.
    auto load = [&](uint32_t dst, const CUtensorMap* map, int32_t c0, int32_t c1, uint32_t bar,
                    uint16_t mask, uint64_t policy) {
      if (mask != 0) {
        if (hinted) {
          TmaLoad2dMulticast(dst, map, c0, c1, bar, mask, policy);
        } else {
          TmaLoad2dMulticast(dst, map, c0, c1, bar, mask);
        }
      } else if (hinted) {
        TmaLoad2d(dst, map, c0, c1, bar, policy);
      } else {
        TmaLoad2d(dst, map, c0, c1, bar);
      }
    };
    int it = 0;
    for (int u = unit0; u < num_units; u += unit_stride) {
      const Tile tile = decode(u);
      const int boxes = (tile.m_end - tile.m_start + kBoxRows - 1) / kBoxRows;  // <= kABoxes
      const uint32_t bytes = (boxes + 2) * kBoxBytes;
      // Unrolled as the compiler chose before the l2_hint branches (which
      // made it stop): the fused kernels' default loads stay as they were.
#pragma unroll
      for (int p = 0; p < kPasses; ++p) {
        // B rows of the two boxes: gate and up halves (fused) or 128 rows.
        const int32_t r0 =
            kFused ? tile.expert * 2 * n + tile.n0 + kBoxRows * p : tile.expert * n + tile.n0;
        const int32_t r1 = kFused ? r0 + n : r0 + kBoxRows;
        // kShareB: the one B box this CTA loads (and multicasts), box `rank`;
        // only its row stays live in the k-loop (the producer has 40
        // registers).
        const int32_t r_own = rank == 0 ? r0 : r1;
        // Optional L2 prefetch of k-block kp's B boxes (the weights, from
        // device memory), `prefetch` k-blocks ahead of the loads; off by
        // default: it measured slower (kDefaultL2Prefetch).
        auto prefetch_block = [&](int kp) {
          if constexpr (kShareB) {
            TmaPrefetchL2(&map_b, kp * kBK, r_own);
          } else {
            TmaPrefetchL2(&map_b, kp * kBK, r0);
            TmaPrefetchL2(&map_b, kp * kBK, r1);
          }
        };
        for (int kp = 0; kp < min(prefetch, k_blocks); ++kp) prefetch_block(kp);
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          if (prefetch > 0 && kb + prefetch < k_blocks) prefetch_block(kb + prefetch);
          const int s = it % kStages;
          MbarWaitBounded(SmemAddr(&empty[s]), ((it / kStages) & 1) ^ 1);
          const uint32_t bar = SmemAddr(&full[s]);
          MbarArriveExpectTx(bar, bytes);
          uint8_t* st = ring + s * S::kStageBytes;
          const int32_t kc = kb * kBK;
          for (int j = 0; j < boxes; ++j) {
            if constexpr (kCluster > 1 && !kShareB) {
              if (j % kCluster == static_cast<int>(rank)) {
                load(SmemAddr(st + j * kBoxBytes), &map_a, kc, tile.m_start + j * kBoxRows, bar,
                     (1u << kCluster) - 1, policy_a);
              }
            } else {
              load(SmemAddr(st + j * kBoxBytes), &map_a, kc, tile.m_start + j * kBoxRows, bar, 0,
                   policy_a);
            }
          }
          if constexpr (kShareB) {  // B box `rank` into both CTAs' stage
            load(SmemAddr(st + (S::kABoxes + rank) * kBoxBytes), &map_b, kc, r_own, bar,
                 (1u << kCluster) - 1, policy_b);
          } else {
            load(SmemAddr(st + S::kABoxes * kBoxBytes), &map_b, kc, r0, bar, 0, policy_b);
            load(SmemAddr(st + (S::kABoxes + 1) * kBoxBytes), &map_b, kc, r1, bar, 0, policy_b);
          }
        }
      }
    }
    if constexpr (kCluster > 1) {
      // Stay until both CTAs' consumers have freed every stage: the peer's
      // arrivals on this CTA's barriers must land before its memory goes.
      for (int i = max(0, it - kStages); i < it; ++i) {
        MbarWaitBounded(SmemAddr(&empty[i % kStages]), (i / kStages) & 1);
      }
    }
    return;
  }

  SetMaxRegsInc<232>();
  const int cw = wg - 1;     // consumer warpgroup: sub-tiles cw, cw + 2, ... of the tile
  const int lt = tid % 128;  // thread in the warpgroup
  const int warp_row = (lt / 32) * 16 + (lt % 32) / 4;  // accumulator row of d[0]
  const int lane_col = (lt % 4) * 2;                    // accumulator column of d[0]
  // Frees ring stage s: this CTA's barrier, and the peer's (its producer
  // multicasts into this CTA's stage s too).
  auto release = [&](int s, bool pred) {
    MbarArriveIf(SmemAddr(&empty[s]), pred);
    if constexpr (kShareB) {
      MbarArrivePeerIf(SmemAddr(&empty[s]), rank ^ 1, pred);
    } else if constexpr (kCluster > 1) {
      if (pred) MbarArrivePeer(SmemAddr(&empty[s]), rank ^ 1);
    }
  };
  int it = 0;
  for (int u = unit0; u < num_units; u += unit_stride) {
    const Tile tile = decode(u);
    // This warpgroup's sub-tiles with rows of the tile: 0 .. kSubs.
    const int tile_subs = (tile.m_end - tile.m_start + kWgRows - 1) / kWgRows;
    const int subs = min(kSubs, (tile_subs - cw + 1) / 2);
    if (subs <= 0) {  // no rows here: keep the ring's phases, no products
      for (int kb = 0; kb < kPasses * k_blocks; ++kb, ++it) {
        const int s = it % kStages;
        MbarWaitBounded(SmemAddr(&full[s]), (it / kStages) & 1);
        release(s, lt % 32 == 0);
      }
      continue;
    }
    // Sub-tile i's two accumulator rows: d[4c + 2h + e] is row RowOf(i, h),
    // which holds data when RowOk(i, h).
    const int32_t row_base = tile.m_start + cw * kWgRows + warp_row;
    auto row_of = [&](int i, int h) { return row_base + 2 * i * kWgRows + 8 * h; };
    auto row_ok = [&](int i, int h) { return i < subs && row_of(i, h) < tile.m_end; };
    const int nb = tile.n0 / kBN;
    // Weight scales of the accumulator's column halves [0, 64) and [64, 128).
    const float* w_lo;
    const float* w_hi;
    if constexpr (kFused) {
      w_lo = b_scale + (int64_t{tile.expert} * 2 * n_tiles + nb) * k_blocks;
      w_hi = w_lo + int64_t{n_tiles} * k_blocks;
    } else {
      w_lo = b_scale + (int64_t{tile.expert} * n_tiles + nb) * k_blocks;
      w_hi = w_lo;
    }
#pragma unroll
    for (int p = 0; p < kPasses; ++p) {
      float acc[kSubs][64];
#pragma unroll
      for (int i = 0; i < kSubs; ++i) {
#pragma unroll
        for (int j = 0; j < 64; ++j) acc[i][j] = 0.0f;
      }
      // Promotion: acc += partial * (s_a * s_w), per element one FFMA.
      auto promote = [&](float(&dst)[64], const float(&part)[64], float sa0, float sa1, float wl,
                         float wh) {
        const float c_al = sa0 * wl;
        const float c_ah = sa0 * wh;
        const float c_bl = sa1 * wl;
        const float c_bh = sa1 * wh;
#pragma unroll
        for (int c = 0; c < 16; ++c) {
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            dst[4 * c + e] = fmaf(part[4 * c + e], c < 8 ? c_al : c_ah, dst[4 * c + e]);
            dst[4 * c + 2 + e] = fmaf(part[4 * c + 2 + e], c < 8 ? c_bl : c_bh, dst[4 * c + 2 + e]);
          }
        }
      };
      if constexpr (kSubs == 1) {
        // 128-row tiles, one m64 sub-tile per warpgroup: k-blocks in pairs,
        // both groups of products queued on the tensor cores before the
        // first is waited for, so that the first pair member's promotion
        // overlaps the second's products. The partial sums are declared in
        // the loop body: nothing of an unfinished group is live across an
        // iteration or a branch (else ptxas copies and serializes them).
        // A k-block's scales are loaded when its products are issued.
        auto issue = [&](float(&part)[64], float(&sc)[4], int kb, int itx) {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            sc[h] = row_ok(0, h) ? __ldg(a_scale + kb * a_stride + row_of(0, h)) : 0.0f;
          }
          sc[2] = __ldg(w_lo + kb);
          sc[3] = __ldg(w_hi + kb);
          const int s = itx % kStages;
          MbarWaitBounded(SmemAddr(&full[s]), (itx / kStages) & 1);
          const uint8_t* st = ring + s * S::kStageBytes;
          const uint32_t a_addr = SmemAddr(st + cw * kBoxBytes);
          const uint32_t b_addr = SmemAddr(st + S::kABoxes * kBoxBytes);
          WgmmaFence();
#pragma unroll
          for (int kk = 0; kk < kBK / 32; ++kk) {
            WgmmaE4m3x128(part, SwizzledKMajorDesc(a_addr + kk * 32),
                          SwizzledKMajorDesc(b_addr + kk * 32), kk > 0 ? 1 : 0);
          }
          WgmmaCommit();
        };
        // After the wait for ring iteration itx's group: free its stage (each
        // consumer warp has seen the products complete) and promote.
        auto finish = [&](const float(&part)[64], const float(&sc)[4], int itx) {
          release(itx % kStages, lt % 32 == 0);
          promote(acc[0], part, sc[0], sc[1], sc[2], sc[3]);
        };
        int kb = 0;
        for (; kb + 2 <= k_blocks; kb += 2, it += 2) {
          float part_a[64];
          float part_b[64];
          float sc_a[4];  // s_a of rows h = 0, 1; s_w of columns [0, 64), [64, 128)
          float sc_b[4];
          issue(part_a, sc_a, kb, it);
          issue(part_b, sc_b, kb + 1, it + 1);
          WgmmaWait<1>();
          finish(part_a, sc_a, it);
          WgmmaWait<0>();
          finish(part_b, sc_b, it + 1);
        }
        if (kb < k_blocks) {  // odd k_blocks: the last one alone
          float part_a[64];
          float sc_a[4];
          issue(part_a, sc_a, kb, it);
          WgmmaWait<0>();
          finish(part_a, sc_a, it);
          ++it;
        }
      } else {
        // Scales are loaded one k-block ahead of their use, so that their
        // latency hides behind a whole k-block's wait, products and promotion.
        float sa_next[kSubs][2];
        float wl_next;
        float wh_next;
        auto load_scales = [&](int kb) {
#pragma unroll
          for (int i = 0; i < kSubs; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              sa_next[i][h] = row_ok(i, h) ? __ldg(a_scale + kb * a_stride + row_of(i, h)) : 0.0f;
            }
          }
          wl_next = __ldg(w_lo + kb);
          wh_next = __ldg(w_hi + kb);
        };
        load_scales(0);
        for (int kb = 0; kb < k_blocks; ++kb, ++it) {
          const int s = it % kStages;
          float sa[kSubs][2];
#pragma unroll
          for (int i = 0; i < kSubs; ++i) {
#pragma unroll
            for (int h = 0; h < 2; ++h) sa[i][h] = sa_next[i][h];
          }
          const float wl = wl_next;
          const float wh = wh_next;
          if (kb + 1 < k_blocks) load_scales(kb + 1);
          MbarWaitBounded(SmemAddr(&full[s]), (it / kStages) & 1);
          const uint8_t* st = ring + s * S::kStageBytes;
          const uint32_t b_addr = SmemAddr(st + S::kABoxes * kBoxBytes);
#pragma unroll
          for (int i = 0; i < kSubs; ++i) {
            if (i >= subs) break;  // warpgroup-uniform
            const uint32_t a_addr = SmemAddr(st + (cw + 2 * i) * kBoxBytes);
            float part[64];
            WgmmaFence();
#pragma unroll
            for (int kk = 0; kk < kBK / 32; ++kk) {
              WgmmaE4m3x128(part, SwizzledKMajorDesc(a_addr + kk * 32),
                            SwizzledKMajorDesc(b_addr + kk * 32), kk > 0 ? 1 : 0);
            }
            WgmmaCommit();
            WgmmaWait<0>();
            // The stage is free once every consumer warp has seen its last
            // sub-tile's products complete.
            release(s, lt % 32 == 0 && i + 1 == subs);
            promote(acc[i], part, sa[i][0], sa[i][1], wl, wh);
          }
        }
      }
      // Epilogue: d[4c + 2h + e] is row RowOf(i, h), column 8c + lane_col + e.
#pragma unroll
      for (int i = 0; i < kSubs; ++i) {
        if (i >= subs) break;
        if constexpr (kFused) {
          // h = silu(g) * u in fp32 (core::quant's contract), into the gate
          // slots: acc[i][4c + 2h + e] for c < 8 is row rows[h], column
          // 64 p + 8c + lane_col + e of the tile.
#pragma unroll
          for (int c = 0; c < 8; ++c) {
#pragma unroll
            for (int j = 0; j < 4; ++j) {
              acc[i][4 * c + j] = core::fp8::MulRn(core::quant::SwiGluSilu(acc[i][4 * c + j]),
                                                   acc[i][4 * (c + 8) + j]);
            }
          }
          // Pass 0's values, v = 4c + j (c < 8): registers or shared memory.
          float* parked = held_smem + (cw * kSubs * 32 + i * 32) * 128 + lt;
          if (p == 0) {
#pragma unroll
            for (int v = 0; v < 32; ++v) {
              parked[v * 128] = acc[i][v];
            }
            continue;
          }
          float prev[32];
#pragma unroll
          for (int v = 0; v < 32; ++v) {
            prev[v] = parked[v * 128];
          }
          // The row's 128 columns: passes 0 and 1 of the 4 threads of its quad.
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            float amax = 0.0f;
#pragma unroll
            for (int c = 0; c < 8; ++c) {
#pragma unroll
              for (int e = 0; e < 2; ++e) {
                amax = fmaxf(amax, fabsf(prev[4 * c + 2 * h + e]));
                amax = fmaxf(amax, fabsf(acc[i][4 * c + 2 * h + e]));
              }
            }
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
            amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
            const float scale = core::fp8::BlockScale(amax);
            const int32_t row = row_of(i, h);
            if (!row_ok(i, h)) continue;
            uint8_t* out = act + int64_t{row} * n + tile.n0 + lane_col;
#pragma unroll
            for (int q = 0; q < 2; ++q) {
#pragma unroll
              for (int c = 0; c < 8; ++c) {
                const float v0 = q == 0 ? prev[4 * c + 2 * h] : acc[i][4 * c + 2 * h];
                const float v1 = q == 0 ? prev[4 * c + 2 * h + 1] : acc[i][4 * c + 2 * h + 1];
                const uint32_t lo = core::quant::Fp8QuantizeActivation(v0, scale);
                const uint32_t hi = core::quant::Fp8QuantizeActivation(v1, scale);
                *reinterpret_cast<uint16_t*>(out + kBoxRows * q + 8 * c) =
                    static_cast<uint16_t>(lo | (hi << 8));
              }
            }
            if (lt % 4 == 0) act_scale[nb * act_stride + row] = scale;
          }
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            if (!row_ok(i, h)) continue;
            uint16_t* out = y + int64_t{row_of(i, h)} * n + tile.n0 + lane_col;
#pragma unroll
            for (int c = 0; c < 16; ++c) {
              *reinterpret_cast<uint32_t*>(out + 8 * c) =
                  Bf16Bits(acc[i][4 * c + 2 * h]) |
                  (uint32_t{Bf16Bits(acc[i][4 * c + 2 * h + 1])} << 16);
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

// Row-major e4m3 [rows, cols] with a box of 64 rows x 128 codes, 128-byte
// swizzle; reads past the tensor are zero-filled.
absl::Status EncodeMap(CUtensorMap* map, const uint8_t* ptr, int64_t rows, int64_t cols,
                       const char* what) {
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols)};
  const cuuint32_t box[2] = {kBK, kBoxRows};
  const cuuint32_t elem[2] = {1, 1};
  const CUresult r = internal::TensorMapEncodeTiled()(
      map, CU_TENSOR_MAP_DATA_TYPE_UINT8, 2, const_cast<uint8_t*>(ptr), dims, strides, box, elem,
      CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    return absl::InternalError(
        absl::StrFormat("cuTensorMapEncodeTiled(%s, rows %d, cols %d) failed with CUresult %d",
                        what, rows, cols, static_cast<int>(r)));
  }
  return absl::OkStatus();
}

absl::Status Check(const Fp8GemmParams& p, const void* out, const char* who) {
  if (p.a == nullptr || p.a_scale == nullptr || p.b == nullptr || p.b_scale == nullptr ||
      p.offsets == nullptr || out == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: null device pointer", who));
  }
  if (p.max_rows < 0 || p.n < 1 || p.k < 1 || p.num_local_experts < 1 ||
      p.num_local_experts > kHopperGemmMaxExperts) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: expected max_rows >= 0, n >= 1, k >= 1, L in [1, %d], got %d, %d, %d, %d", who,
        kHopperGemmMaxExperts, p.max_rows, p.n, p.k, p.num_local_experts));
  }
  if (p.k % kFp8ScaleBlock != 0 || p.n % kFp8ScaleBlock != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: n and k must be multiples of the %d-wide scale block, got n %d, k %d",
                        who, kFp8ScaleBlock, p.n, p.k));
  }
  if (p.l2_prefetch < -1 || p.l2_prefetch > 64) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: l2_prefetch expected -1 .. 64, got %d", who, p.l2_prefetch));
  }
  if (p.l2_hint < 0 || p.l2_hint > 3) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: l2_hint expected 0 .. 3, got %d", who, p.l2_hint));
  }
  if (p.cluster < 0 || p.cluster > 3) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: cluster expected 0 .. 3, got %d", who, p.cluster));
  }
  if (p.tile_rows != 0 && p.tile_rows != 128 && p.tile_rows != 256) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tile_rows expected 0, 128 or 256, got %d", who, p.tile_rows));
  }
  if (p.a_scale_stride < p.max_rows) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: a_scale_stride expected >= max_rows %d, got %d", who, p.max_rows, p.a_scale_stride));
  }
  if (reinterpret_cast<uintptr_t>(p.a) % 16 != 0 || reinterpret_cast<uintptr_t>(p.b) % 16 != 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: a and b must be 16-byte aligned for TMA", who));
  }
  const int64_t b_rows = int64_t{p.num_local_experts} * p.n * 2;
  if (p.max_rows >= (int64_t{1} << 31) || b_rows >= (int64_t{1} << 31) || p.k >= (1 << 30)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: sizes past int32 (max_rows %d, L * 2N %d, k %d)", who, p.max_rows, b_rows, p.k));
  }
  return HopperGroupedGemmAvailable();
}

// Average rows per expert (max_rows / L) from which the 256-row tiles run
// (as kernels/hopper_grouped_gemm.cu's tall tiles).
constexpr int64_t kTallRowsPerExpert = 192;
// Whether Fp8GemmParams::cluster 0 (auto) runs 128-row tiles in 2-CTA
// clusters: no, they measured level at 128 tokens and slower at 4096
// (bench/results/fp8-speed call 2).
constexpr bool kClusterByDefault = false;
// Fp8GemmParams::l2_prefetch -1: no L2 prefetch. Measured on an H100
// (bench/results/fp8-speed call 2): 8 k-blocks ahead made the GEMMs 16-22%
// slower at 128 tokens and 3-18% at 4096, 16 ahead worse still.
constexpr int kDefaultL2Prefetch = 0;

template <bool kFused, int kSubs, int kCluster, bool kShareB>
absl::Status LaunchShape(const Fp8GemmParams& p, const CUtensorMap& map_a, const CUtensorMap& map_b,
                         int sms, uint8_t* act, float* act_scale, int64_t act_stride, uint16_t* y,
                         cudaStream_t stream, const char* name) {
  using S = Shape<kFused, kSubs>;
  const int smem = S::SmemBytes(p.num_local_experts);
  auto* kernel = Fp8GroupedGemmKernel<kFused, kSubs, kCluster, kShareB>;
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
      absl::StrFormat("cudaFuncSetAttribute(%s, %d rows, %d bytes of shared memory)", name, S::kBM,
                      smem)));
  const int prefetch = p.l2_prefetch >= 0 ? p.l2_prefetch : kDefaultL2Prefetch;
  const int64_t most_units = ((p.max_rows + S::kBM - 1) / S::kBM + p.num_local_experts) *
                             (p.n / kBN / (kShareB ? 1 : kCluster));
  if constexpr (kCluster == 1) {
    const int grid = static_cast<int>(std::min<int64_t>(sms, most_units));
    kernel<<<grid, kThreads, smem, stream>>>(map_a, map_b, p.a_scale, p.a_scale_stride, p.b_scale,
                                             p.offsets, p.num_local_experts, static_cast<int>(p.n),
                                             static_cast<int>(p.k), prefetch, p.l2_hint, act,
                                             act_scale, act_stride, y);
    return internal::LaunchStatus(name);
  } else {
    // Persistent clusters: no more than can be resident at once (an SM pair
    // of one GPC each), else the surplus would run after the others.
    cudaLaunchConfig_t config = {};
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeClusterDimension;
    attr[0].val.clusterDim.x = kCluster;
    attr[0].val.clusterDim.y = 1;
    attr[0].val.clusterDim.z = 1;
    config.gridDim = dim3(sms / kCluster * kCluster);
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attr;
    config.numAttrs = 1;
    int clusters = 0;
    RETURN_IF_ERROR(
        internal::CudaStatus(cudaOccupancyMaxActiveClusters(&clusters, kernel, &config),
                             absl::StrFormat("cudaOccupancyMaxActiveClusters(%s)", name)));
    clusters = static_cast<int>(std::min<int64_t>(std::max(clusters, 1), most_units));
    config.gridDim = dim3(clusters * kCluster);
    RETURN_IF_ERROR(internal::CudaStatus(
        cudaLaunchKernelEx(&config, kernel, map_a, map_b, p.a_scale, p.a_scale_stride, p.b_scale,
                           p.offsets, p.num_local_experts, static_cast<int>(p.n),
                           static_cast<int>(p.k), prefetch, p.l2_hint, act, act_scale, act_stride,
                           y),
        absl::StrFormat("cudaLaunchKernelEx(%s, %d clusters of %d)", name, clusters, kCluster)));
    return internal::LaunchStatus(name);
  }
}

template <bool kFused>
absl::Status Launch(const Fp8GemmParams& p, uint8_t* act, float* act_scale, int64_t act_stride,
                    uint16_t* y, cudaStream_t stream, const char* name) {
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
  CUtensorMap map_a;
  CUtensorMap map_b;
  RETURN_IF_ERROR(EncodeMap(&map_a, p.a, p.max_rows, p.k, "a"));
  const int64_t b_rows = int64_t{p.num_local_experts} * p.n * (kFused ? 2 : 1);
  RETURN_IF_ERROR(EncodeMap(&map_b, p.b, b_rows, p.k, "b"));
  const bool tall_fits = Shape<kFused, 2>::SmemBytes(p.num_local_experts) <= smem_optin;
  const bool tall = p.tile_rows == 256 || (p.tile_rows == 0 && tall_fits &&
                                           p.max_rows >= kTallRowsPerExpert * p.num_local_experts);
  // Either tile height in 2-CTA clusters sharing B (pairs of m-tiles).
  if (p.cluster == 3 && sms >= 2) {
    if (tall) {
      return LaunchShape<kFused, 2, 2, true>(p, map_a, map_b, sms, act, act_scale, act_stride, y,
                                             stream, name);
    }
    return LaunchShape<kFused, 1, 2, true>(p, map_a, map_b, sms, act, act_scale, act_stride, y,
                                           stream, name);
  }
  // 2-CTA clusters sharing A where the n-tiles pair up (either height).
  const bool pairs = (p.n / kBN) % 2 == 0 && sms >= 2;
  if (tall) {
    if (p.cluster == 2 && pairs) {
      return LaunchShape<kFused, 2, 2, false>(p, map_a, map_b, sms, act, act_scale, act_stride, y,
                                              stream, name);
    }
    return LaunchShape<kFused, 2, 1, false>(p, map_a, map_b, sms, act, act_scale, act_stride, y,
                                            stream, name);
  }
  const bool cluster = p.cluster == 2 || (p.cluster == 0 && pairs && kClusterByDefault);
  if (cluster && pairs) {
    return LaunchShape<kFused, 1, 2, false>(p, map_a, map_b, sms, act, act_scale, act_stride, y,
                                            stream, name);
  }
  return LaunchShape<kFused, 1, 1, false>(p, map_a, map_b, sms, act, act_scale, act_stride, y,
                                          stream, name);
}

}  // namespace

absl::Status LaunchFp8GroupedSwiGlu(const Fp8GemmParams& p, uint8_t* act, float* act_scale,
                                    int64_t act_scale_stride, cudaStream_t stream) {
  RETURN_IF_ERROR(Check(p, act, "LaunchFp8GroupedSwiGlu"));
  if (act_scale == nullptr || act_scale_stride < p.max_rows) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchFp8GroupedSwiGlu: act_scale must be non-null with stride >= max_rows %d, got %d",
        p.max_rows, act_scale_stride));
  }
  return Launch<true>(p, act, act_scale, act_scale_stride, nullptr, stream,
                      "Fp8GroupedGemmKernel<SwiGLU>");
}

absl::Status LaunchFp8GroupedGemm(const Fp8GemmParams& p, uint16_t* y, cudaStream_t stream) {
  RETURN_IF_ERROR(Check(p, y, "LaunchFp8GroupedGemm"));
  return Launch<false>(p, nullptr, nullptr, 0, y, stream, "Fp8GroupedGemmKernel<plain>");
}

const void* internal::Fp8GroupedGemmModule() {
  return reinterpret_cast<const void*>(&Fp8GroupedGemmKernel<false, 1, 1, false>);
}

}  // namespace moe_ep::kernels
