// What an operator sees and touches (issue 31 items 1, 2 and 5), with the
// real binaries on loopback: `moe-ep coordinator` serving 2 Gloo workers,
// driven by `moe-ep coordinator status|apply|drain`, `moe-ep status` and
// `watch`, refused `bench --targets` (the lease, one message), its JSON log
// and the workers' RPC log; `moe-ep up` leasing its own workers; a group
// `up --targets` left with experts not re-formed without --take-over.

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/worker.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/integration/cli_runner.h"

namespace moe_ep::testing {
namespace {

namespace v1 = ::moe_ep::v1;
using ::testing::HasSubstr;

// A process started in the background: stdout read line by line through a
// pipe, stderr into a file. Killed (SIGKILL) if still running at the end.
class Background {
 public:
  Background(std::vector<std::string> argv, const std::string& stderr_file) {
    int out[2];
    if (pipe(out) != 0) return;
    pid_ = fork();
    if (pid_ == 0) {
      dup2(out[1], STDOUT_FILENO);
      const int err = open(stderr_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      dup2(err, STDERR_FILENO);
      close(out[0]);
      std::vector<char*> args;
      args.reserve(argv.size() + 1);
      for (std::string& a : argv) args.push_back(a.data());
      args.push_back(nullptr);
      execv(args[0], args.data());
      _exit(127);
    }
    close(out[1]);
    out_ = out[0];
  }
  ~Background() {
    if (pid_ > 0 && !exited_) {
      kill(pid_, SIGKILL);
      (void)Wait(absl::Seconds(10));
    }
    if (out_ >= 0) close(out_);
  }

  // The next stdout line that contains `needle` (earlier lines are kept in
  // output()), or "" after `timeout`.
  std::string LineWith(const std::string& needle, absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    while (absl::Now() < deadline) {
      const size_t end = buffer_.find('\n', scanned_);
      if (end != std::string::npos) {
        std::string line = buffer_.substr(scanned_, end - scanned_);
        scanned_ = end + 1;
        if (absl::StrContains(line, needle)) return line;
        continue;
      }
      pollfd p{out_, POLLIN, 0};
      if (poll(&p, 1, 100) > 0) {
        char chunk[4096];
        const ssize_t n = read(out_, chunk, sizeof(chunk));
        if (n <= 0) return "";
        buffer_.append(chunk, static_cast<size_t>(n));
      }
    }
    return "";
  }
  const std::string& output() const { return buffer_; }
  bool Signal(int signo) { return pid_ > 0 && kill(pid_, signo) == 0; }
  // The wait status once it exits within `timeout`; -1 otherwise.
  int Wait(absl::Duration timeout) {
    const absl::Time deadline = absl::Now() + timeout;
    int status = 0;
    while (absl::Now() < deadline) {
      if (waitpid(pid_, &status, WNOHANG) == pid_) {
        exited_ = true;
        return status;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
    return -1;
  }

 private:
  pid_t pid_ = -1;
  int out_ = -1;
  bool exited_ = false;
  std::string buffer_;
  size_t scanned_ = 0;
};

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

int Count(const std::string& text, const std::string& needle) {
  int n = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + 1)) ++n;
  return n;
}

std::string Dir() {
  std::string dir = absl::StrCat(::testing::TempDir(), "/coordinator-process-", getpid());
  mkdir(dir.c_str(), 0755);
  return dir;
}

v1::GetStatusResponse WorkerStatus(const std::string& target) {
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  context.set_wait_for_ready(true);  // a fresh channel: gRPC 1.51 may fail its first connect
  v1::GetStatusResponse response;
  EXPECT_TRUE(stub->GetStatus(&context, v1::GetStatusRequest(), &response).ok()) << target;
  return response;
}

// Runs `moe-ep <args>` every 100 ms until its output has `needle`.
CliResult RunUntil(const std::string& args, const std::string& needle, absl::Duration timeout) {
  const absl::Time deadline = absl::Now() + timeout;
  CliResult r;
  do {
    r = RunMoeEp(args);
    if (absl::StrContains(r.output, needle)) return r;
    absl::SleepFor(absl::Milliseconds(100));
  } while (absl::Now() < deadline);
  return r;
}

class CoordinatorProcessTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = Dir();
    client::LocalClusterOptions options;
    options.num_workers = 2;
    options.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
    options.log_dir = dir_;
    options.extra_args = {"--log-level=debug"};
    auto cluster = client::LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    targets_ = absl::StrJoin(cluster_->targets(), ",");
  }
  void TearDown() override {
    if (cluster_ != nullptr) (void)cluster_->Stop();
  }

  std::string dir_;
  std::unique_ptr<client::LocalCluster> cluster_;
  std::string targets_;
};

TEST_F(CoordinatorProcessTest, AnOperatorSeesTheGroupDrivesTheCoordinatorAndReadsItsLog) {
  const std::string log = dir_ + "/coordinator.log";
  Background coordinator({MoeEpBinary(),
                          "coordinator",
                          "--listen",
                          "127.0.0.1:0",
                          "--targets",
                          targets_,
                          "--experts",
                          "swiglu",
                          "--layers",
                          "1",
                          "--capacity",
                          "16",
                          "--model",
                          "tiny-moe",
                          "--owner",
                          "coordinator@proc",
                          "--probe-interval-ms",
                          "100",
                          "--log-format",
                          "json",
                          "--log-level",
                          "debug"},
                         log);
  const std::string listening = coordinator.LineWith("listening on", absl::Seconds(30));
  ASSERT_FALSE(listening.empty()) << ReadFile(log);
  const std::string at = listening.substr(listening.rfind(' ') + 1);

  // coordinator status: READY, each rank READY.
  CliResult status =
      RunUntil(absl::StrCat("coordinator status --target ", at), "phase READY", absl::Seconds(60));
  ASSERT_EQ(status.exit_code, 0) << status.output;
  ASSERT_THAT(status.output, HasSubstr("phase READY, generation 1")) << status.output;
  EXPECT_EQ(Count(status.output, "  READY  "), 2) << status.output;
  EXPECT_THAT(status.output, HasSubstr("formed"));
  const CliResult json = RunMoeEp(absl::StrCat("coordinator status --json --target ", at));
  ASSERT_EQ(json.exit_code, 0) << json.output;
  const nlohmann::json g = nlohmann::json::parse(json.output);
  EXPECT_EQ(g["phase"], "GROUP_PHASE_READY");
  EXPECT_EQ(g["ranks"].size(), 2u);
  EXPECT_EQ(g["desired"]["capacity_tokens"], 16);

  // `moe-ep status` of the coordinator's address says what it is.
  const CliResult wrong = RunMoeEp(absl::StrCat("status --targets ", at));
  EXPECT_EQ(wrong.exit_code, 1);
  EXPECT_THAT(wrong.output, HasSubstr("NOT_A_WORKER"));
  EXPECT_THAT(wrong.output, HasSubstr("this is a coordinator"));
  EXPECT_THAT(wrong.output,
              HasSubstr(absl::StrCat("use `moe-ep coordinator status --target ", at)));

  // `moe-ep status --json` of the workers: every field, the group, the lease.
  const CliResult workers = RunMoeEp(absl::StrCat("status --json --targets ", targets_), false);
  ASSERT_EQ(workers.exit_code, 0) << workers.output;
  const nlohmann::json w = nlohmann::json::parse(workers.output)["workers"];
  ASSERT_EQ(w.size(), 2u);
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(w[r]["generation"], 1);
    EXPECT_EQ(w[r]["group"], "ready");
    EXPECT_EQ(w[r]["capacity_tokens"], 16);
    EXPECT_GT(w[r]["memory_cap_bytes"].get<int64_t>(), 0);
    EXPECT_EQ(w[r]["masked_ranks"], nlohmann::json::array());
    EXPECT_EQ(w[r]["lease_owner"], "coordinator@proc");
    EXPECT_EQ(w[r]["memory_used_bytes"].get<int64_t>(),
              w[r]["workspace_bytes"].get<int64_t>() + w[r]["expert_bytes"].get<int64_t>());
  }
  const CliResult table = RunMoeEp(absl::StrCat("status --targets ", targets_), false);
  EXPECT_THAT(table.output, HasSubstr("gen 1 ready"));
  EXPECT_THAT(table.output, HasSubstr("coordinator@proc"));
  // watch into a pipe: plain tables, no ANSI codes.
  const CliResult watched =
      RunMoeEp(absl::StrCat("watch --count 2 --interval-ms 50 --targets ", targets_));
  EXPECT_EQ(watched.exit_code, 0) << watched.output;
  EXPECT_EQ(Count(watched.output, "moe-ep watch: 2 workers"), 2);
  EXPECT_EQ(watched.output.find('\x1b'), std::string::npos);

  // Another client is refused once, naming the owner, for both ranks.
  const CliResult bench = RunMoeEp(absl::StrCat(
      "bench --targets ", targets_, " --tokens 4 --hidden 32 --num-experts 4 --top-k 2"));
  EXPECT_EQ(bench.exit_code, 1) << bench.output;
  EXPECT_THAT(bench.output,
              HasSubstr("ranks 0, 1 of 2 are leased by owner 'coordinator@proc' for another "));
  EXPECT_EQ(Count(bench.output, "leased by owner"), 1) << bench.output;

  // A worker logs a failed call once, at warn, with its code and caller.
  {
    auto stub = v1::Worker::NewStub(
        grpc::CreateChannel(cluster_->targets()[0], grpc::InsecureChannelCredentials()));
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    context.set_wait_for_ready(true);    // a fresh channel: gRPC 1.51 may fail its first connect
    v1::ConfigureLayersRequest request;  // unclaimed: refused by the lease
    v1::ConfigureLayersResponse response;
    EXPECT_EQ(stub->ConfigureLayers(&context, request, &response).error_code(),
              grpc::StatusCode::FAILED_PRECONDITION);
  }
  const std::string worker_log = ReadFile(dir_ + "/worker-0.log");
  EXPECT_EQ(Count(worker_log, "/moe_ep.v1.Worker/ConfigureLayers from ipv4:127.0.0.1:"), 2)
      << worker_log;  // the coordinator's (info) and the refused one (warn)
  EXPECT_THAT(worker_log, ::testing::ContainsRegex(
                              "\\[warning\\] \\[rank=0 gen=1 epoch=0\\] /moe_ep.v1.Worker/"
                              "ConfigureLayers from ipv4:127.0.0.1:[0-9]+ failed after [0-9.]+ "
                              "ms: FAILED_PRECONDITION: ConfigureLayers: this worker is leased "
                              "by owner 'coordinator@proc'"));
  EXPECT_THAT(worker_log, ::testing::ContainsRegex(
                              "\\[info\\] .*/moe_ep.v1.Worker/Join from ipv4:127.0.0.1:[0-9]+: "
                              "OK in [0-9.]+ ms"));
  EXPECT_THAT(worker_log, HasSubstr("/moe_ep.v1.Worker/GetStatus from"));  // debug

  // A bad state: INVALID_ARGUMENT naming the field; nothing changes.
  const std::string bad = dir_ + "/bad.json";
  std::ofstream(bad) << R"({"targets": [")" << cluster_->targets()[0] << R"("], "layers": -1})";
  const CliResult refused =
      RunMoeEp(absl::StrCat("coordinator apply --target ", at, " --state ", bad));
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr("INVALID_ARGUMENT"));
  EXPECT_THAT(refused.output, HasSubstr("layers"));

  // drain: every rank leaves, the lease is given back.
  const CliResult drained = RunMoeEp(absl::StrCat("coordinator drain --target ", at));
  EXPECT_EQ(drained.exit_code, 0) << drained.output;
  EXPECT_THAT(drained.output, HasSubstr("drained: every rank left the group"));
  for (const std::string& t : cluster_->targets()) {
    const v1::GetStatusResponse s = WorkerStatus(t);
    EXPECT_EQ(s.state(), v1::WORKER_STATE_STARTED) << t;
    EXPECT_EQ(s.lease_owner(), "") << t;
  }
  EXPECT_THAT(RunMoeEp(absl::StrCat("coordinator status --target ", at)).output,
              HasSubstr("phase DRAINED"));

  // apply: formed again (generation 2), leased again.
  const std::string good = dir_ + "/good.json";
  std::ofstream(good) << R"({"targets": [")" << cluster_->targets()[0] << R"(", ")"
                      << cluster_->targets()[1]
                      << R"("], "model": "tiny-moe", "layers": 1, "capacity_tokens": 16})";
  const CliResult applied =
      RunMoeEp(absl::StrCat("coordinator apply --target ", at, " --state ", good));
  EXPECT_EQ(applied.exit_code, 0) << applied.output;
  EXPECT_THAT(applied.output, HasSubstr("the group is formed anew"));
  status =
      RunUntil(absl::StrCat("coordinator status --target ", at), "phase READY", absl::Seconds(60));
  EXPECT_THAT(status.output, HasSubstr("phase READY, generation 2")) << status.output;
  for (const std::string& t : cluster_->targets()) {
    EXPECT_EQ(WorkerStatus(t).lease_owner(), "coordinator@proc") << t;
  }

  // SIGTERM: exit 0 promptly, the lease given back.
  ASSERT_TRUE(coordinator.Signal(SIGTERM));
  const int exit_status = coordinator.Wait(absl::Seconds(10));
  ASSERT_TRUE(WIFEXITED(exit_status)) << exit_status;
  EXPECT_EQ(WEXITSTATUS(exit_status), 0);
  for (const std::string& t : cluster_->targets()) {
    EXPECT_EQ(WorkerStatus(t).lease_owner(), "") << t;
  }

  // The coordinator's log: one JSON object per line with time and level:
  // events at info, the refused Apply at warn, the formation steps at debug.
  const std::string text = ReadFile(log);
  int lines = 0, formed = 0, warned = 0, steps = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n', absl::SkipEmpty())) {
    const nlohmann::json j = nlohmann::json::parse(line);
    ++lines;
    ASSERT_TRUE(j.contains("ts")) << line;
    ASSERT_TRUE(j.contains("level")) << line;
    EXPECT_FALSE(j.contains("rank")) << line;
    const std::string msg = j["msg"];
    formed += j["level"] == "info" && absl::StrContains(msg, ": formed: ") ? 1 : 0;
    warned += j["level"] == "warning" &&
                      absl::StrContains(msg, "/moe_ep.v1.Coordinator/Apply from ipv4:127.0.0.1:") &&
                      absl::StrContains(msg, "INVALID_ARGUMENT")
                  ? 1
                  : 0;
    steps += j["level"] == "debug" && absl::StrContains(msg, ": Join generation ") ? 1 : 0;
  }
  EXPECT_GT(lines, 5);
  EXPECT_EQ(formed, 2) << text;
  EXPECT_EQ(warned, 1) << text;
  EXPECT_EQ(steps, 2) << text;
  EXPECT_THAT(text, HasSubstr("lease of 'coordinator@proc' given back"));
}

// `moe-ep up` leases its own workers: another client is refused, naming the
// owner, once; Ctrl-C gives the lease back and stops the workers.
TEST(UpCommandLease, UpLeasesItsWorkersAndBenchIsRefusedNamingIt) {
  const std::string dir = Dir();
  Background up({MoeEpBinary(), "up",     "--workers",      "2",      "--backend",      "gloo",
                 "--hidden",    "32",     "--num-experts",  "4",      "--top-k",        "2",
                 "--capacity",  "8",      "--load-experts", "swiglu", "--intermediate", "32",
                 "--owner",     "up@test"},
                dir + "/up.log");
  const std::string line = up.LineWith("targets: ", absl::Seconds(60));
  ASSERT_FALSE(line.empty()) << up.output() << ReadFile(dir + "/up.log");
  const std::string targets = line.substr(line.rfind(' ') + 1);
  EXPECT_THAT(up.output(), HasSubstr("up@test"));  // the table's lease column
  const CliResult bench = RunMoeEp(absl::StrCat(
      "bench --targets ", targets, " --tokens 4 --hidden 32 --num-experts 4 --top-k 2"));
  EXPECT_EQ(bench.exit_code, 1) << bench.output;
  EXPECT_THAT(bench.output, HasSubstr("leased by another client; nothing was changed"));
  EXPECT_THAT(bench.output, HasSubstr("ranks 0, 1 of 2 are leased by owner 'up@test'"));
  EXPECT_EQ(Count(bench.output, "leased by owner"), 1) << bench.output;
  const std::vector<std::string> list = absl::StrSplit(targets, ',');
  for (const std::string& t : list) EXPECT_GT(WorkerStatus(t).expert_bytes(), 0) << t;
  ASSERT_TRUE(up.Signal(SIGINT));
  const int status = up.Wait(absl::Seconds(20));
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << up.output();
}

// `up --targets` exits and leaves its group with experts and no lease: a
// later command refuses to re-form it (one message) unless --take-over.
TEST_F(CoordinatorProcessTest, AGroupLeftWithExpertsIsNotReformedWithoutTakeOver) {
  const CliResult formed =
      RunMoeEp(absl::StrCat("up --targets ", targets_,
                            " --backend gloo --hidden 32 --num-experts 4 "
                            "--top-k 2 --capacity 8 --load-experts swiglu --intermediate 32"));
  ASSERT_EQ(formed.exit_code, 0) << formed.output;
  const int64_t generation = WorkerStatus(cluster_->targets()[0]).generation();
  for (const std::string& t : cluster_->targets()) {
    EXPECT_GT(WorkerStatus(t).expert_bytes(), 0) << t;
    EXPECT_EQ(WorkerStatus(t).lease_owner(), "") << t;  // given back on exit
  }
  const std::string bench = absl::StrCat("bench --targets ", targets_,
                                         " --tokens 4 --hidden 32 --num-experts 4 --top-k 2");
  const CliResult refused = RunMoeEp(bench);
  EXPECT_EQ(refused.exit_code, 1) << refused.output;
  EXPECT_THAT(refused.output, HasSubstr(absl::StrCat("ranks 0, 1 of 2 (", cluster_->targets()[0],
                                                     ", ...) in "
                                                     "generation ",
                                                     generation, " hold ")));
  EXPECT_THAT(refused.output, HasSubstr("--take-over"));
  EXPECT_EQ(WorkerStatus(cluster_->targets()[0]).generation(), generation);  // nothing changed
  const CliResult taken = RunMoeEp(bench + " --take-over");
  EXPECT_EQ(taken.exit_code, 0) << taken.output;
  EXPECT_THAT(taken.output, HasSubstr("bench: 2 ranks"));
  EXPECT_GT(WorkerStatus(cluster_->targets()[0]).generation(), generation);
}

}  // namespace
}  // namespace moe_ep::testing
