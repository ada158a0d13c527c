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

}  // namespace
}  // namespace moe_ep::client
