#include "core/expert_load_book.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::ElementsAre;

ExpertLoadCounts Step(std::vector<int64_t> tokens, int64_t steps = 1) {
  return ExpertLoadCounts{std::move(tokens), steps};
}

TEST(ExpertLoadBook, WindowsResetTotalsDoNot) {
  ExpertLoadBook book;
  book.Reset(3);
  EXPECT_THAT(book.Read(0, false).tokens_per_expert, ElementsAre(0, 0, 0));
  book.Add(0, Step({1, 0, 2}));
  book.Add(0, Step({0, 4, 1}));
  book.Add(2, Step({5, 5, 5}));
  const ExpertLoadCounts w = book.Read(0, /*reset=*/true);
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

// Keys of epoch `epoch`, mask round `round`, routing `routing` (a stand-in
// for RoutingFingerprint of the step's topk_ids).
LoadStepKey Key(int64_t epoch, int round, uint64_t routing) {
  return LoadStepKey{epoch, round, routing};
}

// A step that finished on this rank, failed on a peer, and was sent again
// under the next mask round (same epoch, same routing) counts once: the
// resend's counts replace the first run's, in the window and the totals
// (issue 17).
TEST(ExpertLoadBook, AStepResentAfterAMaskCountsOnce) {
  ExpertLoadBook book;
  book.Reset(3);
  book.Add(0, Step({1, 1, 0}), Key(3, 0, 11));
  book.Add(0, Step({2, 0, 1}), Key(4, 0, 12));  // finished here, lost elsewhere
  book.Add(0, Step({2, 0, 1}), Key(4, 1, 12));  // the resend under mask round 1
  ExpertLoadCounts w = book.Read(0, /*reset=*/false);
  // {1,1,0} + {2,0,1}, the second once.
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(3, 1, 1));
  EXPECT_EQ(w.steps, 2);
  EXPECT_THAT(book.Totals(0), ElementsAre(3, 1, 1));
  // Several steps of one epoch in the same round all count, even with
  // equal routing.
  book.Add(0, Step({1, 0, 0}), Key(5, 1, 13));
  book.Add(0, Step({1, 0, 0}), Key(5, 1, 13));
  EXPECT_THAT(book.Totals(0), ElementsAre(5, 1, 1));
  // A resend after the window was read and reset leaves the window alone
  // (the first run was already reported) and fixes only the totals.
  w = book.Read(0, /*reset=*/true);
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(5, 1, 1));
  EXPECT_EQ(w.steps, 4);
  book.Add(0, Step({1, 0, 0}), Key(5, 2, 13));
  EXPECT_THAT(book.Totals(0), ElementsAre(5, 1, 1));
  w = book.Read(0, false);
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(1, 0, 0));
  EXPECT_EQ(w.steps, 1);
  // Without a key (epoch < 0) every Add counts.
  book.Add(1, Step({1, 0, 0}));
  book.Add(1, Step({1, 0, 0}));
  EXPECT_THAT(book.Totals(1), ElementsAre(2, 0, 0));
}

// The first new step after a mask, in the same epoch, adds: the step before
// the mask completed everywhere (a rank was lost while the group was idle)
// and this one has other routing. Each rank counts each step once; a rank
// whose run of the interrupted step failed (nothing added) adds the resend.
TEST(ExpertLoadBook, ANewStepAfterAMaskAdds) {
  ExpertLoadBook book;
  book.Reset(3);
  book.Add(0, Step({1, 1, 0}), Key(7, 0, 21));
  book.Add(0, Step({0, 2, 0}), Key(7, 0, 22));
  book.Add(0, Step({0, 0, 2}), Key(7, 1, 23));  // first step under mask round 1
  ExpertLoadCounts w = book.Read(0, /*reset=*/false);
  EXPECT_THAT(w.tokens_per_expert, ElementsAre(1, 3, 2));
  EXPECT_EQ(w.steps, 3);
  EXPECT_THAT(book.Totals(0), ElementsAre(1, 3, 2));
  // This rank's run of step 24 failed (dropped); its resend under round 2 adds.
  book.Add(0, Step({3, 0, 0}), Key(7, 2, 24));
  EXPECT_THAT(book.Totals(0), ElementsAre(4, 3, 2));
  EXPECT_EQ(book.Read(0, false).steps, 4);
  // Per layer: another layer's last step is not this one's.
  book.Add(1, Step({0, 1, 0}), Key(7, 2, 24));
  book.Add(0, Step({0, 1, 0}), Key(7, 3, 25));
  EXPECT_THAT(book.Totals(0), ElementsAre(4, 4, 2));
  EXPECT_THAT(book.Totals(1), ElementsAre(0, 1, 0));
}

// The routing a resend repeats: equal bytes hash equal, other ids or
// another T do not.
TEST(ExpertLoadBook, RoutingFingerprintFollowsTheIds) {
  const std::vector<int32_t> ids = {0, 2, 1, 2};
  const std::vector<int32_t> same = {0, 2, 1, 2};  // another buffer, equal bytes
  const std::vector<int32_t> other = {0, 2, 2, 1};
  EXPECT_EQ(RoutingFingerprint(ids), RoutingFingerprint(same));
  EXPECT_NE(RoutingFingerprint(ids), RoutingFingerprint(other));
  EXPECT_NE(RoutingFingerprint(ids), RoutingFingerprint(absl::MakeConstSpan(ids).first(2)));
  const std::string bytes(reinterpret_cast<const char*>(ids.data()), ids.size() * 4);
  EXPECT_EQ(RoutingFingerprint(absl::string_view(bytes)), RoutingFingerprint(ids));
}

}  // namespace
}  // namespace moe_ep::core
