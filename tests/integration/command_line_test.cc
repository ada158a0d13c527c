// The command lines of both binaries as a user sees them (issue 9 item 5):
// --version, --help exit 0; a bad command line exits 2 with a readable
// message; kebab-case on both.

#include "core/command_line.h"

#include <sys/wait.h>

#include <array>
#include <cstdio>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct ProcessResult {
  int status = -1;
  std::string output;  // stdout and stderr
};

// Runs `binary args` through the shell, stdin closed; returns the exit status.
ProcessResult RunBinary(const std::string& binary, const std::string& args) {
  ProcessResult run;
  const std::string command = "'" + binary + "' " + args + " </dev/null 2>&1";
  FILE* pipe = popen(command.c_str(), "r");
  if (pipe == nullptr) return run;
  std::array<char, 4096> buffer;
  size_t n;
  while ((n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0)
    run.output.append(buffer.data(), n);
  const int wait_status = pclose(pipe);
  run.status = WIFEXITED(wait_status) ? WEXITSTATUS(wait_status) : -1;
  return run;
}

const std::string kWorker = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
const std::string kCli = std::string(MOE_EP_BINARY_DIR) + "/client/moe-ep";

TEST(CommandLine, BothPrintTheProjectVersion) {
  const std::string version(moe_ep::core::Version());
  const ProcessResult worker = RunBinary(kWorker, "--version");
  EXPECT_EQ(worker.status, 0);
  EXPECT_EQ(worker.output, "moe-ep-worker " + version + "\n");
  const ProcessResult cli = RunBinary(kCli, "--version");
  EXPECT_EQ(cli.status, 0);
  EXPECT_EQ(cli.output, "moe-ep " + version + "\n");
}

TEST(CommandLine, HelpExitsZero) {
  const ProcessResult worker = RunBinary(kWorker, "--help");
  EXPECT_EQ(worker.status, 0) << worker.output;
  EXPECT_THAT(worker.output, HasSubstr("--drain-timeout-ms"));
  EXPECT_THAT(worker.output, Not(HasSubstr("--drain_timeout_ms")));
  EXPECT_EQ(RunBinary(kCli, "--help").status, 0);
  EXPECT_EQ(RunBinary(kCli, "run --help").status, 0);
}

TEST(CommandLine, BadCommandLinesExitTwo) {
  const ProcessResult worker = RunBinary(kWorker, "--no-such-flag");
  EXPECT_EQ(worker.status, 2) << worker.output;
  EXPECT_THAT(worker.output, HasSubstr("--no-such-flag"));

  const ProcessResult unknown = RunBinary(kCli, "run --no-such-flag");
  EXPECT_EQ(unknown.status, 2) << unknown.output;
  EXPECT_THAT(unknown.output, HasSubstr("--no-such-flag"));
  EXPECT_EQ(RunBinary(kCli, "").status, 2);                   // no subcommand
  EXPECT_EQ(RunBinary(kCli, "frobnicate").status, 2);         // unknown subcommand
  EXPECT_EQ(RunBinary(kCli, "plan").status, 2);               // --tp is required
  EXPECT_EQ(RunBinary(kCli, "run --tokens many").status, 2);  // not a number
}

TEST(CommandLine, RangeErrorsPrintAReadableRange) {
  const ProcessResult tokens = RunBinary(kCli, "run --tokens -3");
  EXPECT_EQ(tokens.status, 2) << tokens.output;
  EXPECT_THAT(tokens.output, HasSubstr("--tokens: expected a number > 0, got -3"));
  EXPECT_LT(tokens.output.size(), 200u) << tokens.output;  // no 309-digit bound

  const ProcessResult tol = RunBinary(kCli, "run --rel-tol -1");
  EXPECT_EQ(tol.status, 2) << tol.output;
  EXPECT_THAT(tol.output, HasSubstr("--rel-tol: expected a number >= 0, got -1"));

  const ProcessResult drain = RunBinary(kWorker, "--drain-timeout-ms=-1");
  EXPECT_EQ(drain.status, 2) << drain.output;
  EXPECT_THAT(drain.output, HasSubstr("--drain-timeout-ms: expected a number >= 0, got -1"));
}

}  // namespace
