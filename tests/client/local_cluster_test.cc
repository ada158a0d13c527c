#include "client/local_cluster.h"

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <vector>

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
    std::string path = dir_ + "/" + name;
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

TEST_F(ScriptWorker, WorkerKilledFromOutsideIsReapedAndReportedAtOnce) {
  std::mutex mu;
  std::vector<WorkerExit> reported;
  LocalClusterOptions options;
  options.num_workers = 3;
  options.worker_binary =
      Script("worker",
             "echo \"moe-ep-worker listening on 127.0.0.1:$(( $$ % 60000 + 1024 ))\"\n"
             "exec sleep 1000");
  options.on_exit = [&](const WorkerExit& exit) {
    std::lock_guard<std::mutex> lock(mu);
    reported.push_back(exit);
  };
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const pid_t victim = (*cluster)->pid(2);
  ASSERT_EQ(kill(victim, SIGKILL), 0);  // as the OOM killer would
  auto exit = (*cluster)->WaitForExit(absl::Seconds(5));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->index, 2);
  EXPECT_EQ(exit->pid, victim);
  EXPECT_EQ(exit->target, (*cluster)->targets()[2]);
  EXPECT_TRUE(WIFSIGNALED(exit->wait_status));
  EXPECT_EQ(WTERMSIG(exit->wait_status), SIGKILL);
  EXPECT_FALSE(exit->sent_by_us);
  EXPECT_EQ(exit->description,
            absl::StrCat("worker 2 (pid ", victim, ", ", (*cluster)->targets()[2],
                         ") was killed by signal 9 (", strsignal(SIGKILL), ")"));
  // Reaped, not defunct: the pid is gone.
  EXPECT_EQ(kill(victim, 0), -1);
  EXPECT_FALSE((*cluster)->IsRunning(2));
  {
    std::lock_guard<std::mutex> lock(mu);
    ASSERT_EQ(reported.size(), 1u);
    EXPECT_EQ(reported[0].description, exit->description);
  }
  // A planned stop reports nothing more.
  EXPECT_TRUE((*cluster)->Stop().ok());
  EXPECT_EQ((*cluster)->Exits().size(), 1u);
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(reported.size(), 1u);
}

TEST_F(ScriptWorker, WorkerThatExitsByItselfIsReportedWithItsExitCode) {
  LocalClusterOptions options;
  options.num_workers = 2;
  options.log_dir = dir_;
  options.worker_binary = Script("worker",
                                 "echo 'moe-ep-worker listening on 127.0.0.1:7'\n"
                                 // mkdir is atomic: exactly one worker dies.
                                 "if mkdir " +
                                     dir_ +
                                     "/die 2>/dev/null; then sleep 0.3; exit 3; fi\n"
                                     "exec sleep 1000");
  options.on_exit = [](const WorkerExit&) {};
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  auto exit = (*cluster)->WaitForExit(absl::Seconds(5));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_TRUE(WIFEXITED(exit->wait_status));
  EXPECT_EQ(WEXITSTATUS(exit->wait_status), 3);
  EXPECT_THAT(exit->description, HasSubstr(absl::StrCat("worker ", exit->index, " (pid ")));
  EXPECT_THAT(exit->description, HasSubstr(") exited with exit code 3; its log: " + dir_ +
                                           "/worker-" + std::to_string(exit->index) + ".log"));
  EXPECT_EQ((*cluster)->Exits().size(), 1u);
}

TEST_F(ScriptWorker, KillIsReportedAsSentByUs) {
  LocalClusterOptions options;
  options.num_workers = 2;
  options.worker_binary = Script("worker",
                                 "echo 'moe-ep-worker listening on 127.0.0.1:7'\n"
                                 "exec sleep 1000");
  options.on_exit = [](const WorkerExit&) {};
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  ASSERT_TRUE((*cluster)->Kill(0, SIGTERM).ok());
  auto exit = (*cluster)->WaitForExit(absl::Seconds(5));
  ASSERT_TRUE(exit.ok()) << exit.status();
  EXPECT_EQ(exit->index, 0);
  EXPECT_TRUE(exit->sent_by_us);
  EXPECT_THAT(exit->description, HasSubstr("was killed by signal 15"));
  EXPECT_THAT(exit->description, HasSubstr("(sent by moe-ep)"));
}

TEST_F(ScriptWorker, WaitForExitTimesOutWhileAllRun) {
  LocalClusterOptions options;
  options.num_workers = 1;
  options.worker_binary = Script("worker",
                                 "echo 'moe-ep-worker listening on 127.0.0.1:7'\n"
                                 "exec sleep 1000");
  auto cluster = LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  EXPECT_EQ((*cluster)->WaitForExit(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE((*cluster)->Stop().ok());
  EXPECT_TRUE((*cluster)->Exits().empty());
}

}  // namespace
}  // namespace moe_ep::client
