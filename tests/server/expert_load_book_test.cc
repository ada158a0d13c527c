#include "server/expert_load_book.h"

#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::ElementsAre;

core::ExpertLoadCounts Step(std::vector<int64_t> tokens, int64_t steps = 1) {
  return core::ExpertLoadCounts{std::move(tokens), steps};
}

TEST(ExpertLoadBook, WindowsResetTotalsDoNot) {
  ExpertLoadBook book;
  book.Reset(3);
  EXPECT_THAT(book.Read(0, false).tokens_per_expert, ElementsAre(0, 0, 0));
  book.Add(0, Step({1, 0, 2}));
  book.Add(0, Step({0, 4, 1}));
  book.Add(2, Step({5, 5, 5}));
  const core::ExpertLoadCounts w = book.Read(0, /*reset=*/true);
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(1, 4, 3));
  EXPECT_EQ(w.steps, 2);
  EXPECT_THAT(book.Read(0, false).tokens_per_expert, ElementsAre(0, 0, 0));
  EXPECT_EQ(book.Read(0, false).steps, 0);
  EXPECT_THAT(book.Totals(0), ElementsAre(1, 4, 3));
  book.Add(0, Step({1, 1, 1}));
  EXPECT_THAT(book.Totals(0), ElementsAre(2, 5, 4));
  EXPECT_THAT(book.Read(0, false).tokens_per_expert, ElementsAre(1, 1, 1));
  EXPECT_THAT(book.Totals(2), ElementsAre(5, 5, 5));
  EXPECT_THAT(book.Totals(1), ElementsAre(0, 0, 0));
  book.Reset(2);
  EXPECT_THAT(book.Totals(0), ElementsAre(0, 0));
}

}  // namespace
}  // namespace moe_ep::server
