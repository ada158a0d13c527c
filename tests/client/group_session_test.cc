#include "client/group_session.h"

#include <unistd.h>

#include <string>

#include "absl/time/time.h"
#include "client/worker_selection.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

TEST(FormWorkerGroup, NoTargetsIsInvalidArgument) {
  AttachedWorkers workers;
  workers.backend = "gloo";
  absl::StatusOr<GroupSession> group = FormWorkerGroup(workers);
  EXPECT_EQ(group.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(group.status().message(), HasSubstr("targets"));
}

TEST(FormWorkerGroup, TwoLocalWorkersJoinGenerationOneWithTheAttachedBackend) {
  const std::string worker = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  if (access(worker.c_str(), X_OK) != 0) GTEST_SKIP() << worker << " is not built";
  WorkerSelection selection;
  selection.num_workers = 2;
  selection.backend = "gloo";
  selection.worker_binary = worker;
  absl::StatusOr<AttachedWorkers> workers = AttachWorkers(selection);
  ASSERT_TRUE(workers.ok()) << workers.status();
  CoordinatorOptions options;
  options.rpc_timeout = absl::Seconds(42);
  options.backend = "nccl";  // replaced by the attached workers' backend
  absl::StatusOr<GroupSession> group = FormWorkerGroup(*workers, options);
  ASSERT_TRUE(group.ok()) << group.status();
  ASSERT_EQ(group->joined.size(), 2u);
  EXPECT_EQ(group->joined[0].backend(), "gloo");
  EXPECT_EQ(group->joined[1].backend(), "gloo");
  EXPECT_EQ(group->coordinator->generation(), 1);
  EXPECT_EQ(group->coordinator->world_size(), 2);
  EXPECT_EQ(group->coordinator->targets(), workers->targets);
  EXPECT_EQ(group->coordinator->options().backend, "gloo");
  EXPECT_EQ(group->coordinator->options().rpc_timeout, absl::Seconds(42));
  EXPECT_EQ(group->coordinator->options().channel_credentials, nullptr);
}

// Issue 31 item 2: a group an earlier client left with experts loaded is
// not re-formed without --take-over; one message names ranks, generation,
// bytes and the way out.
TEST(CheckNoGroupWithExperts, RefusesToDropTheExpertsOfAnUnleasedGroup) {
  std::vector<v1::GetStatusResponse> status(4);
  for (int r = 0; r < 4; ++r) {
    status[r].set_rank(r);
    status[r].set_state(v1::WORKER_STATE_ALLOCATED);
    status[r].set_generation(3);
    status[r].set_expert_bytes(int64_t{3} << 20);
  }
  const std::vector<std::string> targets = {"h:1", "h:2", "h:3", "h:4"};
  const absl::Status refused = CheckNoGroupWithExperts(status, targets, "moe-ep@b:7");
  EXPECT_EQ(refused.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.message(), HasSubstr("ranks 0-3 of 4 (h:1, ...) in generation 3 hold "
                                           "12.0 MiB of experts"));
  EXPECT_THAT(refused.message(), HasSubstr("no client holds their lease"));
  EXPECT_THAT(refused.message(), HasSubstr("Nothing was changed"));
  EXPECT_THAT(refused.message(), HasSubstr("--take-over"));
  EXPECT_THAT(refused.message(), HasSubstr("moe-ep run --attach"));

  // Another owner's live lease: the lease refuses instead (naming the owner).
  std::vector<v1::GetStatusResponse> leased = status;
  leased[2].set_lease_owner("coordinator@pod");
  EXPECT_TRUE(CheckNoGroupWithExperts(leased, targets, "moe-ep@b:7").ok());
  // This client's own lease: its group to re-form.
  for (auto& s : leased) s.set_lease_owner("moe-ep@b:7");
  EXPECT_TRUE(CheckNoGroupWithExperts(leased, targets, "moe-ep@b:7").ok());
  // No experts, or a broken group: nothing to keep.
  std::vector<v1::GetStatusResponse> empty = status;
  for (auto& s : empty) s.set_expert_bytes(0);
  EXPECT_TRUE(CheckNoGroupWithExperts(empty, targets, "").ok());
  std::vector<v1::GetStatusResponse> broken = status;
  for (auto& s : broken) s.set_group_broken(true);
  EXPECT_TRUE(CheckNoGroupWithExperts(broken, targets, "").ok());
  // One rank of them is enough.
  empty[1].set_expert_bytes(1024);
  const absl::Status one = CheckNoGroupWithExperts(empty, targets, "");
  EXPECT_THAT(one.message(), HasSubstr("rank 1 of 4 (h:2) in generation 3 holds 1.00 KiB"));
}

}  // namespace
}  // namespace moe_ep::client
