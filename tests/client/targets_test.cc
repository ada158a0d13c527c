#include "client/targets.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(SplitHostPort, ParsesIpv4HostnameAndIpv6) {
  auto a = SplitHostPort("127.0.0.1:50051");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "127.0.0.1");
  EXPECT_EQ(a->port, 50051);
  auto b = SplitHostPort("worker-0.moe-ep:1");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->host, "worker-0.moe-ep");
  EXPECT_EQ(b->port, 1);
  auto c = SplitHostPort("[::1]:65535");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->host, "::1");
  EXPECT_EQ(c->port, 65535);
}

TEST(SplitHostPort, RejectsMalformed) {
  for (const char* bad :
       {"localhost", ":80", "host:", "host:0", "host:65536", "host:8x", "[::1]80", "[::1"}) {
    auto s = SplitHostPort(bad);
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_THAT(s.status().message(), HasSubstr(bad)) << bad;
  }
}

TEST(ParseTargets, SplitsAndTrims) {
  auto t = ParseTargets("127.0.0.1:1, 127.0.0.1:2 ,10.0.0.3:50051");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_THAT(*t, ElementsAre("127.0.0.1:1", "127.0.0.1:2", "10.0.0.3:50051"));
}

TEST(ParseTargets, RejectsEmptyEntryNamingItsPosition) {
  auto t = ParseTargets("127.0.0.1:1,,127.0.0.1:2");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("entry 1 is empty"));
  EXPECT_EQ(ParseTargets("").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ParseTargets, RejectsBadPortNamingEntry) {
  auto t = ParseTargets("127.0.0.1:1,127.0.0.1:99999");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("entry 1"));
  EXPECT_THAT(t.status().message(), HasSubstr("99999"));
}

TEST(ParseTargets, RejectsDuplicates) {
  auto t = ParseTargets("127.0.0.1:1,127.0.0.1:1");
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("appears twice"));
}

TEST(FormatRankList, RunsOfThreeOrMoreAreRanges) {
  EXPECT_EQ(FormatRankList({0, 1, 2, 3}), "0-3");
  EXPECT_EQ(FormatRankList({0, 2, 5}), "0, 2, 5");
  EXPECT_EQ(FormatRankList({1, 2}), "1, 2");
  EXPECT_EQ(FormatRankList({0, 1, 2, 7, 9, 10, 11}), "0-2, 7, 9-11");
  EXPECT_EQ(FormatRankList({4}), "4");
  EXPECT_EQ(FormatRankList({}), "");
}

}  // namespace
}  // namespace moe_ep::client
