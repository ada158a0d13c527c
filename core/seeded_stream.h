#pragma once

// The counter-based stream behind seeded expert weights (core/experts.h),
// shared by the host generator (core/experts.cc) and the device generator
// (kernels/seeded_weights.cuh) so both produce the same bits.
//
// Each tensor (one projection of one expert of one layer) gets a 64-bit key
// mixed from (seed, layer, expert, projection). Pair c of a tensor is
// r = SplitMix64(key + c * kSeededGolden); element 2c takes the top 24 bits of
// r (r >> 40) and element 2c + 1 the next 24 bits ((r >> 8) & 0xffffff). A
// 24-bit level v becomes the float v * step - scale with
// step = 2 * scale / 2^24 and scale = 1 / sqrt(fan_in), i.e. uniform in
// [-scale, scale), rounded to bf16 (round to nearest even, no NaN branch: the
// values are finite). Element i therefore depends only on (key, i), never on
// which other tensors a process generates or in which order.
//
// This header has no CUDA dependency: MOE_EP_HOST_DEVICE expands to
// `__host__ __device__` under nvcc and to nothing otherwise, so core/ stays
// CUDA-free. On the device, v * step - scale is computed with __fmul_rn and
// __fsub_rn so nvcc cannot contract it into an FMA (which rounds once, not
// twice, and would change bits); the host compiler does not contract it for
// the default x86-64 target (no FMA instructions), matching the bits the
// generator has always produced.
//
// Pure and thread-safe. Source: DESIGN §7 (seeded experts); issue 3 (seeded
// generation on the device).
// Example: SplitMix64(0) = 0xe220a8397b1dcdaf (the published SplitMix64 value).

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOE_EP_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_HOST_DEVICE
#endif

namespace moe_ep::core {

// The golden-ratio increment of SplitMix64, also the counter stride.
inline constexpr uint64_t kSeededGolden = 0x9e3779b97f4a7c15ull;

// Projection ids mixed into a tensor key. The biases are gpt-oss's
// (core/quantized_weights.h GenerateGptOssExpert): gate_up_proj_bias [2I],
// down_proj_bias [H].
enum class SeededProjection : uint64_t {
  kGate = 1,
  kUp = 2,
  kDown = 3,
  kGateUpBias = 4,
  kDownBias = 5
};

// SplitMix64 (Steele, Lea, Flood 2014): one step of the generator whose
// state is `x`, i.e. the output for state x + golden.
MOE_EP_HOST_DEVICE inline uint64_t SplitMix64(uint64_t x) {
  x += kSeededGolden;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Key of tensor (seed, layer, expert, projection). Layer and expert enter as
// their 32-bit two's-complement patterns.
MOE_EP_HOST_DEVICE inline uint64_t SeededTensorKey(uint64_t seed, int layer, int expert,
                                                   SeededProjection proj) {
  uint64_t k = SplitMix64(seed ^ 0x6d6f652d65702d77ull);  // "moe-ep-w"
  k = SplitMix64(k ^ static_cast<uint64_t>(static_cast<uint32_t>(layer)));
  k = SplitMix64(k ^ static_cast<uint64_t>(static_cast<uint32_t>(expert)));
  return SplitMix64(k ^ static_cast<uint64_t>(proj));
}

// The range of a tensor with `fan_in` inputs: values v * step - scale for
// 24-bit levels v.
struct SeededUniform {
  float scale = 0.0f;  // 1 / sqrt(fan_in)
  float step = 0.0f;   // 2 * scale / 2^24
};

// Host only (launchers compute it once and pass it to kernels).
// REQUIRES: fan_in >= 1.
inline SeededUniform SeededUniformFor(int64_t fan_in) {
  SeededUniform u;
  u.scale = 1.0f / std::sqrt(static_cast<float>(fan_in));
  u.step = 2.0f * u.scale / 16777216.0f;  // 2^24 levels over [-s, s)
  return u;
}

// bf16 bit pattern of a finite float, rounded to nearest even.
MOE_EP_HOST_DEVICE inline uint16_t SeededFiniteToBf16(float f) {
#if defined(__CUDA_ARCH__)
  const uint32_t bits = __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
#endif
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

// bf16 of level * step - scale (two roundings: product, then difference).
MOE_EP_HOST_DEVICE inline uint16_t SeededLevelToBf16(uint32_t level, SeededUniform u) {
#if defined(__CUDA_ARCH__)
  return SeededFiniteToBf16(__fsub_rn(__fmul_rn(static_cast<float>(level), u.step), u.scale));
#else
  return SeededFiniteToBf16(static_cast<float>(level) * u.step - u.scale);
#endif
}

// Elements 2 * pair and 2 * pair + 1 of tensor `key` (bf16 bit patterns).
struct SeededBf16Pair {
  uint16_t first;
  uint16_t second;
};

MOE_EP_HOST_DEVICE inline SeededBf16Pair SeededPair(uint64_t key, uint64_t pair, SeededUniform u) {
  const uint64_t r = SplitMix64(key + pair * kSeededGolden);
  return {SeededLevelToBf16(static_cast<uint32_t>(r >> 40), u),
          SeededLevelToBf16(static_cast<uint32_t>((r >> 8) & 0xffffffu), u)};
}

// Element `index` of tensor `key` (bf16 bit pattern); equals the matching
// half of SeededPair(key, index / 2, u).
MOE_EP_HOST_DEVICE inline uint16_t SeededElement(uint64_t key, uint64_t index, SeededUniform u) {
  const uint64_t r = SplitMix64(key + (index / 2) * kSeededGolden);
  const uint32_t level = (index % 2 == 0) ? static_cast<uint32_t>(r >> 40)
                                          : static_cast<uint32_t>((r >> 8) & 0xffffffu);
  return SeededLevelToBf16(level, u);
}

}  // namespace moe_ep::core
