#include "client/target_resolver.h"

#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

TEST(HeadlessServiceTargets, OnePodPerRank) {
  v1::HeadlessService s;
  s.set_service("moe-ep-worker");
  s.set_replicas(2);
  s.set_port(50051);
  EXPECT_EQ(HeadlessServiceTargets(s),
            (std::vector<std::string>{"moe-ep-worker-0.moe-ep-worker:50051",
                                      "moe-ep-worker-1.moe-ep-worker:50051"}));
}

TEST(HeadlessServiceTargets, ProcessesPerPodAndPortsPerPod) {
  v1::HeadlessService s;
  s.set_service("svc.ns.svc.cluster.local");
  s.set_pod_prefix("w");
  s.set_replicas(2);
  s.set_port(100);
  s.set_procs_per_pod(2);
  s.set_port_step(10);
  EXPECT_EQ(HeadlessServiceTargets(s),
            (std::vector<std::string>{
                "w-0.svc.ns.svc.cluster.local:100", "w-0.svc.ns.svc.cluster.local:101",
                "w-1.svc.ns.svc.cluster.local:110", "w-1.svc.ns.svc.cluster.local:111"}));
}

TEST(DefaultTargetResolver, ListedTargetsAsGiven) {
  v1::DesiredState state;
  state.add_targets("127.0.0.1:1");
  state.add_targets("127.0.0.1:2");
  DefaultTargetResolver resolver(
      [](const std::string&) -> absl::StatusOr<std::vector<std::string>> {
        return absl::InternalError("must not be called for listed targets");
      });
  auto t = resolver.Resolve(state);
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(*t, (std::vector<std::string>{"127.0.0.1:1", "127.0.0.1:2"}));
}

TEST(DefaultTargetResolver, PodNotInDnsYetIsUnavailableNamingIt) {
  v1::DesiredState state;
  state.mutable_headless_service()->set_service("moe-ep-worker");
  state.mutable_headless_service()->set_replicas(3);
  state.mutable_headless_service()->set_port(50051);
  std::vector<std::string> asked;
  DefaultTargetResolver resolver(
      [&](const std::string& host) -> absl::StatusOr<std::vector<std::string>> {
        asked.push_back(host);
        if (host == "moe-ep-worker-1.moe-ep-worker") {
          return absl::UnavailableError("host moe-ep-worker-1.moe-ep-worker does not resolve");
        }
        return std::vector<std::string>{"10.0.0.1"};
      });
  auto t = resolver.Resolve(state);
  EXPECT_EQ(t.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(t.status().message().find("moe-ep-worker-1.moe-ep-worker"), std::string::npos)
      << t.status();
  EXPECT_EQ(asked.size(), 2u);  // stops at the first missing pod
}

TEST(SystemHostLookup, ResolvesLocalhost) {
  auto a = SystemHostLookup()("localhost");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_FALSE(a->empty());
}

}  // namespace
}  // namespace moe_ep::client
