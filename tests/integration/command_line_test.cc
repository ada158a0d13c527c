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

TEST(CommandLine, AMistypedSubcommandGetsTheNearestName) {
  const ProcessResult typo = RunBinary(kCli, "stauts --targets 127.0.0.1:1");
  EXPECT_EQ(typo.status, 2) << typo.output;
  EXPECT_THAT(typo.output, HasSubstr("unknown subcommand 'stauts'; did you mean status?"));
  const ProcessResult far = RunBinary(kCli, "frobnicate");
  EXPECT_EQ(far.status, 2) << far.output;
  EXPECT_THAT(far.output, HasSubstr("unknown subcommand 'frobnicate'"));
  EXPECT_THAT(far.output, Not(HasSubstr("did you mean")));
}

TEST(CommandLine, RefusedFlagCombinationsExitTwo) {
  // Checked by the command itself, before any worker starts (README: a
  // command line that does not parse exits 2).
  const ProcessResult tls = RunBinary(kCli, "bench --workers 1 --tls-ca /nonexistent/ca.pem");
  EXPECT_EQ(tls.status, 2) << tls.output;
  EXPECT_THAT(tls.output, HasSubstr("--tls-ca \"/nonexistent/ca.pem\": only with --targets"));
  const ProcessResult top_k = RunBinary(kCli, "bench --workers 1 --num-experts 4 --top-k 8");
  EXPECT_EQ(top_k.status, 2) << top_k.output;
  EXPECT_THAT(top_k.output, HasSubstr("--top-k: expected <= --num-experts (4), got 8"));
  const ProcessResult fp8 = RunBinary(kCli, "run --tp 2 --dispatch-dtype fp8_e4m3");
  EXPECT_EQ(fp8.status, 2) << fp8.output;
  EXPECT_THAT(fp8.output, HasSubstr("--dispatch-dtype: fp8_e4m3 applies to the MoE-layer run"));
  // --experts is the expert kind everywhere; the count is --num-experts.
  const ProcessResult count = RunBinary(kCli, "bench --experts 8");
  EXPECT_EQ(count.status, 2) << count.output;
}

TEST(CommandLine, OneRpcTimeoutDefault) {
  for (const char* sub : {"run", "stack"}) {
    const ProcessResult help = RunBinary(kCli, std::string(sub) + " --help");
    EXPECT_EQ(help.status, 0) << help.output;
    EXPECT_THAT(help.output, HasSubstr("--rpc-timeout FLOAT:POSITIVE=600")) << sub << "\n"
                                                                            << help.output;
  }
}

TEST(CommandLine, CoordinatorHelpShowsAnExampleDesiredState) {
  const ProcessResult help = RunBinary(kCli, "coordinator --help");
  EXPECT_EQ(help.status, 0) << help.output;
  EXPECT_THAT(help.output, HasSubstr("\"experts\": {\"kind\": \"swiglu\", \"seed\": 1}"));
  EXPECT_THAT(help.output, HasSubstr("\"targets\": [\"127.0.0.1:50051\", \"127.0.0.1:50052\"]"));
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
