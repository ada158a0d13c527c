#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <limits>

#include "absl/strings/str_format.h"
#include "core/quantized_formats.h"
#include "kernels/internal/cuda_status.h"
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
// Steps whose weights are loaded ahead of the one being multiplied
// (Mxfp4GemmParams::prefetch_steps; 0 picks PickDepth).

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

// One step of a thread's two weight rows: 8 bytes (16 e2m1 values, K
// 16 t .. 16 t + 15 of the step for lane t of its quad) and the E8M0 scale
// of the block they lie in.
struct StepWeights {
  uint2 lo;
  uint2 hi;
  uint32_t scale_lo;
  uint32_t scale_hi;
};

// The e2m1 values in nibbles 3 and 7 of q (the low and high half), as bf16
// times 2^-126: the sign to bit 15, the three magnitude bits under the
// exponent's two low bits and the mantissa's top bit, so the bf16 value is
// exactly e2m1 * 2^-126 (a subnormal for 0.5). Shifting q left by 4 r first
// gives nibbles 3 - r and 7 - r.
__device__ __forceinline__ uint32_t E2m1PairScaledDown(uint32_t q) {
  return (q & 0x80008000u) | ((q >> 6) & 0x01c001c0u);
}

// a * b + (-0) on two bf16 lanes: the product, rounded (exact here).
__device__ __forceinline__ uint32_t MulBf16x2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
  return d;
}

__device__ __forceinline__ uint32_t Bf16Pair(uint32_t bits) { return bits | (bits << 16); }

// The multipliers taking E2m1PairScaledDown's value to e2m1 * 2^(s - 127):
// one, 2^(s - 1), for s <= 128 (a normal bf16); else 2^126 then 2^(s - 127)
// (NaN for s = 255, OCP MX's E8M0 NaN), flagged by `twice`.
struct Multipliers {
  uint32_t first;
  uint32_t second;
  bool twice;
};

__device__ __forceinline__ Multipliers MultipliersOf(uint32_t s) {
  Multipliers m;
  m.twice = s > 128;
  m.first = Bf16Pair(m.twice ? 0x7e80u : (s + 126u) << 7);
  m.second = s == 255 ? 0x7fc07fc0u : Bf16Pair(s << 7);
  return m;
}

__device__ __forceinline__ uint32_t Dequantize(uint32_t q, const Multipliers& m) {
  uint32_t v = MulBf16x2(E2m1PairScaledDown(q), m.first);
  if (m.twice) v = MulBf16x2(v, m.second);
  return v;
}

__device__ __forceinline__ uint32_t Prmt(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(selector));
  return d;
}

__device__ __forceinline__ void Mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ StepWeights LoadStep(const uint8_t* lo, const uint8_t* hi,
                                                const uint8_t* scale_lo, const uint8_t* scale_hi,
                                                int step) {
  StepWeights w;
  w.lo = __ldg(reinterpret_cast<const uint2*>(lo + static_cast<int64_t>(step) * kStepBytes));
  w.hi = __ldg(reinterpret_cast<const uint2*>(hi + static_cast<int64_t>(step) * kStepBytes));
  w.scale_lo = __ldg(scale_lo + step * kStepBlocks);
  w.scale_hi = __ldg(scale_hi + step * kStepBlocks);
  return w;
}

// One K step (64) of a warp: its 16 weight rows times every token tile.
// The K order inside the step is permuted the same way on both operands:
// logical k 2t + c of MMA sub-step s is K 16 t + (3 - s, 7 - s)[c] of the
// step, and 8 + 2t + c is 16 t + 8 + (3 - s, 7 - s)[c], so lane t's 8 bytes
// of each row and 32 bytes of each token are all it reads.
template <int kTiles>
__device__ __forceinline__ void MultiplyStep(const StepWeights& w, int step,
                                             const uint16_t* const (&x)[kTiles], int t,
                                             float (&acc)[kTiles][4]) {
  const Multipliers m_lo = MultipliersOf(w.scale_lo);
  const Multipliers m_hi = MultipliersOf(w.scale_hi);
  uint32_t a[4][4];
#pragma unroll
  for (int s = 0; s < 4; ++s) {
    a[s][0] = Dequantize(w.lo.x << (4 * s), m_lo);
    a[s][1] = Dequantize(w.hi.x << (4 * s), m_hi);
    a[s][2] = Dequantize(w.lo.y << (4 * s), m_lo);
    a[s][3] = Dequantize(w.hi.y << (4 * s), m_hi);
  }
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
    const auto* xp =
        reinterpret_cast<const uint4*>(x[nt] + static_cast<int64_t>(step) * kMxfp4KStep + 16 * t);
    const uint4 p = __ldg(xp);
    const uint4 q = __ldg(xp + 1);
    // p holds K 16t + 0..7 as bf16 pairs (x0 x1 | x2 x3 | x4 x5 | x6 x7), q 8..15.
    Mma(acc[nt], a[0], Prmt(p.y, p.w, 0x7632), Prmt(q.y, q.w, 0x7632));  // (3, 7)
    Mma(acc[nt], a[1], Prmt(p.y, p.w, 0x5410), Prmt(q.y, q.w, 0x5410));  // (2, 6)
    Mma(acc[nt], a[2], Prmt(p.x, p.z, 0x7632), Prmt(q.x, q.z, 0x7632));  // (1, 5)
    Mma(acc[nt], a[3], Prmt(p.x, p.z, 0x5410), Prmt(q.x, q.z, 0x5410));  // (0, 4)
  }
}

__device__ __forceinline__ float BiasOf(const uint16_t* bias, int64_t index) {
  return bias == nullptr ? 0.0f : __bfloat162float(__ushort_as_bfloat16(__ldg(bias + index)));
}

// kGlu: gpt-oss's gate_up + clamped SwiGLU (lane g's rows are gate 2j and up
// 2j + 1 of feature j, so one thread holds both halves of its outputs); else
// the plain GEMM with bias.
template <int kTiles, int kDepth, bool kGlu>
__global__ void __launch_bounds__(kThreads) Mxfp4GroupedKernel(KernelArgs args) {
  const int l = static_cast<int>(blockIdx.x) / args.tiles_per_expert;
  const int tile = static_cast<int>(blockIdx.x) % args.tiles_per_expert;
  const int begin = args.offsets[l];
  const int end = args.offsets[l + 1];
  if (begin >= end) return;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int g = lane / 4;
  const int t = lane % 4;
  const int n = args.n;
  const int b_rows = kGlu ? 2 * n : n;
  // Output column(s) of this lane: GLU feature j (rows 2j, 2j + 1); else
  // rows r and r + 8. Rows past the matrix are clamped for loads and not stored.
  const int col_lo = kGlu ? tile * (kRowsPerCta / 2) + warp * (kRowsPerWarp / 2) + g
                          : tile * kRowsPerCta + warp * kRowsPerWarp + g;
  const int col_hi = kGlu ? col_lo : col_lo + 8;
  const int row_lo = kGlu ? 2 * min(col_lo, n - 1) : min(col_lo, n - 1);
  const int row_hi = kGlu ? row_lo + 1 : min(col_hi, n - 1);
  const int64_t row_bytes = args.k / 2;
  const int64_t row_blocks = args.k / core::quant::kMxfp4Block;
  const int64_t expert_row = static_cast<int64_t>(l) * b_rows;
  const uint8_t* w_lo = args.blocks + (expert_row + row_lo) * row_bytes + 8 * t;
  const uint8_t* w_hi = args.blocks + (expert_row + row_hi) * row_bytes + 8 * t;
  const uint8_t* s_lo = args.scales + (expert_row + row_lo) * row_blocks + t / 2;
  const uint8_t* s_hi = args.scales + (expert_row + row_hi) * row_blocks + t / 2;
  const int steps = args.k / kMxfp4KStep;

  for (int chunk = begin; chunk < end; chunk += kTokensPerTile * kTiles) {
    // Lane g reads token chunk + 8 nt + g (clamped; its outputs are not stored).
    const uint16_t* x[kTiles];
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      const int row = min(chunk + kTokensPerTile * nt + g, end - 1);
      x[nt] = args.a + static_cast<int64_t>(row) * args.k;
    }
    float acc[kTiles][4];
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
      for (int c = 0; c < 4; ++c) acc[nt][c] = 0.0f;
    }
    StepWeights ring[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      if (d < steps) ring[d] = LoadStep(w_lo, w_hi, s_lo, s_hi, d);
    }
    for (int s0 = 0; s0 < steps; s0 += kDepth) {
#pragma unroll
      for (int d = 0; d < kDepth; ++d) {
        const int step = s0 + d;
        if (step < steps) {
          const StepWeights w = ring[d];
          if (step + kDepth < steps) ring[d] = LoadStep(w_lo, w_hi, s_lo, s_hi, step + kDepth);
          MultiplyStep<kTiles>(w, step, x, t, acc);
        }
      }
    }
    // acc[nt]: {row lo, row hi} x {token 2t, 2t + 1} of the tile.
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int token = chunk + kTokensPerTile * nt + 2 * t + c;
        if (token >= end) continue;
        if (kGlu) {
          if (col_lo >= n) continue;
          const float gate = acc[nt][c] + BiasOf(args.bias, expert_row + row_lo);
          const float up = acc[nt][2 + c] + BiasOf(args.bias, expert_row + row_hi);
          const float h = core::quant::GptOssGlu(gate, up, args.alpha, args.limit);
          static_cast<uint16_t*>(args.out)[static_cast<int64_t>(token) * n + col_lo] =
              __bfloat16_as_ushort(__float2bfloat16_rn(h));
        } else {
          float* y = static_cast<float*>(args.out) + static_cast<int64_t>(token) * n;
          if (col_lo < n) y[col_lo] = acc[nt][c] + BiasOf(args.bias, expert_row + col_lo);
          if (col_hi < n) y[col_hi] = acc[nt][2 + c] + BiasOf(args.bias, expert_row + col_hi);
        }
      }
    }
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
  if (p.prefetch_steps != 0 && p.prefetch_steps != 3 && p.prefetch_steps != 6) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: prefetch_steps expected 0, 3 or 6, got %d", call, p.prefetch_steps));
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

// Measured on an H100 at gpt-oss-120b's shape (bench/results/run21): at 1
// and 128 tokens (chunks of 8) depth 3 beats 6 and 8 (1058 vs 1193 and 1384
// µs for both GEMMs at 128 tokens: more registers cost more warps than the
// deeper prefetch gains); at 4096 tokens (chunks of 64) depth 6 beats 3
// (7.6 vs 11.5 ms).
int PickDepth(int tiles) { return tiles <= 2 ? 3 : 6; }

template <int kDepth, bool kGlu>
void LaunchTiles(int tiles, dim3 grid, const KernelArgs& args, cudaStream_t stream) {
  switch (tiles) {
    case 1:
      Mxfp4GroupedKernel<1, kDepth, kGlu><<<grid, kThreads, 0, stream>>>(args);
      break;
    case 2:
      Mxfp4GroupedKernel<2, kDepth, kGlu><<<grid, kThreads, 0, stream>>>(args);
      break;
    case 4:
      Mxfp4GroupedKernel<4, kDepth, kGlu><<<grid, kThreads, 0, stream>>>(args);
      break;
    default:
      Mxfp4GroupedKernel<8, kDepth, kGlu><<<grid, kThreads, 0, stream>>>(args);
      break;
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
  switch (p.prefetch_steps != 0 ? p.prefetch_steps : PickDepth(tiles_per_chunk)) {
    case 3:
      LaunchTiles<3, kGlu>(tiles_per_chunk, grid, args, stream);
      break;
    default:
      LaunchTiles<6, kGlu>(tiles_per_chunk, grid, args, stream);
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

}  // namespace moe_ep::kernels
