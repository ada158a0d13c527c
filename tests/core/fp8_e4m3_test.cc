// The fp8 e4m3 contract of core/fp8_e4m3.h (issue 15 item 4), on hand-worked
// values: the largest normal 448 and saturation beyond it, subnormals,
// NaN, ties to even, and a whole block with its scale.
#include "core/fp8_e4m3.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "core/bf16.h"
#include "core/dispatch_rounding.h"

namespace moe_ep::core::fp8 {
namespace {

TEST(Fp8E4m3, LargestNormalAndSaturation) {
  EXPECT_EQ(E4m3FromFloat(448.0f), 0x7E);  // S.1111.110 = 1.75 * 2^8
  EXPECT_EQ(E4m3FromFloat(-448.0f), 0xFE);
  EXPECT_EQ(E4m3FromFloat(416.0f), 0x7D);  // 1.625 * 2^8
  // 464 is halfway between 448 (mantissa 110, even) and 480 (would be the
  // NaN pattern): ties to even keeps 448; anything larger saturates.
  EXPECT_EQ(E4m3FromFloat(464.0f), 0x7E);
  EXPECT_EQ(E4m3FromFloat(465.0f), 0x7E);
  EXPECT_EQ(E4m3FromFloat(1.0e6f), 0x7E);
  EXPECT_EQ(E4m3FromFloat(INFINITY), 0x7E);
  EXPECT_EQ(E4m3FromFloat(-INFINITY), 0xFE);
  EXPECT_EQ(E4m3ToFloat(0x7E), 448.0f);
  EXPECT_EQ(E4m3ToFloat(0xFE), -448.0f);
}

TEST(Fp8E4m3, OneAndTiesToEven) {
  EXPECT_EQ(E4m3FromFloat(1.0f), 0x38);  // exponent 7 (bias 7), mantissa 0
  EXPECT_EQ(E4m3ToFloat(0x38), 1.0f);
  // Between 1 (000) and 1.125 (001) the tie 1.0625 goes to the even 1.
  EXPECT_EQ(E4m3FromFloat(1.0625f), 0x38);
  // Between 1.125 (001) and 1.25 (010) the tie 1.1875 goes to the even 1.25.
  EXPECT_EQ(E4m3FromFloat(1.1875f), 0x3A);
  // Just above a tie rounds up, just below rounds down.
  EXPECT_EQ(E4m3FromFloat(std::nextafter(1.0625f, 2.0f)), 0x39);
  EXPECT_EQ(E4m3FromFloat(std::nextafter(1.1875f, 0.0f)), 0x39);
  // A tie whose rounding carries into the exponent: 1.9375 -> 2.
  EXPECT_EQ(E4m3FromFloat(1.9375f), 0x40);
  EXPECT_EQ(E4m3ToFloat(0x40), 2.0f);
}

TEST(Fp8E4m3, Subnormals) {
  // Smallest normal 2^-6 = 0x08; subnormals m * 2^-9, m = 1..7.
  EXPECT_EQ(E4m3FromFloat(std::ldexp(1.0f, -6)), 0x08);
  EXPECT_EQ(E4m3FromFloat(std::ldexp(1.0f, -9)), 0x01);
  EXPECT_EQ(E4m3FromFloat(std::ldexp(7.0f, -9)), 0x07);
  EXPECT_EQ(E4m3ToFloat(0x01), std::ldexp(1.0f, -9));
  EXPECT_EQ(E4m3ToFloat(0x07), std::ldexp(7.0f, -9));
  // 7.5 * 2^-9 ties between 7 (odd) and 8 (= 2^-6, even): rounds up into the normals.
  EXPECT_EQ(E4m3FromFloat(std::ldexp(7.5f, -9)), 0x08);
  // 2.5 * 2^-9 ties to the even 2; 3.5 * 2^-9 to the even 4.
  EXPECT_EQ(E4m3FromFloat(std::ldexp(2.5f, -9)), 0x02);
  EXPECT_EQ(E4m3FromFloat(std::ldexp(3.5f, -9)), 0x04);
  // Half the smallest subnormal ties to zero; a little more rounds to it.
  EXPECT_EQ(E4m3FromFloat(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(E4m3FromFloat(std::ldexp(1.5f, -10)), 0x01);
  EXPECT_EQ(E4m3FromFloat(-std::ldexp(1.0f, -11)), 0x80);  // signed zero
  EXPECT_EQ(E4m3FromFloat(1e-40f), 0x00);                  // a float subnormal
  EXPECT_EQ(E4m3FromFloat(-0.0f), 0x80);
  EXPECT_EQ(E4m3ToFloat(0x80), 0.0f);
  EXPECT_TRUE(std::signbit(E4m3ToFloat(0x80)));
}

TEST(Fp8E4m3, NaN) {
  EXPECT_EQ(E4m3FromFloat(NAN), 0x7F);
  EXPECT_EQ(E4m3FromFloat(-NAN), 0x7F);  // sign cleared, as CUDA's conversion
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0x7F)));
  EXPECT_TRUE(std::isnan(E4m3ToFloat(0xFF)));
}

TEST(Fp8E4m3, EveryCodeRoundTrips) {
  for (int c = 0; c < 256; ++c) {
    const uint8_t code = static_cast<uint8_t>(c);
    if ((code & 0x7F) == 0x7F) continue;  // NaN
    EXPECT_EQ(E4m3FromFloat(E4m3ToFloat(code)), code) << "code " << c;
  }
}

// A block whose amax is 3.5: scale 3.5 / 448 = 1/128, so x / scale = 128 x.
TEST(Fp8E4m3, BlockScaleAndRow) {
  std::vector<bf16_t> row(256, FloatToBf16(0.0f));
  row[0] = FloatToBf16(3.5f);     // -> 448, code 0x7E
  row[1] = FloatToBf16(-1.0f);    // -> -128 = 1.0 * 2^7: exponent 14, code 0xF0
  row[2] = FloatToBf16(0.0625f);  // -> 8 = 2^3, code 0x50
  // 1.0625 / 128 * 128 = 1.0625 ties to 1.
  row[3] = FloatToBf16(1.0625f / 128.0f);
  // The second block is all zero: scale 1, every code 0.
  std::vector<uint8_t> codes(256);
  std::vector<float> scales(2);
  QuantizeRow(row.data(), 256, codes.data(), scales.data());
  EXPECT_EQ(scales[0], 3.5f / 448.0f);
  EXPECT_EQ(scales[0], 1.0f / 128.0f);
  EXPECT_EQ(scales[1], 1.0f);
  EXPECT_EQ(codes[0], 0x7E);
  EXPECT_EQ(codes[1], 0xF0);
  EXPECT_EQ(codes[2], 0x50);
  EXPECT_EQ(codes[3], 0x38);
  EXPECT_EQ(codes[4], 0x00);
  EXPECT_EQ(codes[200], 0x00);
  std::vector<bf16_t> back(256);
  DequantizeRow(codes.data(), scales.data(), 256, back.data());
  EXPECT_EQ(Bf16ToFloat(back[0]), 3.5f);
  EXPECT_EQ(Bf16ToFloat(back[1]), -1.0f);
  EXPECT_EQ(Bf16ToFloat(back[2]), 0.0625f);
  EXPECT_EQ(Bf16ToFloat(back[3]), 1.0f / 128.0f);  // the tie went to even
  EXPECT_EQ(Bf16ToFloat(back[200]), 0.0f);
}

// Over many bf16 values the rounding error stays within the contract's bound
// 2^-4 |x| + 2^-10 * scale (core/fp8_e4m3.h), and reaches a good part of it.
TEST(Fp8E4m3, ErrorWithinTheBound) {
  std::vector<bf16_t> row(128);
  double worst_ratio = 0.0;
  for (int trial = 0; trial < 64; ++trial) {
    for (int i = 0; i < 128; ++i) {
      const float x =
          std::ldexp(static_cast<float>((i * 37 + trial * 11) % 97) - 48.0f, (i + trial) % 13 - 8);
      row[i] = FloatToBf16(x);
    }
    std::vector<uint8_t> codes(128);
    float scale = 0.0f;
    QuantizeRow(row.data(), 128, codes.data(), &scale);
    std::vector<bf16_t> back(128);
    DequantizeRow(codes.data(), &scale, 128, back.data());
    for (int i = 0; i < 128; ++i) {
      const double x = Bf16ToFloat(row[i]);
      const double err = std::abs(static_cast<double>(E4m3ToFloat(codes[i])) * scale - x);
      const double bound = std::abs(x) / 16.0 + std::ldexp(static_cast<double>(scale), -10);
      EXPECT_LE(err, bound) << "trial " << trial << " value " << x;
      if (bound > 0) worst_ratio = std::max(worst_ratio, err / bound);
    }
  }
  EXPECT_GT(worst_ratio, 0.5);  // the bound is not loose by orders of magnitude
}

TEST(DispatchedHidden, Bf16IsIdentityFp8RoundsEveryRow) {
  std::vector<bf16_t> rows(2 * 128);
  for (int i = 0; i < 256; ++i) rows[i] = FloatToBf16(0.01f * static_cast<float>(i - 100));
  auto same = DispatchedHidden(DispatchDType::kBF16, rows, 2, 128);
  ASSERT_TRUE(same.ok());
  EXPECT_EQ(*same, rows);
  auto rounded = DispatchedHidden(DispatchDType::kFP8E4M3, rows, 2, 128);
  ASSERT_TRUE(rounded.ok());
  for (int t = 0; t < 2; ++t) {
    std::vector<uint8_t> codes(128);
    float scale = 0;
    QuantizeRow(rows.data() + t * 128, 128, codes.data(), &scale);
    for (int i = 0; i < 128; ++i) {
      EXPECT_EQ((*rounded)[t * 128 + i], DequantizeValue(codes[i], scale));
    }
  }
  EXPECT_NE(*rounded, rows);  // 3 mantissa bits cannot hold these values
  EXPECT_EQ(DispatchedHidden(DispatchDType::kFP8E4M3, rows, 4, 64).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DispatchedHidden(DispatchDType::kNVFP4, rows, 2, 128).status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DispatchedHidden(DispatchDType::kBF16, rows, 3, 128).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace moe_ep::core::fp8
