#include "server/worker_state.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

TEST(WorkerStateMachine, StartsInStartedAndRefusesLaterCalls) {
  WorkerStateMachine sm;
  EXPECT_EQ(sm.phase(), WorkerPhase::kStarted);
  EXPECT_EQ(ToProto(sm.phase()), v1::WORKER_STATE_STARTED);
  absl::Status s = sm.Require(WorkerPhase::kConfigured, "AllocateWorkspace");
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "AllocateWorkspace requires state CONFIGURED or later; worker is STARTED");
}

TEST(WorkerStateMachine, FullLifecycleAndReconfiguration) {
  WorkerStateMachine sm;
  sm.Joined();
  EXPECT_EQ(sm.phase(), WorkerPhase::kJoined);
  EXPECT_TRUE(sm.Require(WorkerPhase::kJoined, "ConfigureLayers").ok());
  EXPECT_EQ(sm.Require(WorkerPhase::kAllocated, "Forward").code(),
            absl::StatusCode::kFailedPrecondition);
  sm.Configured();
  EXPECT_EQ(sm.phase(), WorkerPhase::kConfigured);
  sm.Allocated();
  EXPECT_EQ(sm.phase(), WorkerPhase::kAllocated);
  EXPECT_EQ(ToProto(sm.phase()), v1::WORKER_STATE_ALLOCATED);
  // Reconfiguring while allocated keeps the workspace.
  sm.Configured();
  EXPECT_EQ(sm.phase(), WorkerPhase::kAllocated);
  sm.Left();
  EXPECT_EQ(sm.phase(), WorkerPhase::kStarted);
}

TEST(WorkerStateMachine, BrokenGroupRefusesCollectivesUntilRejoin) {
  WorkerStateMachine sm;
  sm.Joined();
  sm.Configured();
  sm.Allocated();
  sm.MarkBroken("gloo allgather on rank 0 did not complete within 2s");
  EXPECT_TRUE(sm.broken());
  EXPECT_EQ(sm.phase(), WorkerPhase::kAllocated);  // kept for GetStatus
  EXPECT_TRUE(sm.Require(WorkerPhase::kAllocated, "CommitGeometry").ok());
  absl::Status s = sm.RequireGroup(WorkerPhase::kAllocated, "Forward", 3);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(s.message(), HasSubstr("group of generation 3 is broken"));
  EXPECT_THAT(s.message(), HasSubstr("re-join with a new generation"));
  sm.Joined();
  EXPECT_FALSE(sm.broken());
  EXPECT_EQ(sm.phase(), WorkerPhase::kJoined);
  EXPECT_TRUE(sm.RequireGroup(WorkerPhase::kJoined, "ConfigureLayers", 4).ok());
}

TEST(WorkerStateMachine, LeaveClearsBroken) {
  WorkerStateMachine sm;
  sm.Joined();
  sm.MarkBroken("");
  EXPECT_TRUE(sm.broken());
  sm.Left();
  EXPECT_FALSE(sm.broken());
  EXPECT_EQ(WorkerPhaseName(sm.phase()), "STARTED");
}

}  // namespace
}  // namespace moe_ep::server
