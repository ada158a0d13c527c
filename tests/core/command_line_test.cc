#include "core/command_line.h"

#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace {

TEST(CheckAtLeast, AcceptsValuesInRange) {
  EXPECT_EQ(CheckAtLeast("1", 0, /*strict=*/true), "");
  EXPECT_EQ(CheckAtLeast("0.5", 0, true), "");
  EXPECT_EQ(CheckAtLeast("0", 0, /*strict=*/false), "");
  EXPECT_EQ(CheckAtLeast("1e-06", 0, false), "");
}

TEST(CheckAtLeast, NamesTheBoundAndTheValue) {
  EXPECT_EQ(CheckAtLeast("0", 0, true), "expected a number > 0, got 0");
  EXPECT_EQ(CheckAtLeast("-3", 0, true), "expected a number > 0, got -3");
  EXPECT_EQ(CheckAtLeast("-1", 0, false), "expected a number >= 0, got -1");
  EXPECT_EQ(CheckAtLeast("abc", 0, false), "expected a number >= 0, got abc");
  EXPECT_EQ(CheckAtLeast("nan", 0, false), "expected a number >= 0, got nan");
  EXPECT_EQ(CheckAtLeast("0.25", 0.5, false), "expected a number >= 0.5, got 0.25");
  // The message stays short (the CLI11 bound was DBL_MAX, 309 digits).
  EXPECT_LT(CheckAtLeast("-1", 0, true).size(), 40u);
}

TEST(UnderscoreSpelling, ReplacesEveryDash) {
  EXPECT_EQ(UnderscoreSpelling("log-level"), "log_level");
  EXPECT_EQ(UnderscoreSpelling("tls-client-ca"), "tls_client_ca");
  EXPECT_EQ(UnderscoreSpelling("listen"), "listen");
}

TEST(Version, IsMajorMinorPatch) {
  EXPECT_THAT(std::string(Version()), ::testing::MatchesRegex("[0-9]+\\.[0-9]+\\.[0-9]+"));
}

TEST(ExitBadCommandLine, IsTwo) { EXPECT_EQ(kExitBadCommandLine, 2); }

}  // namespace
}  // namespace moe_ep::core
