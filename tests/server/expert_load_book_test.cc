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

// A step that finished on this rank, failed on a peer, and was sent again
// under the next mask round (same epoch) counts once: the resend's counts
// replace the first run's, in the window and the totals (issue 17).
TEST(ExpertLoadBook, AStepResentAfterAMaskCountsOnce) {
  ExpertLoadBook book;
  book.Reset(3);
  book.Add(0, Step({1, 1, 0}), LoadStepKey{3, 0});
  book.Add(0, Step({2, 0, 1}), LoadStepKey{4, 0});  // finished here, lost elsewhere
  book.Add(0, Step({2, 1, 0}), LoadStepKey{4, 1});  // the resend under mask round 1
  core::ExpertLoadCounts w = book.Read(0, /*reset=*/false);
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(3, 2, 0));
  EXPECT_EQ(w.steps, 2);
  EXPECT_THAT(book.Totals(0), ElementsAre(3, 2, 0));
  // Several steps of one epoch in the same round all count.
  book.Add(0, Step({1, 0, 0}), LoadStepKey{5, 1});
  book.Add(0, Step({1, 0, 0}), LoadStepKey{5, 1});
  EXPECT_THAT(book.Totals(0), ElementsAre(5, 2, 0));
  // A resend after the window was read and reset leaves the window alone
  // (the first run was already reported) and fixes only the totals.
  w = book.Read(0, /*reset=*/true);
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(5, 2, 0));
  EXPECT_EQ(w.steps, 4);
  book.Add(0, Step({0, 0, 4}), LoadStepKey{5, 2});
  EXPECT_THAT(book.Totals(0), ElementsAre(4, 2, 4));
  w = book.Read(0, false);
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(0, 0, 4));
  EXPECT_EQ(w.steps, 1);
  // Without a key (epoch < 0) every Add counts.
  book.Add(1, Step({1, 0, 0}));
  book.Add(1, Step({1, 0, 0}));
  EXPECT_THAT(book.Totals(1), ElementsAre(2, 0, 0));
}

}  // namespace
}  // namespace moe_ep::server
