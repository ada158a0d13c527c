#include "client/worker_selection.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

TEST(AttachWorkers, TargetsNeedNoCluster) {
  WorkerSelection w;
  w.targets = "127.0.0.1:5000,127.0.0.1:5001";
  auto attached = AttachWorkers(w);
  ASSERT_TRUE(attached.ok()) << attached.status();
  EXPECT_EQ(attached->cluster, nullptr);
  EXPECT_THAT(attached->targets, ElementsAre("127.0.0.1:5000", "127.0.0.1:5001"));
  w.targets = "127.0.0.1:5000,127.0.0.1:5000";
  EXPECT_EQ(AttachWorkers(w).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(AttachWorkers, StartsLocalWorkersWithBackendLogLevelAndMemoryCap) {
  char tmpl[] = "/tmp/moe_ep_worker_selection_test_XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  const std::string script = dir + "/worker";
  std::ofstream(script) << "#!/bin/sh\necho \"args: $*\" >&2\n"
                           "echo 'moe-ep-worker listening on 127.0.0.1:9'\nexec sleep 1000\n";
  chmod(script.c_str(), 0755);
  WorkerSelection w;
  w.num_workers = 2;
  w.backend = "auto";
  w.worker_binary = script;
  w.log_dir = dir;
  w.worker_log_level = "error";
  w.worker_memory_cap_bytes = 123456;
  {
    auto attached = AttachWorkers(w);
    ASSERT_TRUE(attached.ok()) << attached.status();
    ASSERT_NE(attached->cluster, nullptr);
    EXPECT_THAT(attached->targets, ElementsAre("127.0.0.1:9", "127.0.0.1:9"));
  }  // the cluster stops here
  std::ifstream log(dir + "/worker-1.log");
  const std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
  EXPECT_THAT(
      text,
      HasSubstr(
          "args: --listen=127.0.0.1:0 --backend=auto --log_level=error --memory_cap_bytes=123456"));
  std::filesystem::remove_all(dir);
}

// How local workers are started: the table in client/worker_selection.h.
TEST(PlanLocalWorkers, GlooKeepsTheWorkerCountEvenWithGpus) {
  const LocalWorkerPlan plan = *PlanLocalWorkers("gloo", 3, 8);
  EXPECT_EQ(plan.num_workers, 3);
  EXPECT_EQ(plan.backend, "gloo");
  EXPECT_FALSE(plan.one_per_gpu);
}

TEST(PlanLocalWorkers, AutoAndNcclWithGpusStartOneNcclWorkerPerGpu) {
  for (const char* backend : {"auto", "nccl"}) {
    const LocalWorkerPlan plan = *PlanLocalWorkers(backend, 4, 2);
    EXPECT_EQ(plan.num_workers, 2) << backend;
    EXPECT_EQ(plan.backend, "nccl") << backend;
    EXPECT_TRUE(plan.one_per_gpu) << backend;
  }
}

TEST(PlanLocalWorkers, AutoWithoutGpusLetsTheWorkersResolveIt) {
  const LocalWorkerPlan plan = *PlanLocalWorkers("auto", 4, 0);
  EXPECT_EQ(plan.num_workers, 4);
  EXPECT_EQ(plan.backend, "auto");
  EXPECT_FALSE(plan.one_per_gpu);
}

TEST(PlanLocalWorkers, NcclWithoutGpusIsFailedPrecondition) {
  absl::StatusOr<LocalWorkerPlan> plan = PlanLocalWorkers("nccl", 4, 0);
  EXPECT_EQ(plan.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(plan.status().message()), HasSubstr("no NVIDIA GPU found"));
}

}  // namespace
}  // namespace moe_ep::client
