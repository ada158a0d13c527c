#include "client/group_keeper.h"

#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

v1::DesiredState UnreachableState() {
  v1::DesiredState s;
  s.add_targets("127.0.0.1:9");  // discard: closed on test machines (connection refused)
  s.add_targets("127.0.0.1:7");  // echo: likewise
  s.mutable_experts()->set_kind(v1::EXPERT_KIND_IDENTITY);
  return s;
}

TEST(GroupKeeper, RejectsBadOptions) {
  GroupKeeperOptions o;
  o.probe_timeout = absl::ZeroDuration();
  auto k = GroupKeeper::Start(o);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("probe_timeout"), std::string::npos) << k.status();
  o = GroupKeeperOptions();
  o.backoff_max = absl::Milliseconds(1);
  k = GroupKeeper::Start(o);
  EXPECT_NE(k.status().message().find("backoff_max"), std::string::npos) << k.status();
  o = GroupKeeperOptions();
  o.probe_failure_threshold = 0;
  k = GroupKeeper::Start(o);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(k.status().message().find("probe_failure_threshold: expected >= 1, got 0"),
            std::string::npos)
      << k.status();
}

TEST(GroupKeeper, RejectsAnInvalidInitialState) {
  v1::DesiredState s;  // no targets, no headless_service
  auto k = GroupKeeper::Start(GroupKeeperOptions(), s);
  EXPECT_EQ(k.status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(GroupKeeper, WithoutADesiredStateDoesNothing) {
  auto k = GroupKeeper::Start(GroupKeeperOptions());
  ASSERT_TRUE(k.ok()) << k.status();
  const v1::GetGroupResponse g = (*k)->Snapshot();
  EXPECT_EQ(g.phase(), v1::GROUP_PHASE_UNSPECIFIED);
  EXPECT_EQ(g.desired_version(), 0);
  EXPECT_EQ(g.ranks_size(), 0);
  EXPECT_FALSE((*k)->ready());
}

TEST(GroupKeeper, UnreachableRanksAreShownAndNothingIsFormed) {
  GroupKeeperOptions o;
  o.probe_interval = absl::Milliseconds(50);
  auto k = GroupKeeper::Start(o, UnreachableState());
  ASSERT_TRUE(k.ok()) << k.status();
  v1::GetGroupResponse g;
  for (int i = 0; i < 400; ++i) {  // up to 20 s on a loaded machine
    g = (*k)->Snapshot();
    if (g.ranks_size() == 2 && g.ranks(0).state() == v1::RANK_STATE_UNREACHABLE &&
        g.ranks(1).state() == v1::RANK_STATE_UNREACHABLE) {
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_EQ(g.ranks_size(), 2) << g.DebugString();
  EXPECT_EQ(g.ranks(0).state(), v1::RANK_STATE_UNREACHABLE) << g.DebugString();
  EXPECT_EQ(g.ranks(1).target(), "127.0.0.1:7");
  EXPECT_EQ(g.phase(), v1::GROUP_PHASE_WAITING);
  EXPECT_EQ(g.formations(), 0);
  EXPECT_EQ(g.failed_attempts(), 0);              // no attempt while a rank does not answer
  EXPECT_EQ(g.desired().capacity_tokens(), 384);  // reported with its defaults
}

TEST(GroupKeeper, ApplyOfTheSameStateChangesNothingAndABadOneIsRefused) {
  auto k = GroupKeeper::Start(GroupKeeperOptions(), UnreachableState());
  ASSERT_TRUE(k.ok()) << k.status();
  v1::DesiredState same = UnreachableState();
  same.set_layers(3);  // the default, spelled out
  auto applied = (*k)->Apply(same);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_FALSE(applied->changed());
  EXPECT_EQ(applied->desired_version(), 1);
  v1::DesiredState bad = UnreachableState();
  bad.set_backend("mpi");
  EXPECT_EQ((*k)->Apply(bad).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ((*k)->Snapshot().desired_version(), 1);
  v1::DesiredState other = UnreachableState();
  other.set_layers(2);
  applied = (*k)->Apply(other);
  ASSERT_TRUE(applied.ok()) << applied.status();
  EXPECT_TRUE(applied->changed());
  EXPECT_EQ(applied->desired_version(), 2);
}

}  // namespace
}  // namespace moe_ep::client
