#include "core/percentile.h"

#include <vector>

#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

TEST(Percentile, NearestRankOfAscendingSamples) {
  std::vector<double> hundred;
  for (int i = 1; i <= 100; ++i) hundred.push_back(i);
  EXPECT_EQ(Percentile(hundred, 50), 50.0);     // ceil(50) = 50th
  EXPECT_EQ(Percentile(hundred, 99), 99.0);     // ceil(99) = 99th
  EXPECT_EQ(Percentile(hundred, 99.5), 100.0);  // ceil(99.5) = 100th
  EXPECT_EQ(Percentile(hundred, 100), 100.0);
  EXPECT_EQ(Percentile({1.0, 2.0, 3.0, 4.0}, 50), 2.0);  // ceil(2) = 2nd
  EXPECT_EQ(Percentile({1.0, 2.0, 3.0, 4.0}, 51), 3.0);  // ceil(2.04) = 3rd
  EXPECT_EQ(Percentile({7.0}, 99), 7.0);
  EXPECT_EQ(Percentile({7.0}, 0.01), 7.0);  // clamped to the first
  EXPECT_EQ(Percentile({}, 50), 0.0);
}

TEST(Percentile, SummarizeSortsFirst) {
  std::vector<double> samples = {30.0, 10.0, 20.0};
  const LatencySummary s = Summarize(samples);
  EXPECT_EQ(s.p50_us, 20.0);  // ceil(1.5) = 2nd smallest
  EXPECT_EQ(s.p99_us, 30.0);  // ceil(2.97) = 3rd
  EXPECT_EQ(samples, (std::vector<double>{10.0, 20.0, 30.0}));
}

}  // namespace
}  // namespace moe_ep::core
