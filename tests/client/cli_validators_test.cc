#include "client/cli_validators.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

const std::vector<std::string> kCommands = {"up",    "plan",        "workspace", "status", "health",
                                            "watch", "coordinator", "run",       "stack",  "bench"};

TEST(NearestName, SuggestsTheMistypedSubcommand) {
  EXPECT_EQ(NearestName("stauts", kCommands), "status");  // two letters swapped: 1
  EXPECT_EQ(NearestName("bnech", kCommands), "bench");    // swap
  EXPECT_EQ(NearestName("statu", kCommands), "status");   // one letter missing
  EXPECT_EQ(NearestName("coordinater", kCommands), "coordinator");
  EXPECT_EQ(NearestName("WATCH", kCommands), std::nullopt);  // the name itself (case ignored)
  EXPECT_EQ(NearestName("Watsh", kCommands), "watch");
}

TEST(NearestName, NothingCloseOrAmbiguousSuggestsNothing) {
  EXPECT_EQ(NearestName("frobnicate", kCommands), std::nullopt);
  EXPECT_EQ(NearestName("status", kCommands), std::nullopt);  // exact: no suggestion
  // "ru" is 1 from "run" and 2 from "up": "run" wins; "u" is as short as its distance.
  EXPECT_EQ(NearestName("ru", kCommands), "run");
  EXPECT_EQ(NearestName("x", kCommands), std::nullopt);
  // "stac" is 1 from "stack" and 2 from "status": "stack".
  EXPECT_EQ(NearestName("stac", kCommands), "stack");
  // Equally close to two names: no guess.
  EXPECT_EQ(NearestName("pla", {"plan", "play"}), std::nullopt);
}

TEST(IsCommandLineError, FlagFirstInvalidArgumentsOnly) {
  EXPECT_TRUE(IsCommandLineError(absl::InvalidArgumentError("--experts identity: not with --tp")));
  EXPECT_FALSE(IsCommandLineError(absl::FailedPreconditionError("--owner: leased by x")));
  EXPECT_FALSE(IsCommandLineError(
      absl::InvalidArgumentError("Join failed on 1 of 2 ranks: rank 0: --max-hidden")));
  EXPECT_FALSE(IsCommandLineError(absl::OkStatus()));
}

}  // namespace
}  // namespace moe_ep::client
