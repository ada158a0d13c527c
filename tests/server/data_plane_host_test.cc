#include "server/data_plane_host.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

TEST(ResolveDataPlaneHost, FlagWinsOverTheInterface) {
  auto host = ResolveDataPlaneHost("10.1.2.3", "lo");
  ASSERT_TRUE(host.ok()) << host.status();
  EXPECT_EQ(*host, "10.1.2.3");
}

TEST(ResolveDataPlaneHost, NeitherGivenIsLoopback) {
  EXPECT_EQ(ResolveDataPlaneHost("", nullptr).value(), "127.0.0.1");
  EXPECT_EQ(ResolveDataPlaneHost("", "").value(), "127.0.0.1");
}

TEST(ResolveDataPlaneHost, LoopbackInterfaceGivesItsIpv4Address) {
  // Every Linux network namespace has "lo" with 127.0.0.1.
  EXPECT_EQ(ResolveDataPlaneHost("", "lo").value(), "127.0.0.1");
  EXPECT_EQ(ResolveDataPlaneHost("", "lo,eth0").value(), "127.0.0.1");  // first name only
}

TEST(ResolveDataPlaneHost, UnknownInterfaceNamesItAndTheVariable) {
  auto host = ResolveDataPlaneHost("", "no-such-if0");
  EXPECT_EQ(host.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(host.status().message(), HasSubstr("GLOO_SOCKET_IFNAME=no-such-if0"));
  EXPECT_THAT(host.status().message(), HasSubstr("does not exist"));
  EXPECT_THAT(host.status().message(), HasSubstr("--data-plane-host"));
}

}  // namespace
}  // namespace moe_ep::server
