#include "core/agreement.h"

#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/core/thread_group.h"

namespace moe_ep::core {
namespace {

using ::testing::HasSubstr;
using testing::JoinLoopback;
using testing::NewHashStore;
using testing::RunOnRanks;

Ballot Make(int top_k, absl::Status local = absl::OkStatus()) {
  Ballot b;
  b.rpc = "AllocateWorkspace";
  b.generation = 3;
  b.sequence = 7;
  b.local = std::move(local);
  b.fields = {{"hidden_size", 64}, {"top_k", top_k}, {"model", 0x1234, true}};
  return b;
}

// Runs one vote on three ranks, ballot(rank) each; returns every rank's result.
std::vector<absl::Status> Vote(const std::function<Ballot(int)>& ballot) {
  auto store = NewHashStore();
  std::vector<absl::Status> out(3);
  RunOnRanks(3, [&](int rank) {
    auto group = JoinLoopback(store, rank, 3);
    ASSERT_TRUE(group.ok()) << group.status();
    out[rank] = RunVote(**group, ballot(rank));
    // The group stays usable after any outcome of the vote.
    auto after = AllGatherInt64(**group, rank);
    ASSERT_TRUE(after.ok()) << after.status();
    EXPECT_EQ(*after, (std::vector<int64_t>{0, 1, 2}));
  });
  return out;
}

TEST(RunVote, AgreesWhenEveryBallotMatches) {
  for (const absl::Status& s : Vote([](int) { return Make(8); })) EXPECT_TRUE(s.ok()) << s;
}

TEST(RunVote, DifferingFieldNamesEveryRanksValue) {
  const auto out = Vote([](int rank) { return Make(rank == 1 ? 4 : 8); });
  for (const absl::Status& s : out) {
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_THAT(std::string(s.message()),
                HasSubstr("AllocateWorkspace: top_k differs across ranks: rank 0 = 8, rank 1 = 4, "
                          "rank 2 = 8"));
  }
}

TEST(RunVote, LocalErrorReachesEveryRankAtOnce) {
  const auto out = Vote([](int rank) {
    return Make(8, rank == 2 ? absl::InvalidArgumentError("top_k: expected in [1, 4], got 9")
                             : absl::OkStatus());
  });
  EXPECT_EQ(out[2].code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(out[2].message(), "top_k: expected in [1, 4], got 9");
  for (int r : {0, 1}) {
    EXPECT_EQ(out[r].code(), absl::StatusCode::kAborted) << out[r];
    EXPECT_THAT(std::string(out[r].message()),
                HasSubstr("rank 2 rejected its AllocateWorkspace request: INVALID_ARGUMENT: "
                          "top_k: expected in [1, 4], got 9"));
  }
}

TEST(RunVote, RanksInDifferentCallsAbort) {
  const auto out = Vote([](int rank) {
    Ballot b = Make(8);
    if (rank == 0) b.rpc = "Forward";
    return b;
  });
  for (const absl::Status& s : out) {
    EXPECT_EQ(s.code(), absl::StatusCode::kAborted) << s;
    EXPECT_THAT(std::string(s.message()), HasSubstr("not in the same call"));
  }
  EXPECT_THAT(std::string(out[1].message()), HasSubstr("rank 0 is in Forward"));
}

}  // namespace
}  // namespace moe_ep::core
