#include "server/benchmark_inputs.h"

#include <cmath>
#include <random>
#include <set>
#include <vector>

#include "core/bf16.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;
using ::testing::UnorderedElementsAre;

TEST(BenchmarkInputs, ParsesRouting) {
  EXPECT_EQ(*ParseBenchmarkRouting(""), BenchmarkRouting::kUniform);
  EXPECT_EQ(*ParseBenchmarkRouting("uniform"), BenchmarkRouting::kUniform);
  EXPECT_EQ(*ParseBenchmarkRouting("skewed"), BenchmarkRouting::kSkewed);
  absl::StatusOr<BenchmarkRouting> bad = ParseBenchmarkRouting("zipf");
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(bad.status().message(),
              HasSubstr("routing: expected \"uniform\" or \"skewed\", got \"zipf\""));
}

TEST(BenchmarkInputs, HiddenStatesAreTheDocumentedDraws) {
  const uint64_t seed = 5;
  const int rank = 3;
  const BenchmarkInputs in =
      GenerateBenchmarkInputs(seed, rank, 4, 8, 2, 6, BenchmarkRouting::kUniform);
  // The same engine, seeded as the header documents, drawn by hand.
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + rank);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  ASSERT_EQ(in.hidden.size(), 32u);
  for (size_t i = 0; i < in.hidden.size(); ++i) {
    EXPECT_EQ(in.hidden[i], core::FloatToBf16(value(rng))) << "element " << i;
  }
  EXPECT_EQ(in.num_tokens, 4);
}

TEST(BenchmarkInputs, RoutingIsDistinctPerTokenAndWeightsSumToOne) {
  const int top_k = 4;
  const BenchmarkInputs in =
      GenerateBenchmarkInputs(1, 0, 200, 2, top_k, 8, BenchmarkRouting::kUniform);
  ASSERT_EQ(in.topk_ids.size(), 800u);
  ASSERT_EQ(in.topk_weights.size(), 800u);
  for (int t = 0; t < 200; ++t) {
    std::set<int32_t> experts;
    double sum = 0.0;
    for (int k = 0; k < top_k; ++k) {
      const int32_t e = in.topk_ids[t * top_k + k];
      EXPECT_GE(e, 0);
      EXPECT_LT(e, 8);
      experts.insert(e);
      const float w = in.topk_weights[t * top_k + k];
      // Each draw is in [0.05, 1) and a row sums to at most 4: w >= 0.05 / 4.
      EXPECT_GT(w, 0.0125f - 1e-6f);
      sum += w;
    }
    EXPECT_EQ(experts.size(), 4u) << "token " << t;
    EXPECT_NEAR(sum, 1.0, 1e-5) << "token " << t;
  }
}

TEST(BenchmarkInputs, SkewedRoutingFavoursLowExperts) {
  // Zipf s = 1 over 16 experts, one expert per token: P(0) = 1 / H_16 = 0.296,
  // P(15) = 0.0185. Over 4000 tokens expert 0 is picked far more often.
  const BenchmarkInputs in =
      GenerateBenchmarkInputs(7, 0, 4000, 1, 1, 16, BenchmarkRouting::kSkewed);
  std::vector<int> count(16, 0);
  for (int32_t e : in.topk_ids) ++count[e];
  EXPECT_GT(count[0], 1000);  // expected ~1184
  EXPECT_LT(count[15], 200);  // expected ~74
  const BenchmarkInputs uniform =
      GenerateBenchmarkInputs(7, 0, 4000, 1, 1, 16, BenchmarkRouting::kUniform);
  std::vector<int> flat(16, 0);
  for (int32_t e : uniform.topk_ids) ++flat[e];
  EXPECT_LT(flat[0], 400);  // expected 250
}

TEST(BenchmarkInputs, SampleRoutingSkipsExpertsOfZeroPopularity) {
  std::mt19937_64 rng(1);
  const std::vector<int32_t> ids = SampleRouting(rng, 3, 2, {0.0, 0.0, 1.0, 5.0});
  ASSERT_EQ(ids.size(), 6u);
  for (int t = 0; t < 3; ++t) {
    EXPECT_THAT((std::vector<int32_t>{ids[2 * t], ids[2 * t + 1]}), UnorderedElementsAre(2, 3));
  }
}

TEST(BenchmarkInputs, SeededPerRank) {
  const BenchmarkInputs a = GenerateBenchmarkInputs(9, 0, 16, 4, 2, 8, BenchmarkRouting::kSkewed);
  const BenchmarkInputs again =
      GenerateBenchmarkInputs(9, 0, 16, 4, 2, 8, BenchmarkRouting::kSkewed);
  const BenchmarkInputs other =
      GenerateBenchmarkInputs(9, 1, 16, 4, 2, 8, BenchmarkRouting::kSkewed);
  EXPECT_EQ(a.hidden, again.hidden);
  EXPECT_EQ(a.topk_ids, again.topk_ids);
  EXPECT_EQ(a.topk_weights, again.topk_weights);
  EXPECT_NE(a.hidden, other.hidden);
}

}  // namespace
}  // namespace moe_ep::server
