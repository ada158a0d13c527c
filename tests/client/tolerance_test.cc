#include "client/tolerance.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using core::FloatToBf16;

std::vector<core::bf16_t> ToBf16(const std::vector<float>& v) {
  std::vector<core::bf16_t> out;
  out.reserve(v.size());
  for (float f : v) out.push_back(FloatToBf16(f));
  return out;
}

TEST(CompareToReference, ExactValuesPass) {
  const std::vector<float> ref = {1.0f, -2.0f, 0.5f};
  auto c = CompareToReference(ToBf16(ref), ref);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->max_abs_err, 0.0);
  EXPECT_EQ(c->max_abs_ref, 2.0);
  EXPECT_DOUBLE_EQ(c->bound, 2.0 / 64 + 1e-6);
  EXPECT_TRUE(c->pass);
  EXPECT_EQ(c->num_elements, 3);
}

TEST(CompareToReference, Bf16RoundingPasses) {
  // 1 + 2^-9 is not representable in bf16 (8 significand bits): it rounds to 1,
  // an error of 2^-9 = 0.001953125, within 2^-6 * 1.
  const std::vector<float> ref = {1.0f + 1.0f / 512, 0.25f};
  auto c = CompareToReference(ToBf16(ref), ref);
  ASSERT_TRUE(c.ok());
  EXPECT_DOUBLE_EQ(c->max_abs_err, 1.0 / 512);
  EXPECT_EQ(c->worst_index, 0);
  EXPECT_TRUE(c->pass);
}

TEST(CompareToReference, WrongValueFailsWithWorstIndex) {
  const std::vector<float> ref = {4.0f, 1.0f, -1.0f};
  std::vector<core::bf16_t> got = ToBf16({4.0f, 1.0f, -0.5f});
  auto c = CompareToReference(got, ref);
  ASSERT_TRUE(c.ok());
  EXPECT_DOUBLE_EQ(c->max_abs_err, 0.5);
  EXPECT_EQ(c->worst_index, 2);
  EXPECT_DOUBLE_EQ(c->bound, 4.0 / 64 + 1e-6);  // 0.0625...
  EXPECT_FALSE(c->pass);
}

TEST(CompareToReference, NanFails) {
  const std::vector<float> ref = {1.0f};
  std::vector<core::bf16_t> got = {0x7fc0};  // bf16 NaN
  auto c = CompareToReference(got, ref);
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(std::isinf(c->max_abs_err));
  EXPECT_FALSE(c->pass);
}

TEST(CompareToReference, EmptyPasses) {
  auto c = CompareToReference({}, {});
  ASSERT_TRUE(c.ok());
  EXPECT_TRUE(c->pass);
  EXPECT_EQ(c->worst_index, -1);
}

TEST(CompareToReference, SizeMismatchIsInvalidArgument) {
  const std::vector<float> ref = {1.0f, 2.0f};
  auto c = CompareToReference(ToBf16({1.0f}), ref);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(c.status().message(), ::testing::HasSubstr("1 elements, reference has 2"));
}

TEST(MergeComparison, TakesMaximaAndAndsPass) {
  Tolerance tol;
  Comparison acc;
  Comparison a;
  a.max_abs_err = 0.01;
  a.max_abs_ref = 2.0;
  a.worst_index = 3;
  a.num_elements = 10;
  a.pass = true;
  Comparison empty;  // a zero-token rank
  Comparison b;
  b.max_abs_err = 0.5;
  b.max_abs_ref = 1.0;
  b.worst_index = 7;
  b.num_elements = 4;
  b.pass = false;
  MergeComparison(a, tol, &acc);
  MergeComparison(empty, tol, &acc);
  EXPECT_TRUE(acc.pass);
  EXPECT_EQ(acc.worst_index, 3);
  MergeComparison(b, tol, &acc);
  EXPECT_FALSE(acc.pass);
  EXPECT_EQ(acc.max_abs_err, 0.5);
  EXPECT_EQ(acc.worst_index, 7);
  EXPECT_EQ(acc.max_abs_ref, 2.0);
  EXPECT_DOUBLE_EQ(acc.bound, 2.0 / 64 + 1e-6);
  EXPECT_EQ(acc.num_elements, 14);
}

}  // namespace
}  // namespace moe_ep::client
