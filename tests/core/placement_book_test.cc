#include "core/placement_book.h"

#include <memory>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace placement_book_test {
namespace {

using ::testing::ElementsAre;

std::shared_ptr<const PlacementTable> Table(absl::StatusOr<PlacementTable> t) {
  EXPECT_TRUE(t.ok()) << t.status();
  return std::make_shared<const PlacementTable>(*std::move(t));
}

TEST(PlacementBook, InstalledTablesOverrideTheContiguousOneUntilReset) {
  PlacementBook book;
  EXPECT_FALSE(book.ready());
  EXPECT_EQ(book.Placement(0), nullptr);
  EXPECT_EQ(book.ReadExpertLoad(0, false).status().code(), absl::StatusCode::kFailedPrecondition);

  const auto contiguous = Table(PlacementTable::Contiguous(4, 2));
  book.Reset(contiguous);
  ASSERT_TRUE(book.ready());
  EXPECT_EQ(book.Placement(3), contiguous);
  EXPECT_EQ(book.Installed(3), nullptr);

  // Rank 0 holds 0, 1, 3; rank 1 holds 2, 3, 1: experts 1 and 3 replicated.
  const auto redundant = Table(PlacementTable::FromSlotExperts(4, {{0, 1, 3}, {2, 3, 1}}));
  book.Install(1, redundant);
  EXPECT_EQ(book.Placement(1), redundant);
  EXPECT_EQ(book.Installed(1), redundant.get());
  EXPECT_EQ(book.Placement(0), contiguous);

  book.AddLoad(1, ExpertLoadCounts{{2, 0, 1, 5}, 1});
  absl::StatusOr<ExpertLoadCounts> read = book.ReadExpertLoad(1, /*reset=*/true);
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_THAT(read->tokens_per_expert, ElementsAre(2, 0, 1, 5));
  EXPECT_THAT(book.ReadExpertLoad(1, false)->tokens_per_expert, ElementsAre(0, 0, 0, 0));
  EXPECT_THAT(book.ExpertTokenTotals(1), ElementsAre(2, 0, 1, 5));

  book.Reset(contiguous);
  EXPECT_EQ(book.Placement(1), contiguous);
  EXPECT_THAT(book.ExpertTokenTotals(1), ElementsAre(0, 0, 0, 0));
}

}  // namespace
}  // namespace placement_book_test
}  // namespace moe_ep::core
