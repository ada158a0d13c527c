// The moe-ep binary's `run --tp` wiring (client/main.cc, issue 9 item 4):
// every run flag reaches the layer-stack job or is refused with a message
// naming it; none is silently ignored. Runs the built moe-ep with local
// workers on loopback.

#include <unistd.h>

#include <string>

#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/integration/cli_runner.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class RunTpCli : public ::testing::Test {
 protected:
  void SetUp() override {
    if (access(MoeEpBinary().c_str(), X_OK) != 0) GTEST_SKIP() << MoeEpBinary() << " not built";
  }
};

TEST_F(RunTpCli, RefusesEachFlagTheStackCannotApply) {
  const struct {
    const char* flags;
    const char* message;
  } cases[] = {
      {"--experts identity", "--experts identity: not with --tp"},
      {"--routing trace:/nonexistent/trace.jsonl",
       "--routing trace:/nonexistent/trace.jsonl: not with --tp"},
      {"--rel-tol 0.5", "--rel-tol 0.5: not with --tp"},
      {"--abs-tol 0.25", "--abs-tol 0.25: not with --tp"},
      {"--even-tokens", "--even-tokens: not with --tp"},
      {"--workers 3", "--workers: expected 2 (with --tp the group is --tp workers), got 3"},
      {"--backend nccl", "--backend nccl: not with --tp"},
  };
  for (const auto& c : cases) {
    const CliResult r = RunMoeEp(std::string("run --tp 2 --layers 2 ") + c.flags);
    // A refused combination is a bad command line: 2 (issue 31 item 7).
    EXPECT_EQ(r.exit_code, 2) << c.flags << "\n" << r.output;
    EXPECT_THAT(r.output, HasSubstr(c.message)) << c.flags;
    // Refused before any worker started.
    EXPECT_THAT(r.output, Not(HasSubstr("workers: starting"))) << c.flags;
  }
}

TEST_F(RunTpCli, CapacityAndAcceptedFlagsApply) {
  const CliResult r = RunMoeEp(
      "run --model tiny-moe --tp 2 --layers 2 --tokens 6 --steps 1 --capacity 50 --workers 2 "
      "--backend gloo "
      "--experts swiglu --seed 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("capacity 50;"));
  EXPECT_THAT(r.output, HasSubstr("PASS: every DP group matches"));
}

TEST_F(RunTpCli, BackendNcclWithoutGpusIsRefusedWithoutTp) {
  if (client::CountLocalGpus() > 0) GTEST_SKIP() << "this machine has GPUs";
  const CliResult r = RunMoeEp("run --backend nccl --layers 1 --tokens 4 --steps 1");
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_THAT(r.output, HasSubstr("--backend nccl: no NVIDIA GPU found"));
}

}  // namespace
}  // namespace moe_ep::testing
