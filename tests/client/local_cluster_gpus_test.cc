#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

// GPU detection for the local cluster (CountLocalGpus) and per-worker
// arguments (UseOneWorkerPerGpu), on a fake /dev and script workers.

namespace moe_ep::client {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

class FakeDir : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/moe_ep_local_gpus_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Touch(const std::string& name) { std::ofstream(dir_ + "/" + name) << ""; }

  std::string dir_;
};

TEST_F(FakeDir, CountsNvidiaNumberedNodesOnly) {
  for (const char* name : {"nvidia0", "nvidia1", "nvidia7", "nvidiactl", "nvidia-uvm",
                           "nvidia-uvm-tools", "nvidia-modeset", "nvidia", "nvidia1a"}) {
    Touch(name);
  }
  std::filesystem::create_directory(dir_ + "/nvidia-caps");
  EXPECT_EQ(CountLocalGpus(dir_, nullptr), 3);
}

TEST_F(FakeDir, CudaVisibleDevicesNarrowsTheCount) {
  Touch("nvidia0");
  Touch("nvidia1");
  EXPECT_EQ(CountLocalGpus(dir_, "1"), 1);
  EXPECT_EQ(CountLocalGpus(dir_, "1,0"), 2);
  EXPECT_EQ(CountLocalGpus(dir_, "0,1,2,3"), 2);  // stops at index 2: no such node
  EXPECT_EQ(CountLocalGpus(dir_, "0,-1,1"), 1);   // CUDA stops at the first invalid entry
  EXPECT_EQ(CountLocalGpus(dir_, ""), 0);
  EXPECT_EQ(CountLocalGpus(dir_, "-1"), 0);
  EXPECT_EQ(CountLocalGpus(dir_, "GPU-8f3a,GPU-11ab"), 2);
  EXPECT_EQ(CountLocalGpus(dir_, "GPU-8f3a,GPU-11ab,GPU-0000"), 2);  // at most the nodes
}

TEST(CountLocalGpus, MissingDirectoryIsZero) {
  EXPECT_EQ(CountLocalGpus("/nonexistent/moe_ep_dev", nullptr), 0);
  EXPECT_EQ(CountLocalGpus("/nonexistent/moe_ep_dev", "0"), 0);
}

TEST(UseOneWorkerPerGpu, GivesWorkerIDeviceI) {
  LocalClusterOptions options;
  options.num_workers = 4;
  options.backend = "gloo";
  options.extra_args = {"--log-level=warn"};
  UseOneWorkerPerGpu(2, &options);
  EXPECT_EQ(options.num_workers, 2);
  EXPECT_EQ(options.backend, "nccl");
  ASSERT_EQ(options.per_worker_args.size(), 2u);
  EXPECT_THAT(options.per_worker_args[0], ElementsAre("--device=0"));
  EXPECT_THAT(options.per_worker_args[1], ElementsAre("--device=1"));
  EXPECT_THAT(options.extra_args, ElementsAre("--log-level=warn"));
}

TEST_F(FakeDir, EachWorkerGetsItsOwnArgumentsAfterTheSharedOnes) {
  // The fake worker writes its argv to its log and announces a port.
  const std::string script = dir_ + "/worker";
  std::ofstream(script)
      << "#!/bin/sh\necho \"args: $*\" >&2\n"
      << "echo \"moe-ep-worker listening on 127.0.0.1:$(( $$ % 60000 + 1024 ))\"\n"
      << "exec sleep 1000\n";
  chmod(script.c_str(), 0755);
  LocalClusterOptions options;
  options.worker_binary = script;
  options.log_dir = dir_;
  options.extra_args = {"--log-level=debug"};
  UseOneWorkerPerGpu(2, &options);
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ((*cluster)->num_workers(), 2);
  EXPECT_TRUE((*cluster)->Stop().ok());
  for (int i = 0; i < 2; ++i) {
    std::ifstream log(dir_ + "/worker-" + std::to_string(i) + ".log");
    std::string line;
    std::getline(log, line);
    EXPECT_EQ(line, "args: --listen=127.0.0.1:0 --backend=nccl --log-level=debug --device=" +
                        std::to_string(i));
  }
}

TEST(LocalCluster, PerWorkerArgsMustMatchTheWorkerCount) {
  LocalClusterOptions options;
  options.num_workers = 3;
  options.worker_binary = "/bin/true";
  options.per_worker_args = {{"--device=0"}, {"--device=1"}};
  auto cluster = LocalCluster::Start(options);
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(cluster.status().message()),
              HasSubstr("per_worker_args: expected 3 lists (one per worker), got 2"));
}

}  // namespace
}  // namespace moe_ep::client
