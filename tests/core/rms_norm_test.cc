#include "core/rms_norm.h"

#include <cmath>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;

TEST(RmsNorm, NormalizesEachRowByHandComputedRms) {
  // Row [3, 4]: mean(x^2) = 12.5, eps 0.5 -> 1/sqrt(13) ; weight [1, 2].
  // Row [0, 0]: stays 0.
  auto norm = RmsNorm::Create({1.0f, 2.0f}, 0.5f);
  ASSERT_TRUE(norm.ok()) << norm.status();
  std::vector<float> x = {3.0f, 4.0f, 0.0f, 0.0f};
  ASSERT_TRUE(norm->Apply(absl::MakeSpan(x), 2).ok());
  const float inv = 1.0f / std::sqrt(13.0f);
  EXPECT_FLOAT_EQ(x[0], 3.0f * inv);
  EXPECT_FLOAT_EQ(x[1], 8.0f * inv);
  EXPECT_FLOAT_EQ(x[2], 0.0f);
  EXPECT_FLOAT_EQ(x[3], 0.0f);
}

TEST(RmsNorm, FusedResidualAddKeepsPreNormSum) {
  // x [1, 1] + residual [1, 3] = [2, 4] (new residual); mean sq = 10, eps 1e-6.
  auto norm = RmsNorm::Create({1.0f, 1.0f}, 1e-6f);
  ASSERT_TRUE(norm.ok());
  std::vector<float> x = {1.0f, 1.0f};
  std::vector<float> residual = {1.0f, 3.0f};
  ASSERT_TRUE(norm->ApplyWithResidual(absl::MakeSpan(x), absl::MakeSpan(residual), 1).ok());
  EXPECT_FLOAT_EQ(residual[0], 2.0f);
  EXPECT_FLOAT_EQ(residual[1], 4.0f);
  const float inv = 1.0f / std::sqrt(10.0f + 1e-6f);
  EXPECT_NEAR(x[0], 2.0f * inv, 1e-6);
  EXPECT_NEAR(x[1], 4.0f * inv, 1e-6);
}

TEST(RmsNorm, ZeroRowsIsANoOp) {
  auto norm = RmsNorm::Create({1.0f, 1.0f, 1.0f}, 1e-6f);
  ASSERT_TRUE(norm.ok());
  std::vector<float> empty;
  EXPECT_TRUE(norm->Apply(absl::MakeSpan(empty), 0).ok());
  EXPECT_TRUE(norm->ApplyWithResidual(absl::MakeSpan(empty), absl::MakeSpan(empty), 0).ok());
}

TEST(RmsNorm, RejectsBadWeightAndEps) {
  EXPECT_EQ(RmsNorm::Create({}, 1e-6f).status().code(), absl::StatusCode::kInvalidArgument);
  auto s = RmsNorm::Create({1.0f}, 0.0f).status();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("eps"));
  EXPECT_EQ(RmsNorm::Create({1.0f}, NAN).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(RmsNorm, RejectsMismatchedShapes) {
  auto norm = RmsNorm::Create({1.0f, 1.0f}, 1e-6f);
  ASSERT_TRUE(norm.ok());
  std::vector<float> x(3, 1.0f), residual(4, 1.0f);
  auto s = norm->Apply(absl::MakeSpan(x), 2);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()), HasSubstr("rows * H = 2 * 2"));
  EXPECT_EQ(norm->Apply(absl::MakeSpan(x), -1).code(), absl::StatusCode::kInvalidArgument);
  std::vector<float> x4(4, 1.0f);
  std::vector<float> r3(3, 1.0f);
  EXPECT_EQ(norm->ApplyWithResidual(absl::MakeSpan(x4), absl::MakeSpan(r3), 2).code(),
            absl::StatusCode::kInvalidArgument);
  // Bad input leaves the tensors unchanged.
  EXPECT_EQ(x4, std::vector<float>(4, 1.0f));
  EXPECT_EQ(r3, std::vector<float>(3, 1.0f));
}

}  // namespace
}  // namespace moe_ep::core
