#include "core/seeded_stream.h"

#include <cstdint>

#include "core/bf16.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

// The first output of SplitMix64 seeded with 0, as published with the
// algorithm (Vigna's splitmix64.c reference output).
TEST(SplitMix64, MatchesPublishedFirstOutput) {
  EXPECT_EQ(SplitMix64(0), 0xe220a8397b1dcdafull);
  // The generator's second output is the step from state golden.
  EXPECT_EQ(SplitMix64(kSeededGolden), 0x6e789e6aa1b965f4ull);
}

TEST(SeededUniformFor, ScaleIsInverseSqrtOfFanInAndStepSplitsRangeIn2To24Levels) {
  const SeededUniform u = SeededUniformFor(4);
  EXPECT_EQ(u.scale, 0.5f);
  EXPECT_EQ(u.step, 1.0f / 16777216.0f);  // 2 * 0.5 / 2^24
  EXPECT_EQ(SeededUniformFor(1).scale, 1.0f);
}

// Hand-worked levels with scale 0.5, step 2^-24: v * step - 0.5.
TEST(SeededLevelToBf16, MapsLevelsOntoMinusScaleToScale) {
  const SeededUniform u = SeededUniformFor(4);
  EXPECT_EQ(SeededLevelToBf16(0, u), 0xbf00);               // -0.5
  EXPECT_EQ(SeededLevelToBf16(1u << 23, u), 0x0000);        // 0.0
  EXPECT_EQ(SeededLevelToBf16(3u << 22, u), 0x3e80);        // 0.25
  EXPECT_EQ(SeededLevelToBf16((1u << 24) - 1, u), 0x3f00);  // 0.5 - 2^-24 rounds to 0.5
  EXPECT_EQ(SeededLevelToBf16((1u << 22) + 1, u), FloatToBf16(-0.25f + 1.0f / 16777216.0f));
}

// Round to nearest even on the bf16 boundary, as core::FloatToBf16 for finite values.
TEST(SeededFiniteToBf16, AgreesWithFloatToBf16OnFiniteValues) {
  for (float f : {0.0f, -0.0f, 1.0f, 1.00390625f, 1.01171875f, -3.14159f, 1e-30f, 3e38f}) {
    EXPECT_EQ(SeededFiniteToBf16(f), FloatToBf16(f)) << f;
  }
  EXPECT_EQ(SeededFiniteToBf16(1.00390625f), 0x3f80);  // 1 + 2^-8: tie, stays even (1.0)
  EXPECT_EQ(SeededFiniteToBf16(1.01171875f), 0x3f82);  // 1 + 3 * 2^-8: tie, rounds up to even
}

TEST(SeededPair, HalvesAreTopAndNext24BitsOfOneStreamOutput) {
  const SeededUniform u = SeededUniformFor(64);
  const uint64_t key = SeededTensorKey(1, 0, 0, SeededProjection::kGate);
  for (uint64_t c : {0ull, 1ull, 12345ull}) {
    const uint64_t r = SplitMix64(key + c * kSeededGolden);
    const SeededBf16Pair p = SeededPair(key, c, u);
    EXPECT_EQ(p.first, SeededLevelToBf16(static_cast<uint32_t>(r >> 40), u));
    EXPECT_EQ(p.second, SeededLevelToBf16(static_cast<uint32_t>((r >> 8) & 0xffffff), u));
    EXPECT_EQ(SeededElement(key, 2 * c, u), p.first);
    EXPECT_EQ(SeededElement(key, 2 * c + 1, u), p.second);
  }
}

TEST(SeededTensorKey, DiffersAcrossEveryArgument) {
  const uint64_t k = SeededTensorKey(1, 2, 3, SeededProjection::kUp);
  EXPECT_EQ(k, SeededTensorKey(1, 2, 3, SeededProjection::kUp));
  EXPECT_NE(k, SeededTensorKey(2, 2, 3, SeededProjection::kUp));
  EXPECT_NE(k, SeededTensorKey(1, 3, 3, SeededProjection::kUp));
  EXPECT_NE(k, SeededTensorKey(1, 2, 4, SeededProjection::kUp));
  EXPECT_NE(k, SeededTensorKey(1, 2, 3, SeededProjection::kDown));
  // Key chain of the definition, spelled out.
  uint64_t expect = SplitMix64(1 ^ 0x6d6f652d65702d77ull);
  expect = SplitMix64(expect ^ 2);
  expect = SplitMix64(expect ^ 3);
  EXPECT_EQ(k, SplitMix64(expect ^ 2));
}

}  // namespace
}  // namespace moe_ep::core
