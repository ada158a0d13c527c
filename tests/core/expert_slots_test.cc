// Tests of core/expert_slots.h: the local slot of an id among a rank's slot
// ids, for ranges and for any set (DESIGN §17; issue 34 item 2). The
// kernels run the same function (kernels/expert_kernels.cu,
// kernels/onesided/onesided_kernels.cu); these run on the host in CI.

#include "core/expert_slots.h"

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

TEST(LocalSlot, WorkedExamples) {
  const std::vector<int32_t> gaps = {2, 5, 9};
  EXPECT_EQ(LocalSlot(gaps.data(), 3, 5), 1);
  EXPECT_EQ(LocalSlot(gaps.data(), 3, 9), 2);
  EXPECT_EQ(LocalSlot(gaps.data(), 3, 2), 0);
  EXPECT_EQ(LocalSlot(gaps.data(), 3, 3), -1);
  EXPECT_EQ(LocalSlot(gaps.data(), 3, -1), -1);
  EXPECT_EQ(LocalSlot(gaps.data(), 3, 10), -1);
  const std::vector<int32_t> range = {4, 5, 6};
  EXPECT_EQ(LocalSlot(range.data(), 3, 6), 2);
  EXPECT_EQ(LocalSlot(range.data(), 3, 3), -1);
  EXPECT_EQ(LocalSlot(range.data(), 3, 7), -1);
}

TEST(LocalSlot, NoSlotsAnswerNothing) {
  EXPECT_EQ(LocalSlot(nullptr, 0, 0), -1);
  const int32_t one = 7;
  EXPECT_EQ(LocalSlot(&one, 1, 7), 0);
  EXPECT_EQ(LocalSlot(&one, 1, 8), -1);
}

// Random ascending sets of 1..40 ids out of 256 (a DeepSeek-V3 rank's slot
// experts), every id in [-1, 257] against a linear scan.
TEST(LocalSlot, EqualsALinearScanOnRandomSets) {
  std::mt19937 rng(17);
  for (int trial = 0; trial < 200; ++trial) {
    std::vector<int32_t> all(256);
    for (int i = 0; i < 256; ++i) all[i] = i;
    std::shuffle(all.begin(), all.end(), rng);
    const int n = 1 + static_cast<int>(rng() % 40);
    std::vector<int32_t> ids(all.begin(), all.begin() + n);
    std::sort(ids.begin(), ids.end());
    for (int32_t id = -1; id <= 257; ++id) {
      const auto at = std::find(ids.begin(), ids.end(), id);
      const int want = at == ids.end() ? -1 : static_cast<int>(at - ids.begin());
      ASSERT_EQ(LocalSlot(ids.data(), n, id), want) << "trial " << trial << " id " << id;
    }
  }
}

}  // namespace
}  // namespace moe_ep::core
