#include "client/up_command.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

// How `moe-ep up` starts its workers (PlanUp): the table in client/up_command.h.

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

TEST(PlanUp, GlooKeepsTheWorkerCountEvenWithGpus) {
  const UpPlan plan = *PlanUp("gloo", 3, 8);
  EXPECT_EQ(plan.num_workers, 3);
  EXPECT_EQ(plan.backend, "gloo");
  EXPECT_FALSE(plan.one_per_gpu);
}

TEST(PlanUp, AutoAndNcclWithGpusStartOneNcclWorkerPerGpu) {
  for (const char* backend : {"auto", "nccl"}) {
    const UpPlan plan = *PlanUp(backend, 4, 2);
    EXPECT_EQ(plan.num_workers, 2) << backend;
    EXPECT_EQ(plan.backend, "nccl") << backend;
    EXPECT_TRUE(plan.one_per_gpu) << backend;
  }
}

TEST(PlanUp, AutoWithoutGpusLetsTheWorkersResolveIt) {
  const UpPlan plan = *PlanUp("auto", 4, 0);
  EXPECT_EQ(plan.num_workers, 4);
  EXPECT_EQ(plan.backend, "auto");
  EXPECT_FALSE(plan.one_per_gpu);
}

TEST(PlanUp, NcclWithoutGpusIsFailedPrecondition) {
  absl::StatusOr<UpPlan> plan = PlanUp("nccl", 4, 0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("no NVIDIA GPU found"));
}

}  // namespace
}  // namespace moe_ep::client
