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

}  // namespace
}  // namespace moe_ep::client
