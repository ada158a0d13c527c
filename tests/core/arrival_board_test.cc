#include "core/arrival_board.h"

#include <thread>
#include <vector>

#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

const std::vector<int> kThree = {0, 1, 2};

absl::Time Soon() { return absl::Now() + absl::Milliseconds(20); }

TEST(GenerationOfRound, ParsesThePrefix) {
  EXPECT_EQ(GenerationOfRound("gen12/arrive/0/3/Forward"), 12);
  EXPECT_EQ(GenerationOfRound("gen/arrive"), -1);
  EXPECT_EQ(GenerationOfRound("generation1/x"), -1);
  EXPECT_EQ(GenerationOfRound("gen7"), -1);
}

TEST(ArrivalBoard, CompletesWhenEveryMemberArrives) {
  ArrivalBoard board;
  std::vector<absl::StatusOr<ArrivalOutcome>> out(3);
  std::vector<std::thread> ranks;
  ranks.reserve(3);
  for (int r = 0; r < 3; ++r) {
    ranks.emplace_back([&, r] {
      out[r] =
          board.Arrive("gen1/arrive/0/0/Forward", r, kThree, "", absl::Now() + absl::Seconds(10));
    });
  }
  for (std::thread& t : ranks) t.join();
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(out[r].ok()) << out[r].status();
    EXPECT_TRUE(out[r]->complete) << "rank " << r;
  }
  // Every member saw it complete: the round is freed.
  EXPECT_EQ(board.NumRounds(), 0);
}

TEST(ArrivalBoard, ReportsTheMissingRanksAndTheirAddressesAtTheDeadline) {
  ArrivalBoard board;
  // Rank 2 gave its address in an earlier round of the same generation.
  ASSERT_TRUE(board.Arrive("gen3/arrive/0/0/Forward", 2, kThree, "127.0.0.1:9002", Soon()).ok());
  board.Withdraw("gen3/arrive/0/0/Forward", 2);
  absl::StatusOr<ArrivalOutcome> out =
      board.Arrive("gen3/arrive/0/1/Forward", 0, kThree, "127.0.0.1:9000", Soon());
  ASSERT_TRUE(out.ok());
  EXPECT_FALSE(out->complete);
  EXPECT_THAT(out->missing, ElementsAre(1, 2));
  EXPECT_THAT(out->missing_addresses, ElementsAre("", "127.0.0.1:9002"));
  EXPECT_EQ(out->refused_rank, -1);
}

TEST(ArrivalBoard, WithdrawnArrivalDoesNotCompleteALaterRound) {
  // A stray call on rank 0 alone: it withdraws at its deadline; the next
  // call of every rank under the same name needs all three again.
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/5/SyncTokenCounts";
  ASSERT_FALSE(board.Arrive(round, 0, kThree, "", Soon())->complete);
  EXPECT_FALSE(board.Withdraw(round, 0).complete);
  EXPECT_EQ(board.NumRounds(), 0);  // nobody in it: freed
  ASSERT_FALSE(board.Arrive(round, 1, kThree, "", Soon())->complete);
  ASSERT_FALSE(board.Arrive(round, 2, kThree, "", Soon())->complete);
  EXPECT_THAT(board.Withdraw(round, 2).missing, ElementsAre(0));
}

TEST(ArrivalBoard, WithdrawAfterTheLastArrivalAnswersComplete) {
  // The lock decides: a rank whose wait ended just before the last member
  // came still learns that the round completed, like the others.
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/0/Forward";
  const std::vector<int> two = {0, 1};
  ASSERT_FALSE(board.Arrive(round, 0, two, "", Soon())->complete);
  ASSERT_TRUE(board.Arrive(round, 1, two, "", Soon())->complete);
  EXPECT_TRUE(board.Withdraw(round, 0).complete);
  EXPECT_EQ(board.NumRounds(), 0);
}

TEST(ArrivalBoard, RefusalEndsThePeersWaitAfterTheGrace) {
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/0/AllocateWorkspace";
  absl::StatusOr<ArrivalOutcome> peer;
  const absl::Time start = absl::Now();
  std::thread waiter(
      [&] { peer = board.Arrive(round, 0, kThree, "", absl::Now() + absl::Seconds(10)); });
  absl::SleepFor(absl::Milliseconds(20));
  ASSERT_TRUE(board
                  .Refuse(round, 1, "INVALID_ARGUMENT: top_k: expected >= 1, got 0",
                          absl::Now() + absl::Seconds(2))
                  .ok());
  waiter.join();
  const absl::Duration waited = absl::Now() - start;
  ASSERT_TRUE(peer.ok());
  EXPECT_FALSE(peer->complete);
  EXPECT_EQ(peer->refused_rank, 1);
  EXPECT_THAT(peer->refusal, HasSubstr("top_k: expected >= 1, got 0"));
  EXPECT_GE(waited, ArrivalBoard::kRefusalGrace);
  EXPECT_LT(waited, absl::Seconds(5));
  // The refused peer's arrival was taken back: rank 2 alone does not complete.
  absl::StatusOr<ArrivalOutcome> late =
      board.Arrive(round, 2, kThree, "", absl::Now() + absl::Seconds(1));
  ASSERT_TRUE(late.ok());
  EXPECT_EQ(late->refused_rank, 1);  // it stands for rank 2 too, once
}

TEST(ArrivalBoard, RefusalEndsEachMembersCallOnce) {
  // After a refused fan-out the caller sends the call again: the peers that
  // saw the refusal wait for the refusing rank instead of being refused again.
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/0/ConfigureLayers";
  const std::vector<int> two = {0, 1};
  ASSERT_TRUE(board.Refuse(round, 1, "INVALID_ARGUMENT: x", absl::Now() + absl::Seconds(2)).ok());
  ASSERT_EQ(board.Arrive(round, 0, two, "", absl::Now() + absl::Seconds(1))->refused_rank, 1);
  absl::StatusOr<ArrivalOutcome> again;
  std::thread retry(
      [&] { again = board.Arrive(round, 0, two, "", absl::Now() + absl::Seconds(5)); });
  absl::SleepFor(absl::Milliseconds(30));
  // The refusing rank comes back with a valid call: that clears its refusal.
  absl::StatusOr<ArrivalOutcome> valid =
      board.Arrive(round, 1, two, "", absl::Now() + absl::Seconds(5));
  retry.join();
  ASSERT_TRUE(again.ok() && valid.ok());
  EXPECT_TRUE(again->complete);
  EXPECT_TRUE(valid->complete);
}

TEST(ArrivalBoard, RefusingRankArrivingWithinTheGraceClearsAStrayRefusal) {
  // A stray invalid call to rank 1 alone, then a valid call of both ranks
  // whose peer reaches the board first: not refused.
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/4/SyncTokenCounts";
  const std::vector<int> two = {0, 1};
  ASSERT_TRUE(
      board.Refuse(round, 1, "INVALID_ARGUMENT: local_tokens", absl::Now() + absl::Seconds(2))
          .ok());
  absl::StatusOr<ArrivalOutcome> peer;
  std::thread waiter(
      [&] { peer = board.Arrive(round, 0, two, "", absl::Now() + absl::Seconds(5)); });
  absl::SleepFor(ArrivalBoard::kRefusalGrace / 4);
  ASSERT_TRUE(board.Arrive(round, 1, two, "", absl::Now() + absl::Seconds(5))->complete);
  waiter.join();
  ASSERT_TRUE(peer.ok());
  EXPECT_TRUE(peer->complete);
  EXPECT_EQ(peer->refused_rank, -1);
}

TEST(ArrivalBoard, GraceCountsAcrossTheArrivalsOfOneWait) {
  // The worker waits in slices shorter than the grace; the refusal must
  // still end its wait.
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/0/Forward";
  ASSERT_TRUE(board.Refuse(round, 1, "INVALID_ARGUMENT: x", absl::Now() + absl::Seconds(2)).ok());
  const absl::Time start = absl::Now();
  int slices = 0;
  absl::StatusOr<ArrivalOutcome> out;
  do {
    out = board.Arrive(round, 0, {0, 1}, "", absl::Now() + ArrivalBoard::kRefusalGrace / 4);
    ASSERT_TRUE(out.ok());
    ++slices;
  } while (out->refused_rank < 0 && absl::Now() - start < absl::Seconds(2));
  EXPECT_EQ(out->refused_rank, 1);
  EXPECT_GE(slices, 4);
}

TEST(ArrivalBoard, ExpiredRefusalIsIgnored) {
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/0/Forward";
  ASSERT_TRUE(board.Refuse(round, 1, "INVALID_ARGUMENT: x", absl::Now()).ok());
  absl::StatusOr<ArrivalOutcome> out = board.Arrive(round, 0, {0, 1}, "", Soon());
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(out->refused_rank, -1);
  EXPECT_THAT(out->missing, ElementsAre(1));
}

TEST(ArrivalBoard, RejectsAMemberListWithoutTheArrivingRank) {
  ArrivalBoard board;
  absl::StatusOr<ArrivalOutcome> out =
      board.Arrive("gen1/arrive/0/0/Forward", 3, kThree, "", Soon());
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(out.status().message(), HasSubstr("arriving rank 3"));
  EXPECT_EQ(board.NumRounds(), 0);
}

TEST(ArrivalBoard, BoundsTheOpenRounds) {
  ArrivalBoard board(/*max_rounds=*/2);
  ASSERT_TRUE(board.Arrive("gen1/a/0", 0, {0, 1}, "", absl::Now()).ok());
  ASSERT_TRUE(board.Arrive("gen1/a/1", 0, {0, 1}, "", absl::Now()).ok());
  absl::StatusOr<ArrivalOutcome> third = board.Arrive("gen1/a/2", 0, {0, 1}, "", absl::Now());
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), absl::StatusCode::kResourceExhausted);
  board.DropGenerationsBelow(2);
  EXPECT_EQ(board.NumRounds(), 0);
  EXPECT_TRUE(board.Arrive("gen2/a/0", 0, {0, 1}, "", absl::Now()).ok());
}

TEST(ArrivalBoard, LapsedArrivalNeitherCountsNorCompletes) {
  // A stray call on rank 0 whose worker never withdrew: once its deadline
  // passed, the peers' next call under the same name needs rank 0 again.
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/7/SyncTokenCounts";
  const std::vector<int> two = {0, 1};
  ASSERT_FALSE(
      board.Arrive(round, 0, two, "", absl::Now(), nullptr, absl::Now() + absl::Milliseconds(10))
          ->complete);
  absl::SleepFor(absl::Milliseconds(20));
  absl::StatusOr<ArrivalOutcome> peer = board.Arrive(round, 1, two, "", Soon());
  ASSERT_TRUE(peer.ok());
  EXPECT_FALSE(peer->complete);
  EXPECT_THAT(peer->missing, ElementsAre(0));
  // Rank 0 arriving again (its next call) completes it.
  EXPECT_TRUE(board.Arrive(round, 0, two, "", Soon())->complete);
}

TEST(ArrivalBoard, CancelledWaitLeavesTheArrivalIn) {
  ArrivalBoard board;
  const std::string round = "gen1/arrive/0/0/Forward";
  absl::StatusOr<ArrivalOutcome> out =
      board.Arrive(round, 0, {0, 1}, "", absl::Now() + absl::Seconds(30), [] { return true; });
  ASSERT_TRUE(out.ok());
  EXPECT_FALSE(out->complete);
  // Still in: rank 1 completes the round, and rank 0's withdraw learns it.
  EXPECT_TRUE(board.Arrive(round, 1, {0, 1}, "", Soon())->complete);
  EXPECT_TRUE(board.Withdraw(round, 0).complete);
}

}  // namespace
}  // namespace moe_ep::core
