// Integration test: `moe-ep up` (the real binary) reports a worker that dies,
// with its exit status or signal, at once, stops the others and fails
// (issue 8: before, it reported nothing and left the worker defunct).

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

// A child process with stdout and stderr on one pipe.
struct Child {
  pid_t pid = -1;
  int out_fd = -1;
};

Child Spawn(const std::vector<std::string>& args) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return {};
  const pid_t pid = fork();
  if (pid == 0) {
    dup2(fds[1], STDOUT_FILENO);
    dup2(fds[1], STDERR_FILENO);
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  close(fds[1]);
  return {pid, fds[0]};
}

// Reads from `fd` into `text` until `want` appears, EOF, or `timeout`.
bool ReadUntil(int fd, const std::string& want, absl::Duration timeout, std::string* text) {
  const absl::Time deadline = absl::Now() + timeout;
  while (text->find(want) == std::string::npos) {
    const int64_t left = absl::ToInt64Milliseconds(deadline - absl::Now());
    if (left <= 0) return false;
    pollfd p{fd, POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(left)) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fd, buf, sizeof(buf));
    if (n <= 0) return text->find(want) != std::string::npos;
    text->append(buf, static_cast<size_t>(n));
  }
  return true;
}

std::vector<pid_t> ChildrenOf(pid_t pid) {
  std::vector<pid_t> children;
  std::ifstream in(absl::StrCat("/proc/", pid, "/task/", pid, "/children"));
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  for (absl::string_view word : absl::StrSplit(text, ' ', absl::SkipEmpty())) {
    pid_t child = 0;
    if (absl::SimpleAtoi(word, &child)) children.push_back(child);
  }
  return children;
}

TEST(UpCommand, ReportsAWorkerKilledWithSignal9AtOnceAndFails) {
  Child up = Spawn({std::string(MOE_EP_BINARY_DIR) + "/client/moe-ep", "up", "--workers", "2",
                    "--backend", "gloo"});
  ASSERT_GT(up.pid, 0);
  std::string text;
  ASSERT_TRUE(ReadUntil(up.out_fd, "Press Ctrl-C", absl::Seconds(60), &text)) << text;
  std::vector<pid_t> workers = ChildrenOf(up.pid);
  ASSERT_EQ(workers.size(), 2u) << text;
  const pid_t victim = workers[1];
  const absl::Time killed_at = absl::Now();
  ASSERT_EQ(kill(victim, SIGKILL), 0);
  int status = 0;
  pid_t done = 0;
  while ((done = waitpid(up.pid, &status, WNOHANG)) == 0 &&
         absl::Now() - killed_at < absl::Seconds(15)) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  const absl::Duration took = absl::Now() - killed_at;
  if (done == 0) {
    kill(up.pid, SIGKILL);
    waitpid(up.pid, &status, 0);
    FAIL() << "moe-ep up did not exit after a worker was killed\n" << text;
  }
  ReadUntil(up.out_fd, "\x01never", absl::Seconds(1), &text);  // the rest, until EOF
  close(up.out_fd);
  ASSERT_TRUE(WIFEXITED(status)) << text;
  EXPECT_EQ(WEXITSTATUS(status), 1) << text;
  EXPECT_LT(took, absl::Seconds(5)) << text;
  EXPECT_THAT(text, HasSubstr(absl::StrCat("(pid ", victim, ", 127.0.0.1:")));
  EXPECT_THAT(text, HasSubstr("was killed by signal 9"));
  EXPECT_THAT(text, HasSubstr("the group lost a member"));
  // The other worker was stopped, and the victim was reaped (not defunct).
  for (pid_t worker : workers) EXPECT_EQ(kill(worker, 0), -1) << worker;
}

}  // namespace
}  // namespace moe_ep::testing
