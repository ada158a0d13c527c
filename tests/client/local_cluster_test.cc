#include "client/local_cluster.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

// Writes an executable shell script standing in for moe-ep-worker.
class ScriptWorker : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/moe_ep_local_cluster_test_XXXXXX";
    ASSERT_NE(mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Script(const std::string& name, const std::string& body) {
    const std::string path = dir_ + "/" + name;
    std::ofstream(path) << "#!/bin/sh\n" << body << "\n";
    chmod(path.c_str(), 0755);
    return path;
  }

  std::string dir_;
};

TEST(ParseListeningLine, AcceptsTheWorkersAnnouncement) {
  auto a = ParseListeningLine("moe-ep-worker listening on 127.0.0.1:45123\n");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(*a, "127.0.0.1:45123");
  EXPECT_EQ(ParseListeningLine("listening on 127.0.0.1:1").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseListeningLine("moe-ep-worker listening on 127.0.0.1").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(DefaultWorkerBinary, IsNextToThisExecutable) {
  auto path = DefaultWorkerBinary();
  ASSERT_TRUE(path.ok());
  const std::filesystem::path self = std::filesystem::read_symlink("/proc/self/exe");
  EXPECT_EQ(*path, (self.parent_path() / "moe-ep-worker").string());
}

TEST_F(ScriptWorker, StartsReadsAddressesAndStops) {
  // Each fake worker echoes its arguments into its log, announces a port
  // derived from its pid, then waits to be terminated.
  LocalClusterOptions options;
  options.num_workers = 3;
  options.worker_binary =
      Script("worker",
             "echo \"args: $*\" >&2\necho 'starting'\n"
             "echo \"moe-ep-worker listening on 127.0.0.1:$(( $$ % 60000 + 1024 ))\"\n"
             "exec sleep 1000");
  options.log_dir = dir_;
  options.extra_args = {"--log-level=debug"};
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_EQ((*cluster)->num_workers(), 3);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ((*cluster)->targets()[i],
              absl::StrCat("127.0.0.1:", (*cluster)->pid(i) % 60000 + 1024));
    EXPECT_TRUE((*cluster)->IsRunning(i));
  }
  EXPECT_TRUE((*cluster)->Stop().ok());
  for (int i = 0; i < 3; ++i) {
    EXPECT_FALSE((*cluster)->IsRunning(i));
    EXPECT_EQ(kill((*cluster)->pid(i), 0), -1);  // reaped: no such process
    std::ifstream log(absl::StrCat(dir_, "/worker-", i, ".log"));
    std::string text((std::istreambuf_iterator<char>(log)), std::istreambuf_iterator<char>());
    EXPECT_THAT(text, HasSubstr("args: --listen=127.0.0.1:0 --backend=gloo --log-level=debug"));
    EXPECT_THAT(text, HasSubstr("starting"));  // non-address stdout goes to the log
  }
  EXPECT_TRUE((*cluster)->Stop().ok());  // idempotent
}

TEST_F(ScriptWorker, KillOneWorker) {
  LocalClusterOptions options;
  options.num_workers = 2;
  options.worker_binary = Script("worker",
                                 "echo 'moe-ep-worker listening on 127.0.0.1:7'\n"
                                 "exec sleep 1000");
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_TRUE((*cluster)->Kill(1, SIGKILL).ok());
  EXPECT_FALSE((*cluster)->IsRunning(1));
  EXPECT_TRUE((*cluster)->IsRunning(0));
  EXPECT_EQ((*cluster)->Kill(1, SIGTERM).code(), absl::StatusCode::kNotFound);
  EXPECT_EQ((*cluster)->Kill(2, SIGTERM).code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ScriptWorker, WorkerIgnoringSigtermIsKilled) {
  LocalClusterOptions options;
  options.num_workers = 1;
  options.stop_timeout = absl::Milliseconds(200);
  options.worker_binary = Script("worker",
                                 "trap '' TERM\n"
                                 "echo 'moe-ep-worker listening on 127.0.0.1:7'\n"
                                 "while true; do sleep 0.05; done");
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const absl::Status s = (*cluster)->Stop();
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(s.message(), HasSubstr("1 worker(s) ignored SIGTERM"));
  EXPECT_FALSE((*cluster)->IsRunning(0));
}

TEST_F(ScriptWorker, WorkerExitingEarlyIsUnavailable) {
  LocalClusterOptions options;
  options.num_workers = 2;
  options.log_dir = dir_;
  options.worker_binary = Script("worker", "echo 'bad flag' >&2\nexit 3");
  auto cluster = LocalCluster::Start(options);
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(cluster.status().message(), HasSubstr("exited with exit code 3"));
}

TEST_F(ScriptWorker, SilentWorkerTimesOut) {
  LocalClusterOptions options;
  options.num_workers = 1;
  options.start_timeout = absl::Milliseconds(300);
  options.worker_binary = Script("worker", "exec sleep 1000");
  auto cluster = LocalCluster::Start(options);
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kDeadlineExceeded);
  EXPECT_THAT(cluster.status().message(), HasSubstr("worker(s) 0 printed no"));
}

TEST_F(ScriptWorker, MissingBinaryIsNotFound) {
  LocalClusterOptions options;
  options.worker_binary = dir_ + "/does-not-exist";
  auto cluster = LocalCluster::Start(options);
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(cluster.status().message(), HasSubstr("--worker-binary"));
}

TEST_F(ScriptWorker, BadOptionsAreInvalidArgument) {
  LocalClusterOptions options;
  options.num_workers = 0;
  EXPECT_EQ(LocalCluster::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
  options.num_workers = 1;
  options.backend = "";
  EXPECT_EQ(LocalCluster::Start(options).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST_F(ScriptWorker, UnwritableLogDirIsNotFound) {
  LocalClusterOptions options;
  options.num_workers = 1;
  options.worker_binary = Script("worker", "exec sleep 1000");
  options.log_dir = dir_ + "/no/such/dir";
  auto cluster = LocalCluster::Start(options);
  EXPECT_EQ(cluster.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(cluster.status().message(), HasSubstr("--log-dir"));
}

}  // namespace
}  // namespace moe_ep::client
