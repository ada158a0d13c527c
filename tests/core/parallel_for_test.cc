#include "core/parallel_for.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <new>
#include <stdexcept>
#include <utility>
#include <vector>

#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

// Records the ranges fn was called with, in start order.
std::vector<std::pair<int64_t, int64_t>> Ranges(int64_t n, int64_t min_items, int max_threads,
                                                int* used) {
  std::mutex mu;
  std::vector<std::pair<int64_t, int64_t>> ranges;
  *used = ParallelFor(
      n, min_items,
      [&](int64_t b, int64_t e) {
        std::lock_guard<std::mutex> lock(mu);
        ranges.emplace_back(b, e);
      },
      max_threads);
  std::sort(ranges.begin(), ranges.end());
  return ranges;
}

// The header's worked example: 10 items, at least 3 per range, 8 threads.
TEST(ParallelFor, SplitsIntoBalancedContiguousRanges) {
  int used = 0;
  const auto ranges = Ranges(10, 3, 8, &used);
  EXPECT_EQ(used, 3);
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 4}, {4, 7}, {7, 10}};
  EXPECT_EQ(ranges, expected);
}

TEST(ParallelFor, ThreadLimitCapsRanges) {
  int used = 0;
  const auto ranges = Ranges(100, 1, 4, &used);
  EXPECT_EQ(used, 4);
  const std::vector<std::pair<int64_t, int64_t>> expected = {
      {0, 25}, {25, 50}, {50, 75}, {75, 100}};
  EXPECT_EQ(ranges, expected);
}

TEST(ParallelFor, SmallLoopRunsInlineOnce) {
  int used = 0;
  const auto ranges = Ranges(5, 1000, 8, &used);
  EXPECT_EQ(used, 1);
  const std::vector<std::pair<int64_t, int64_t>> expected = {{0, 5}};
  EXPECT_EQ(ranges, expected);
}

TEST(ParallelFor, NoItemsNoCalls) {
  int used = -1;
  EXPECT_TRUE(Ranges(0, 1, 8, &used).empty());
  EXPECT_EQ(used, 0);
  EXPECT_TRUE(Ranges(-3, 1, 8, &used).empty());
  EXPECT_EQ(used, 0);
}

// Every item visited exactly once with the default (hardware) thread count.
TEST(ParallelFor, CoversEveryItemOnceWithDefaultThreads) {
  std::vector<std::atomic<int>> hits(100003);
  const int used = ParallelFor(static_cast<int64_t>(hits.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[i].fetch_add(1);
  });
  EXPECT_EQ(used, std::min<int64_t>(DefaultParallelism(), hits.size()));
  for (size_t i = 0; i < hits.size(); ++i) ASSERT_EQ(hits[i].load(), 1) << i;
}

}  // namespace
}  // namespace moe_ep::core

namespace moe_ep::core {
namespace {

// Issue 13: an exception on a worker thread used to terminate the process
// (a joinable std::thread destroyed during unwinding).
TEST(ParallelForExceptions, AThrowOnAnyRangeReachesTheCallerAfterEveryThreadJoined) {
  std::atomic<int> finished{0};
  EXPECT_THROW(ParallelFor(
                   8, 1,
                   [&](int64_t begin, int64_t /*end*/) {
                     if (begin == 5) throw std::bad_alloc();
                     ++finished;
                   },
                   8),
               std::bad_alloc);
  EXPECT_EQ(finished.load(), 7);
  EXPECT_THROW(ParallelFor(
                   4, 1,
                   [](int64_t begin, int64_t) {
                     if (begin == 0) throw std::length_error("x");
                   },
                   4),
               std::length_error);
}

}  // namespace
}  // namespace moe_ep::core
