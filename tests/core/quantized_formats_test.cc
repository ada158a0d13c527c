// The quantized-format contract of core/quantized_formats.h (issue 35) on
// hand-worked values: e2m1 and E8M0 decoding, the nibble order of a byte,
// OCP MX scale choice and e2m1 rounding, fp8 activation blocks (amax 0 and a
// ragged last block), the promotion step and gpt-oss's clamped SwiGLU.
#include "core/quantized_formats.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace moe_ep::core::quant {
namespace {

TEST(E2m1ToFloat, EveryCode) {
  const float expected[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                              -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  for (int c = 0; c < 16; ++c) {
    EXPECT_EQ(E2m1ToFloat(static_cast<uint8_t>(c)), expected[c]) << c;
    EXPECT_EQ(std::signbit(E2m1ToFloat(static_cast<uint8_t>(c))), c >= 8) << c;
  }
  EXPECT_EQ(E2m1ToFloat(0xF7), 6.0f);  // high bits ignored
}

TEST(E8m0ToFloat, PowersOfTwoAndNaN) {
  EXPECT_EQ(E8m0ToFloat(127), 1.0f);
  EXPECT_EQ(E8m0ToFloat(128), 2.0f);
  EXPECT_EQ(E8m0ToFloat(120), 1.0f / 128.0f);
  EXPECT_EQ(E8m0ToFloat(254), std::ldexp(1.0f, 127));
  EXPECT_EQ(E8m0ToFloat(1), std::ldexp(1.0f, -126));
  EXPECT_EQ(E8m0ToFloat(0), std::ldexp(1.0f, -127));  // subnormal, exact
  EXPECT_TRUE(std::isnan(E8m0ToFloat(255)));
}

TEST(Mxfp4Value, LowNibbleIsTheEvenElement) {
  // Byte 0 = 0x21: element 0 is code 1 (0.5), element 1 is code 2 (1.0).
  // Byte 15 = 0xF9: element 30 is code 9 (-0.5), element 31 code 15 (-6).
  std::vector<uint8_t> blocks(16, 0);
  blocks[0] = 0x21;
  blocks[15] = 0xF9;
  const std::vector<uint8_t> scales = {129};  // 2^2
  EXPECT_EQ(Mxfp4Nibble(blocks.data(), 0), 1);
  EXPECT_EQ(Mxfp4Nibble(blocks.data(), 1), 2);
  EXPECT_EQ(Mxfp4Value(blocks.data(), scales.data(), 32, 0, 0), 2.0f);
  EXPECT_EQ(Mxfp4Value(blocks.data(), scales.data(), 32, 0, 1), 4.0f);
  EXPECT_EQ(Mxfp4Value(blocks.data(), scales.data(), 32, 0, 2), 0.0f);
  EXPECT_EQ(Mxfp4Value(blocks.data(), scales.data(), 32, 0, 30), -2.0f);
  EXPECT_EQ(Mxfp4Value(blocks.data(), scales.data(), 32, 0, 31), -24.0f);
}

TEST(Mxfp4Value, RowsAndBlocksIndexTheScales) {
  // [2, 64]: two blocks a row; row 1 block 1 holds byte 0x70 (element 0 = 0,
  // element 1 = 6) with scale byte 125 (1/4).
  std::vector<uint8_t> blocks(2 * 2 * 16, 0);
  blocks[(1 * 2 + 1) * 16] = 0x70;
  const std::vector<uint8_t> scales = {127, 127, 127, 125};
  EXPECT_EQ(Mxfp4Value(blocks.data(), scales.data(), 64, 1, 32), 0.0f);
  EXPECT_EQ(Mxfp4Value(blocks.data(), scales.data(), 64, 1, 33), 1.5f);
}

TEST(E2m1FromFloat, GridTiesAndSaturation) {
  for (int c = 0; c < 16; ++c) {
    if (c == 8) continue;  // -0 encodes as 0x8 as well: checked below
    EXPECT_EQ(E2m1FromFloat(E2m1ToFloat(static_cast<uint8_t>(c))), c) << c;
  }
  EXPECT_EQ(E2m1FromFloat(-0.0f), 0x8);
  // Ties to the even code.
  EXPECT_EQ(E2m1FromFloat(0.25f), 0x0);
  EXPECT_EQ(E2m1FromFloat(0.75f), 0x2);
  EXPECT_EQ(E2m1FromFloat(1.25f), 0x2);
  EXPECT_EQ(E2m1FromFloat(1.75f), 0x4);
  EXPECT_EQ(E2m1FromFloat(2.5f), 0x4);
  EXPECT_EQ(E2m1FromFloat(3.5f), 0x6);
  EXPECT_EQ(E2m1FromFloat(5.0f), 0x6);
  // Off-tie values round to the nearest.
  EXPECT_EQ(E2m1FromFloat(0.26f), 0x1);
  EXPECT_EQ(E2m1FromFloat(5.01f), 0x7);
  EXPECT_EQ(E2m1FromFloat(-2.6f), 0xD);
  // Saturation.
  EXPECT_EQ(E2m1FromFloat(100.0f), 0x7);
  EXPECT_EQ(E2m1FromFloat(-INFINITY), 0xF);
}

TEST(Mxfp4ScaleFor, OcpSharedExponent) {
  EXPECT_EQ(Mxfp4ScaleFor(6.0f), 127);  // floor(log2 6) = 2 -> 2^0
  EXPECT_EQ(Mxfp4ScaleFor(4.0f), 127);
  EXPECT_EQ(Mxfp4ScaleFor(3.99f), 126);  // floor(log2) = 1 -> 2^-1
  EXPECT_EQ(Mxfp4ScaleFor(0.01f), 118);  // floor(log2 0.01) = -7 -> 2^-9
  EXPECT_EQ(Mxfp4ScaleFor(0.0f), 127);
  EXPECT_EQ(Mxfp4ScaleFor(INFINITY), 127);
  EXPECT_EQ(Mxfp4ScaleFor(std::ldexp(1.0f, -140)), 0);  // subnormal, clamped
  EXPECT_EQ(Mxfp4ScaleFor(std::ldexp(1.0f, 127)), 252);
}

TEST(Fp8QuantizeActivationRow, ScaleIsAmaxOver448) {
  std::vector<float> x(128, 0.0f);
  x[0] = 448.0f;
  x[1] = -224.0f;
  x[2] = 1.0f;
  std::vector<uint8_t> codes(128, 0xAA);
  float scale = 0.0f;
  Fp8QuantizeActivationRow(x.data(), 128, codes.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  EXPECT_EQ(codes[0], 0x7E);  // 448
  EXPECT_EQ(codes[1], 0xF6);  // -224 = -1.75 * 2^7
  EXPECT_EQ(codes[2], 0x38);  // 1
  EXPECT_EQ(codes[3], 0x00);

  // amax 7: scale 7/448 = 1/64; 7 -> 448, 3.5 -> 224.
  std::vector<float> y(128, 0.0f);
  y[5] = 7.0f;
  y[6] = 3.5f;
  Fp8QuantizeActivationRow(y.data(), 128, codes.data(), &scale);
  EXPECT_EQ(scale, 7.0f / 448.0f);
  EXPECT_EQ(codes[5], 0x7E);
  EXPECT_EQ(codes[6], 0x76);
}

TEST(Fp8QuantizeActivationRow, AllZeroBlockHasScaleOneAndZeroCodes) {
  std::vector<float> x(128, 0.0f);
  x[9] = -0.0f;
  std::vector<uint8_t> codes(128, 0xAA);
  float scale = 0.0f;
  Fp8QuantizeActivationRow(x.data(), 128, codes.data(), &scale);
  EXPECT_EQ(scale, 1.0f);
  for (int i = 0; i < 128; ++i) EXPECT_EQ(codes[i], i == 9 ? 0x80 : 0x00) << i;
}

TEST(Fp8QuantizeActivationRow, RaggedLastBlockHasItsOwnScale) {
  // K = 130: block 0 is channels 0..127 (amax 448), block 1 channels 128, 129
  // (amax 0.5: scale 0.5 / 448).
  std::vector<float> x(130, 1.0f);
  x[0] = 448.0f;
  x[128] = 0.5f;
  x[129] = -0.25f;
  std::vector<uint8_t> codes(130);
  float scales[2] = {0.0f, 0.0f};
  Fp8QuantizeActivationRow(x.data(), 130, codes.data(), scales);
  EXPECT_EQ(scales[0], 1.0f);
  EXPECT_EQ(scales[1], 0.5f / 448.0f);
  EXPECT_EQ(codes[128], 0x7E);
  EXPECT_EQ(codes[129], 0xF6);  // -224
  EXPECT_EQ(Fp8ScaleBlocks(130), 2);
  EXPECT_EQ(Fp8ScaleBlocks(128), 1);
  EXPECT_EQ(Fp8ScaleBlocks(7168), 56);
}

TEST(Fp8PromoteBlock, MultipliesTheScalesFirst) {
  // 1 + 3 * (0.5 * 0.25) = 1.375.
  EXPECT_EQ(Fp8PromoteBlock(1.0f, 3.0f, 0.5f, 0.25f), 1.375f);
  // The scale product rounds before p * s: with s_a = 1 + 783/4096 and
  // s_w = 1 + 329/4096, 3 * fl(s_a * s_w) and fl(3 * s_a) * s_w differ in
  // the last bit.
  const float sa = 1.0f + 783.0f / 4096.0f;
  const float sw = 1.0f + 329.0f / 4096.0f;
  EXPECT_EQ(Fp8PromoteBlock(0.0f, 3.0f, sa, sw), 0x1.ee256cp+1f);
  volatile float left = 3.0f * sa;  // the other order, for contrast
  EXPECT_NE(left * sw, 0x1.ee256cp+1f);
}

TEST(GptOssGlu, ClampsSigmoidAndPlusOne) {
  const auto reference = [](double g, double u) {
    g = std::min(g, 7.0);
    u = std::max(-7.0, std::min(u, 7.0));
    return (u + 1.0) * g / (1.0 + std::exp(-1.702 * g));
  };
  // gate 10 -> 7, up 10 -> 7: 8 * 7 * sigmoid(11.914).
  EXPECT_NEAR(GptOssGlu(10.0f, 10.0f, kGptOssAlpha, kGptOssSwiGluLimit), 55.99963, 1e-4);
  struct Case {
    float gate, up;
  };
  for (const Case c : {Case{10.0f, 10.0f}, Case{-10.0f, 0.5f}, Case{1.0f, -10.0f},
                       Case{0.3f, -1.0f}, Case{-0.7f, 2.0f}, Case{6.9f, -6.9f}}) {
    const double want = reference(c.gate, c.up);
    EXPECT_NEAR(GptOssGlu(c.gate, c.up, kGptOssAlpha, kGptOssSwiGluLimit), want,
                1e-6 * (std::abs(want) + 1e-3))
        << c.gate << ", " << c.up;
  }
  // The gate is not clamped from below; up + 1 can reach -6.
  EXPECT_LT(GptOssGlu(-10.0f, 0.0f, kGptOssAlpha, kGptOssSwiGluLimit), 0.0f);
  EXPECT_EQ(GptOssGlu(2.0f, -1.0f, kGptOssAlpha, kGptOssSwiGluLimit), 0.0f);
}

}  // namespace
}  // namespace moe_ep::core::quant
