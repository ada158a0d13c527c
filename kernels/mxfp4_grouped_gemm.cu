#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/strings/str_format.h"
#include "core/quantized_formats.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/mxfp4_grouped_gemm.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kRowsPerWarp = 16;  // the MMA's M
constexpr int kRowsPerCta = kWarps * kRowsPerWarp;
constexpr int kTokensPerTile = 8;            // the MMA's N
constexpr int kStepBytes = kMxfp4KStep / 2;  // of one weight row a step
constexpr int kStepBlocks = kMxfp4KStep / core::quant::kMxfp4Block;
struct KernelArgs {
  const uint16_t* a;
  const uint8_t* blocks;
  const uint8_t* scales;
  const uint16_t* bias;
  const int32_t* offsets;
  int n;                 // output columns (GLU: features; b_rows = 2n)
  int k;                 // reduction length, a multiple of 64
  int tiles_per_expert;  // CTAs per expert
  float alpha;           // GLU only
  float limit;
  void* out;  // GLU: bf16 act [rows, n]; else fp32 y [rows, n]
};

// One step of a thread: its two weight rows' 8 bytes (16 e2m1 values, K
// 16 t .. 16 t + 15 of the step for lane t of its quad, in the device order
// of Mxfp4BlocksToDeviceOrder), the E8M0 scale of the block they lie in,
// and, where kRingX, the activations the step multiplies them by (16 bf16 of
// each token tile, K 16 t .. 16 t + 15).
template <int kTiles, bool kRingX>
struct StepOperands {
  uint2 lo;
  uint2 hi;
  uint32_t scale_lo;
  uint32_t scale_hi;
  uint4 x[kRingX ? kTiles : 1][2];
};

// Where a thread's operands of step 0 of the current chunk lie; Load reads
// step `step` of them at constant offsets from these pointers, which
// advance a whole ring of steps at a time (no per-load address arithmetic).
template <int kTiles>
struct Cursor {
  const uint8_t* w_lo;
  const uint8_t* w_hi;
  const uint8_t* s_lo;
  const uint8_t* s_hi;
  const uint16_t* x[kTiles];  // token row + 16 t
  __device__ __forceinline__ void Advance(int steps) {
    w_lo += steps * kStepBytes;
    w_hi += steps * kStepBytes;
    s_lo += steps * kStepBlocks;
    s_hi += steps * kStepBlocks;
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) x[nt] += steps * kMxfp4KStep;
  }
};

template <int kTiles, bool kRingX>
__device__ __forceinline__ StepOperands<kTiles, kRingX> Load(const Cursor<kTiles>& c, int step) {
  StepOperands<kTiles, kRingX> w;
  w.lo = __ldg(reinterpret_cast<const uint2*>(c.w_lo + step * kStepBytes));
  w.hi = __ldg(reinterpret_cast<const uint2*>(c.w_hi + step * kStepBytes));
  w.scale_lo = __ldg(c.s_lo + step * kStepBlocks);
  w.scale_hi = __ldg(c.s_hi + step * kStepBlocks);
  if constexpr (kRingX) {
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      const auto* xp = reinterpret_cast<const uint4*>(c.x[nt] + step * kMxfp4KStep);
      w.x[nt][0] = __ldg(xp);
      w.x[nt][1] = __ldg(xp + 1);
    }
  }
  return w;
}

// The e2m1 pair `s` of a 32-bit word in the device order, as bf16x2 times
// 2^-126: each value's sign at bit 15 of its half and its three magnitude
// bits under the exponent's two low bits and the mantissa's top bit, so the
// bf16 is exactly e2m1 * 2^-126 (a subnormal for 0.5). The device order puts
// the bits where one mask (pair 0), a shift and a mask (pair 1), or two
// shifted pieces (pairs 2, 3) take them there: 11 integer operations a word
// of 8 values, where the checkpoint's nibble order needs 15 and a byte
// permute of the activations. Low half = the word's value 2 s, high half =
// value 2 s + 1; Mxfp4BlocksToDeviceOrder places them (kPairSign, kPairMagnitude).
constexpr uint32_t kSigns = 0x80008000u;
constexpr uint32_t kMagnitudes = 0x01c001c0u;
template <int s>
__device__ __forceinline__ uint32_t E2m1PairScaledDown(uint32_t q) {
  if constexpr (s == 0) return q & (kSigns | kMagnitudes);
  if constexpr (s == 1) return (q << 6) & (kSigns | kMagnitudes);
  if constexpr (s == 2) return ((q >> 6) & kMagnitudes) | ((q << 4) & kSigns);
  return ((q << 3) & kMagnitudes) | ((q << 5) & kSigns);
}

// a * b + (-0) on two bf16 lanes: the product, rounded (exact here).
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

// The multiplier taking E2m1PairScaledDown's value to e2m1 * 2^(s - 127):
// 2^(s - 1), a normal bf16 (bits (s + 126) << 7 in each half) for E8M0 s <=
// 128, one integer multiply-add. Above 128 it is capped at 2^127 and
// SecondMultiplier finishes the job.
__device__ __forceinline__ uint32_t FirstMultiplier(uint32_t s) {
  return min(s, 128u) * 0x00800080u + 0x3f003f00u;
}

// For E8M0 s > 128 (scales above 2; rare in checkpoints), the
// rest after FirstMultiplier's 2^127: 2^(s - 128), bits (s - 1) << 7; NaN for
// s = 255 (OCP MX's E8M0 NaN); 1 for s <= 128.
__device__ __forceinline__ uint32_t SecondMultiplier(uint32_t s) {
  if (s == 255) return 0x7fc07fc0u;
  return s > 128 ? (s - 1) * 0x00800080u : 0x3f803f80u;
}

__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One K step (64) of a warp: its 16 weight rows times every token tile.
// The K order inside the step is permuted the same way on both operands:
// logical k 2t + c of MMA sub-step s is K 16 t + 2 s + c of the step, and
// 8 + 2t + c is 16 t + 8 + 2 s + c, so lane t's 8 bytes of each row and its
// 32 bytes of each token are all it reads, and word s of those 32 bytes is
// the sub-step's B operand as loaded.
template <int kTiles, bool kRingX>
__device__ __forceinline__ void MultiplyStep(const StepOperands<kTiles, kRingX>& w,
                                             const Cursor<kTiles>& c, int step,
                                             float (&acc)[kTiles][4]) {
  const uint32_t m_lo = FirstMultiplier(w.scale_lo);
  const uint32_t m_hi = FirstMultiplier(w.scale_hi);
  uint32_t a[4][4];
  a[0][0] = MulBf16x2(E2m1PairScaledDown<0>(w.lo.x), m_lo);
  a[0][1] = MulBf16x2(E2m1PairScaledDown<0>(w.hi.x), m_hi);
  a[0][2] = MulBf16x2(E2m1PairScaledDown<0>(w.lo.y), m_lo);
  a[0][3] = MulBf16x2(E2m1PairScaledDown<0>(w.hi.y), m_hi);
  a[1][0] = MulBf16x2(E2m1PairScaledDown<1>(w.lo.x), m_lo);
  a[1][1] = MulBf16x2(E2m1PairScaledDown<1>(w.hi.x), m_hi);
  a[1][2] = MulBf16x2(E2m1PairScaledDown<1>(w.lo.y), m_lo);
  a[1][3] = MulBf16x2(E2m1PairScaledDown<1>(w.hi.y), m_hi);
  a[2][0] = MulBf16x2(E2m1PairScaledDown<2>(w.lo.x), m_lo);
  a[2][1] = MulBf16x2(E2m1PairScaledDown<2>(w.hi.x), m_hi);
  a[2][2] = MulBf16x2(E2m1PairScaledDown<2>(w.lo.y), m_lo);
  a[2][3] = MulBf16x2(E2m1PairScaledDown<2>(w.hi.y), m_hi);
  a[3][0] = MulBf16x2(E2m1PairScaledDown<3>(w.lo.x), m_lo);
  a[3][1] = MulBf16x2(E2m1PairScaledDown<3>(w.hi.x), m_hi);
  a[3][2] = MulBf16x2(E2m1PairScaledDown<3>(w.lo.y), m_lo);
  a[3][3] = MulBf16x2(E2m1PairScaledDown<3>(w.hi.y), m_hi);
  // Scales above 128 need a second exact multiply; one vote a step keeps
  // that work off the common path (warp-uniform branch).
  if (__any_sync(0xffffffffu, max(w.scale_lo, w.scale_hi) > 128)) {
    const uint32_t second_lo = SecondMultiplier(w.scale_lo);
    const uint32_t second_hi = SecondMultiplier(w.scale_hi);
#pragma unroll
    for (int s = 0; s < 4; ++s) {
      a[s][0] = MulBf16x2(a[s][0], second_lo);
      a[s][1] = MulBf16x2(a[s][1], second_hi);
      a[s][2] = MulBf16x2(a[s][2], second_lo);
      a[s][3] = MulBf16x2(a[s][3], second_hi);
    }
  }
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    uint4 p;
    uint4 q;
    if constexpr (kRingX) {
      p = w.x[nt][0];
      q = w.x[nt][1];
    } else {
      const auto* xp = reinterpret_cast<const uint4*>(c.x[nt] + step * kMxfp4KStep);
      p = __ldg(xp);
      q = __ldg(xp + 1);
    }
    // p holds K 16 t + 0..7 as bf16 pairs, q K 16 t + 8..15.
    Mma(acc[nt], a[0], p.x, q.x);
    Mma(acc[nt], a[1], p.y, q.y);
    Mma(acc[nt], a[2], p.z, q.z);
    Mma(acc[nt], a[3], p.w, q.w);
  }
}

__device__ __forceinline__ float BiasOf(const uint16_t* bias, int64_t index) {
  return bias == nullptr ? 0.0f : __bfloat162float(__ushort_as_bfloat16(__ldg(bias + index)));
}

// What a thread's chunks share: its warp's rows of the expert's matrix.
struct LaneRows {
  int t;       // lane % 4
  int g;       // lane / 4
  int col_lo;  // output column(s) of this lane (see the kernel)
  int col_hi;
  int row_lo;  // the weight rows it reads (clamped into the matrix)
  int row_hi;
  int64_t expert_row;  // the expert's first weight row
};

// One chunk of kTiles * 8 tokens from row `chunk` of A (rows at or past
// `end` are clamped for loads and not stored). kGlu: gpt-oss's gate_up +
// clamped SwiGLU (lane g's rows are gate 2j and up 2j + 1 of feature j, so
// one thread holds both halves of its outputs); else the plain GEMM with
// bias. kDepth: the ring of steps in registers; a slot is refilled right
// after its step is multiplied (so the load lands in the registers just
// read, with no copies that would wait on it), kDepth - 1 steps ahead.
// kRingX: the activations ride in the ring too (their L2 latency, exposed,
// was the largest stall), else they are loaded at use.
template <int kTiles, int kDepth, bool kGlu, bool kRingX>
__device__ __forceinline__ void MultiplyChunk(const KernelArgs& args, const LaneRows& r, int chunk,
                                              int end) {
  const int t = r.t;
  const int n = args.n;
  const int64_t row_bytes = args.k / 2;
  const int64_t row_blocks = args.k / core::quant::kMxfp4Block;
  const int steps = args.k / kMxfp4KStep;
  Cursor<kTiles> c;
  c.w_lo = args.blocks + (r.expert_row + r.row_lo) * row_bytes + 8 * t;
  c.w_hi = args.blocks + (r.expert_row + r.row_hi) * row_bytes + 8 * t;
  c.s_lo = args.scales + (r.expert_row + r.row_lo) * row_blocks + t / 2;
  c.s_hi = args.scales + (r.expert_row + r.row_hi) * row_blocks + t / 2;
  // Lane g reads token chunk + 8 nt + g (clamped; its outputs are not stored).
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    const int row = min(chunk + kTokensPerTile * nt + r.g, end - 1);
    c.x[nt] = args.a + static_cast<int64_t>(row) * args.k + 16 * t;
  }
  float acc[kTiles][4];
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[nt][i] = 0.0f;
  }
  StepOperands<kTiles, kRingX> ring[kDepth];
#pragma unroll
  for (int d = 0; d < kDepth; ++d) ring[d] = Load<kTiles, kRingX>(c, min(d, steps - 1));
  // Steps [s0, s0 + kDepth) with every refill inside the matrix...
  int s0 = 0;
  for (; s0 + 2 * kDepth <= steps; s0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      MultiplyStep(ring[d], c, d, acc);
      ring[d] = Load<kTiles, kRingX>(c, d + kDepth);
    }
    c.Advance(kDepth);
  }
  // ...then the last (at most 2 kDepth - 1) steps, refilling while any is left.
  for (; s0 < steps; s0 += kDepth) {
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (s0 + d < steps) {
        MultiplyStep(ring[d], c, d, acc);
        if (s0 + d + kDepth < steps) ring[d] = Load<kTiles, kRingX>(c, d + kDepth);
      }
    }
    c.Advance(kDepth);
  }
  // acc[nt]: {row lo, row hi} x {token 2t, 2t + 1} of the tile.
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int token = chunk + kTokensPerTile * nt + 2 * t + i;
      if (token >= end) continue;
      if (kGlu) {
        if (r.col_lo >= n) continue;
        const float gate = acc[nt][i] + BiasOf(args.bias, r.expert_row + r.row_lo);
        const float up = acc[nt][2 + i] + BiasOf(args.bias, r.expert_row + r.row_hi);
        const float h = core::quant::GptOssGlu(gate, up, args.alpha, args.limit);
        static_cast<uint16_t*>(args.out)[static_cast<int64_t>(token) * n + r.col_lo] =
            __bfloat16_as_ushort(__float2bfloat16_rn(h));
      } else {
        float* y = static_cast<float*>(args.out) + static_cast<int64_t>(token) * n;
        if (r.col_lo < n) y[r.col_lo] = acc[nt][i] + BiasOf(args.bias, r.expert_row + r.col_lo);
        if (r.col_hi < n) {
          y[r.col_hi] = acc[nt][2 + i] + BiasOf(args.bias, r.expert_row + r.col_hi);
        }
      }
    }
  }
}

// A CTA: 64 weight rows of one expert times all of its rows of A, in chunks
// of kTiles * 8 tokens (MultiplyChunk). kPairChunks (kTiles 1 only): while
// more than 8 rows are left, one pass of 16 (activations loaded at use, so
// its registers stay within the 8-row pass's), rather than two passes over
// the weights. kMinCtas: __launch_bounds__'s minimum CTAs an SM (0: none).
template <int kTiles, int kDepth, bool kGlu, bool kRingX, bool kPairChunks, int kMinCtas>
__global__ void __launch_bounds__(kThreads, kMinCtas) Mxfp4GroupedKernel(KernelArgs args) {
  const int l = static_cast<int>(blockIdx.x) / args.tiles_per_expert;
  const int tile = static_cast<int>(blockIdx.x) % args.tiles_per_expert;
  const int begin = args.offsets[l];
  const int end = args.offsets[l + 1];
  if (begin >= end) return;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int n = args.n;
  LaneRows r;
  r.g = lane / 4;
  r.t = lane % 4;
  // Output column(s) of this lane: GLU feature j (rows 2j, 2j + 1); else
  // rows c and c + 8. Rows past the matrix are clamped for loads and not stored.
  r.col_lo = kGlu ? tile * (kRowsPerCta / 2) + warp * (kRowsPerWarp / 2) + r.g
                  : tile * kRowsPerCta + warp * kRowsPerWarp + r.g;
  r.col_hi = kGlu ? r.col_lo : r.col_lo + 8;
  r.row_lo = kGlu ? 2 * min(r.col_lo, n - 1) : min(r.col_lo, n - 1);
  r.row_hi = kGlu ? r.row_lo + 1 : min(r.col_hi, n - 1);
  r.expert_row = static_cast<int64_t>(l) * (kGlu ? 2 * n : n);
  int chunk = begin;
  if constexpr (kTiles == 1 && kPairChunks) {
    for (; end - chunk > kTokensPerTile; chunk += 2 * kTokensPerTile) {
      MultiplyChunk<2, kDepth, kGlu, false>(args, r, chunk, end);
    }
  }
  for (; chunk < end; chunk += kTokensPerTile * kTiles) {
    MultiplyChunk<kTiles, kDepth, kGlu, kRingX>(args, r, chunk, end);
  }
}

absl::Status CheckParams(const char* call, const Mxfp4GemmParams& p, const void* out) {
  constexpr int64_t kMax = std::numeric_limits<int32_t>::max();
  if (p.a == nullptr || p.blocks == nullptr || p.scales == nullptr || p.offsets == nullptr ||
      out == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: a, blocks, scales, offsets and the output must be device pointers", call));
  }
  if (reinterpret_cast<uintptr_t>(p.a) % 16 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: a must be 16-byte aligned", call));
  }
  if (p.k < kMxfp4KStep || p.k % kMxfp4KStep != 0 || p.n < 1 || p.max_rows < 0 ||
      p.num_local_experts < 0 || p.max_rows > kMax || 2 * p.n > kMax || p.k > kMax) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: expected K a positive multiple of %d (got %d), n >= 1 (got %d), max_rows >= 0 (got "
        "%d) and L >= 0 (got %d), all within int32",
        call, kMxfp4KStep, p.k, p.n, p.max_rows, p.num_local_experts));
  }
  if (p.tile_tokens != 0 && p.tile_tokens != 1 && p.tile_tokens != 2 && p.tile_tokens != 4 &&
      p.tile_tokens != 8) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: tile_tokens expected 0, 1, 2, 4 or 8, got %d", call, p.tile_tokens));
  }
  if (p.prefetch_steps != 0 && (p.prefetch_steps < 3 || p.prefetch_steps > 6)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: prefetch_steps expected 0, 3, 4, 5 or 6, got %d", call, p.prefetch_steps));
  }
  if (p.min_ctas_per_sm != 0 && p.min_ctas_per_sm != 1 && p.min_ctas_per_sm != 4 &&
      p.min_ctas_per_sm != 5) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "%s: min_ctas_per_sm expected 0, 1, 4 or 5, got %d", call, p.min_ctas_per_sm));
  }
  return absl::OkStatus();
}

int PickTiles(const Mxfp4GemmParams& p) {
  if (p.tile_tokens != 0) return p.tile_tokens;
  const int64_t rows = (p.max_rows + p.num_local_experts - 1) / p.num_local_experts;
  if (rows <= 8) return 1;
  if (rows <= 16) return 2;
  if (rows <= 32) return 4;
  return 8;
}

// Measured on an H100 at gpt-oss-120b's shape (bench/results/run22): at 128
// tokens (chunks of 8, activations in the ring) depth 4 beats 3 and 6 for
// both GEMMs together (737 vs 755 and 810 µs, call 2); each GEMM alone
// (call 6, no 16-row passes), the GLU's depth 4 beats 3 (474 vs 496 µs; 5:
// 481, call 5) while the down projection's depth 3 (128 registers, 4 CTAs an
// SM) beats its 4 (149, 3 CTAs): 262 vs 272 µs. At 4096 tokens (chunks of
// 64) depth 6 beats 3 and 4 (6.35 vs 8.37 and 8.78 ms, call 2).
int PickDepth(int tiles, bool glu) {
  if (tiles == 1) return glu ? 4 : 3;
  return tiles <= 2 ? 4 : 6;
}

template <int kDepth, bool kGlu, bool kPairChunks, int kMinCtas>
void LaunchTiles(int tiles, bool ring_x, dim3 grid, const KernelArgs& args, cudaStream_t stream) {
  switch (tiles) {
    case 1:
      if (ring_x) {
        Mxfp4GroupedKernel<1, kDepth, kGlu, true, kPairChunks, kMinCtas>
            <<<grid, kThreads, 0, stream>>>(args);
      } else {
        Mxfp4GroupedKernel<1, kDepth, kGlu, false, kPairChunks, kMinCtas>
            <<<grid, kThreads, 0, stream>>>(args);
      }
      break;
    case 2:
      if (ring_x) {
        Mxfp4GroupedKernel<2, kDepth, kGlu, true, false, kMinCtas>
            <<<grid, kThreads, 0, stream>>>(args);
      } else {
        Mxfp4GroupedKernel<2, kDepth, kGlu, false, false, kMinCtas>
            <<<grid, kThreads, 0, stream>>>(args);
      }
      break;
    case 4:
      Mxfp4GroupedKernel<4, kDepth, kGlu, false, false, 0><<<grid, kThreads, 0, stream>>>(args);
      break;
    default:
      Mxfp4GroupedKernel<8, kDepth, kGlu, false, false, 0><<<grid, kThreads, 0, stream>>>(args);
      break;
  }
}

template <int kDepth, bool kGlu>
void LaunchCapped(int min_ctas, bool pair_chunks, int tiles, bool ring_x, dim3 grid,
                  const KernelArgs& args, cudaStream_t stream) {
  if (pair_chunks && tiles == 1) {
    switch (min_ctas) {
      case 4:
        return LaunchTiles<kDepth, kGlu, true, 4>(tiles, ring_x, grid, args, stream);
      default:
        return LaunchTiles<kDepth, kGlu, true, 0>(tiles, ring_x, grid, args, stream);
    }
  }
  switch (min_ctas) {
    case 4:
      return LaunchTiles<kDepth, kGlu, false, 4>(tiles, ring_x, grid, args, stream);
    case 5:
      return LaunchTiles<kDepth, kGlu, false, 5>(tiles, ring_x, grid, args, stream);
    default:
      return LaunchTiles<kDepth, kGlu, false, 0>(tiles, ring_x, grid, args, stream);
  }
}

template <bool kGlu>
absl::Status Launch(const char* call, const Mxfp4GemmParams& p, float alpha, float limit, void* out,
                    cudaStream_t stream) {
  if (absl::Status s = CheckParams(call, p, out); !s.ok()) return s;
  if (p.num_local_experts == 0 || p.max_rows == 0) return absl::OkStatus();
  const int64_t cols_per_cta = kGlu ? kRowsPerCta / 2 : kRowsPerCta;
  const int64_t tiles = (p.n + cols_per_cta - 1) / cols_per_cta;
  if (tiles * p.num_local_experts > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: %d experts x %d tiles exceed the grid",
                                                      call, p.num_local_experts, tiles));
  }
  KernelArgs args;
  args.a = p.a;
  args.blocks = p.blocks;
  args.scales = p.scales;
  args.bias = p.bias;
  args.offsets = p.offsets;
  args.n = static_cast<int>(p.n);
  args.k = static_cast<int>(p.k);
  args.tiles_per_expert = static_cast<int>(tiles);
  args.alpha = alpha;
  args.limit = limit;
  args.out = out;
  const dim3 grid(static_cast<unsigned>(tiles * p.num_local_experts));
  const int tiles_per_chunk = PickTiles(p);
  // The activations ride in the ring only for chunks of up to 16 tokens
  // (their registers grow with the tiles).
  const bool ring_x = tiles_per_chunk <= 2 && p.ring_activations >= 0;
  const int min_ctas = p.min_ctas_per_sm;
  const bool pair_chunks = p.pair_chunks >= 0;
  switch (p.prefetch_steps != 0 ? p.prefetch_steps : PickDepth(tiles_per_chunk, kGlu)) {
    case 3:
      LaunchCapped<3, kGlu>(min_ctas, pair_chunks, tiles_per_chunk, ring_x, grid, args, stream);
      break;
    case 4:
      LaunchCapped<4, kGlu>(min_ctas, pair_chunks, tiles_per_chunk, ring_x, grid, args, stream);
      break;
    case 5:
      LaunchCapped<5, kGlu>(min_ctas, pair_chunks, tiles_per_chunk, ring_x, grid, args, stream);
      break;
    default:
      LaunchCapped<6, kGlu>(min_ctas, pair_chunks, tiles_per_chunk, ring_x, grid, args, stream);
      break;
  }
  return internal::LaunchStatus(kGlu ? "Mxfp4GroupedGptOssGluKernel" : "Mxfp4GroupedGemmKernel");
}

}  // namespace

absl::Status LaunchMxfp4GroupedGptOssGlu(const Mxfp4GemmParams& params, float alpha, float limit,
                                         uint16_t* act, cudaStream_t stream) {
  return Launch<true>("LaunchMxfp4GroupedGptOssGlu", params, alpha, limit, act, stream);
}

absl::Status LaunchMxfp4GroupedGemm(const Mxfp4GemmParams& params, float* y, cudaStream_t stream) {
  return Launch<false>("LaunchMxfp4GroupedGemm", params, 0.0f, 0.0f, y, stream);
}

namespace {

// Where E2m1PairScaledDown<s> takes value 2 s (half 0) and 2 s + 1 (half 1)
// of a word from: the sign bit and the lowest of the three magnitude bits,
// within each 16-bit half.
constexpr int kPairSign[4] = {15, 9, 11, 10};
constexpr int kPairMagnitude[4] = {6, 0, 12, 3};

}  // namespace

void Mxfp4BlocksToDeviceOrder(uint8_t* blocks, int64_t bytes) {
  for (int64_t w = 0; w + 4 <= bytes; w += 4) {
    uint32_t in = 0;
    for (int b = 0; b < 4; ++b) in |= static_cast<uint32_t>(blocks[w + b]) << (8 * b);
    uint32_t out = 0;
    for (int v = 0; v < 8; ++v) {
      const uint32_t code = (in >> (4 * v)) & 0xfu;  // value v: the low nibble first
      const int half = 16 * (v % 2);
      out |= (code >> 3) << (half + kPairSign[v / 2]);
      out |= (code & 7u) << (half + kPairMagnitude[v / 2]);
    }
    for (int b = 0; b < 4; ++b) blocks[w + b] = static_cast<uint8_t>(out >> (8 * b));
  }
}

void Mxfp4BlocksFromDeviceOrder(uint8_t* blocks, int64_t bytes) {
  for (int64_t w = 0; w + 4 <= bytes; w += 4) {
    uint32_t in = 0;
    for (int b = 0; b < 4; ++b) in |= static_cast<uint32_t>(blocks[w + b]) << (8 * b);
    uint32_t out = 0;
    for (int v = 0; v < 8; ++v) {
      const int half = 16 * (v % 2);
      const uint32_t sign = (in >> (half + kPairSign[v / 2])) & 1u;
      const uint32_t magnitude = (in >> (half + kPairMagnitude[v / 2])) & 7u;
      out |= ((sign << 3) | magnitude) << (4 * v);
    }
    for (int b = 0; b < 4; ++b) blocks[w + b] = static_cast<uint8_t>(out >> (8 * b));
  }
}

const void* internal::Mxfp4GroupedGemmModule() {
  return reinterpret_cast<const void*>(&Mxfp4GroupedKernel<4, 4, false, false, false, 0>);
}

}  // namespace moe_ep::kernels
