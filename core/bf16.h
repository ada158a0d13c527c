#pragma once

// bfloat16 <-> float conversion for host code. bf16 is stored as uint16_t (the
// upper half of an IEEE-754 float32). Rounding is round-to-nearest-even, as
// PyTorch and CUDA's __float2bfloat16 do; NaN stays NaN.

#include <cstdint>
#include <cstring>

namespace moe_ep::core {

using bf16_t = uint16_t;

// Returns the float value of a bf16 bit pattern. Exact.
inline float Bf16ToFloat(bf16_t v) {
  uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Returns `f` rounded to the nearest bf16 (ties to even).
inline bf16_t FloatToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<bf16_t>((bits >> 16) | 0x40u);  // NaN
  uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<bf16_t>((bits + rounding) >> 16);
}

}  // namespace moe_ep::core
