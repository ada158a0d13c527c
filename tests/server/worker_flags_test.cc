#include "server/worker_flags.h"

#include <initializer_list>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "core/command_line.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

struct Parsed {
  std::optional<int> exit_code;
  WorkerFlags flags;
  std::string out;
  std::string err;
};

Parsed Parse(std::initializer_list<const char*> args) {
  std::vector<const char*> argv = {"moe-ep-worker"};
  argv.insert(argv.end(), args.begin(), args.end());
  Parsed p;
  std::ostringstream out, err;
  p.exit_code = ParseWorkerFlags(static_cast<int>(argv.size()), argv.data(), &p.flags, out, err);
  p.out = out.str();
  p.err = err.str();
  return p;
}

TEST(ParseWorkerFlags, DefaultsWithoutArguments) {
  const Parsed p = Parse({});
  EXPECT_EQ(p.exit_code, std::nullopt);
  EXPECT_EQ(p.flags.listen, "127.0.0.1:0");
  EXPECT_EQ(p.flags.backend, "auto");
  EXPECT_EQ(p.flags.gpu_data_plane, "auto");
  EXPECT_EQ(p.flags.onesided_sm_budget, 16);
  EXPECT_FALSE(p.flags.onesided_receive_buffers);
  EXPECT_EQ(p.flags.log_level, "info");
  EXPECT_EQ(p.flags.drain_timeout_ms, 5000);
  EXPECT_EQ(p.flags.max_message_bytes, 256 << 20);
  EXPECT_FALSE(p.flags.allow_insecure);
  EXPECT_FALSE(p.flags.enable_echo);
  EXPECT_EQ(p.err, "");
}

TEST(ParseWorkerFlags, KebabCaseInBothForms) {
  const Parsed p = Parse({"--listen", "127.0.0.1:7000", "--log-level=warn", "--memory-cap-bytes",
                          "1024", "--allow-insecure", "--health-listen=127.0.0.1:0",
                          "--tls-refresh-s=3", "--device=1", "--gpu-data-plane", "one-sided",
                          "--onesided-sm-budget", "64", "--onesided-receive-buffers"});
  ASSERT_EQ(p.exit_code, std::nullopt) << p.err;
  EXPECT_EQ(p.flags.listen, "127.0.0.1:7000");
  EXPECT_EQ(p.flags.log_level, "warn");
  EXPECT_EQ(p.flags.memory_cap_bytes, 1024);
  EXPECT_TRUE(p.flags.allow_insecure);
  EXPECT_EQ(p.flags.health_listen, "127.0.0.1:0");
  EXPECT_EQ(p.flags.tls_refresh_s, 3);
  EXPECT_EQ(p.flags.device, 1);
  EXPECT_EQ(p.flags.gpu_data_plane, "one-sided");
  EXPECT_EQ(p.flags.onesided_sm_budget, 64);
  EXPECT_TRUE(p.flags.onesided_receive_buffers);
  EXPECT_EQ(p.err, "");
}

TEST(ParseWorkerFlags, UnknownGpuDataPlaneIsABadCommandLine) {
  const Parsed p = Parse({"--gpu-data-plane=nvshmem"});
  EXPECT_EQ(p.exit_code, 2);
  EXPECT_THAT(p.err, HasSubstr("--gpu-data-plane"));
}

TEST(ParseWorkerFlags, EnableEchoTurnsOnTheTestOnlyEcho) {
  const Parsed p = Parse({"--enable-echo"});
  ASSERT_EQ(p.exit_code, std::nullopt) << p.err;
  EXPECT_TRUE(p.flags.enable_echo);
  EXPECT_EQ(p.err, "");
}

TEST(ParseWorkerFlags, BoolFlagTakesExplicitValue) {
  EXPECT_TRUE(Parse({"--allow-insecure=true"}).flags.allow_insecure);
  const Parsed off = Parse({"--allow-insecure=false"});
  EXPECT_EQ(off.exit_code, std::nullopt) << off.err;
  EXPECT_FALSE(off.flags.allow_insecure);
}

TEST(ParseWorkerFlags, UnderscoreSpellingsAreDeprecatedAliases) {
  const Parsed p = Parse({"--log_level", "debug", "--drain_timeout_ms=7", "--allow_insecure",
                          "--tls_client_ca=/ca.pem"});
  ASSERT_EQ(p.exit_code, std::nullopt) << p.err;
  EXPECT_EQ(p.flags.log_level, "debug");
  EXPECT_EQ(p.flags.drain_timeout_ms, 7);
  EXPECT_TRUE(p.flags.allow_insecure);
  EXPECT_EQ(p.flags.tls_client_ca, "/ca.pem");
  EXPECT_THAT(p.err, HasSubstr("moe-ep-worker: --log_level is deprecated, use --log-level"));
  EXPECT_THAT(p.err, HasSubstr("--drain_timeout_ms is deprecated, use --drain-timeout-ms"));
  EXPECT_THAT(p.err, HasSubstr("--tls_client_ca is deprecated, use --tls-client-ca"));
}

TEST(ParseWorkerFlags, HelpListsKebabCaseOnlyAndExitsZero) {
  const Parsed p = Parse({"--help"});
  EXPECT_EQ(p.exit_code, 0);
  EXPECT_THAT(p.out, HasSubstr("--log-level"));
  EXPECT_THAT(p.out, HasSubstr("--health-listen"));
  EXPECT_THAT(p.out, HasSubstr("--listen TEXT=127.0.0.1:0"));  // defaults are shown
  EXPECT_THAT(p.out, Not(HasSubstr("  --log_level")));         // aliases are not listed
  EXPECT_THAT(p.out, Not(HasSubstr("--tls_cert")));
  EXPECT_EQ(Parse({"-h"}).exit_code, 0);
}

TEST(ParseWorkerFlags, VersionPrintsTheProjectVersion) {
  const Parsed p = Parse({"--version"});
  EXPECT_EQ(p.exit_code, 0);
  EXPECT_EQ(p.out, "moe-ep-worker " + std::string(core::Version()) + "\n");
}

TEST(ParseWorkerFlags, UnknownFlagExitsTwo) {
  const Parsed p = Parse({"--log-levl=info"});
  EXPECT_EQ(p.exit_code, core::kExitBadCommandLine);
  EXPECT_THAT(p.err, HasSubstr("--log-levl"));
  EXPECT_THAT(p.err, HasSubstr("Run with --help for more information."));
}

TEST(ParseWorkerFlags, RangeErrorsAreReadable) {
  const Parsed p = Parse({"--drain-timeout-ms=-5"});
  EXPECT_EQ(p.exit_code, 2);
  EXPECT_THAT(p.err, HasSubstr("--drain-timeout-ms: expected a number >= 0, got -5"));
  const Parsed q = Parse({"--max-message-bytes=0"});
  EXPECT_EQ(q.exit_code, 2);
  EXPECT_THAT(q.err, HasSubstr("--max-message-bytes: expected a number > 0, got 0"));
  EXPECT_EQ(Parse({"--device=-1"}).exit_code, 2);
  const Parsed budget = Parse({"--onesided-sm-budget=0"});
  EXPECT_EQ(budget.exit_code, 2);
  EXPECT_THAT(budget.err, HasSubstr("--onesided-sm-budget: expected a number > 0, got 0"));
}

TEST(ParseWorkerFlags, BadValuesExitTwo) {
  const Parsed level = Parse({"--log-level=loud"});
  EXPECT_EQ(level.exit_code, 2);
  EXPECT_THAT(level.err, HasSubstr("loud"));
  EXPECT_EQ(Parse({"--backend=mpi"}).exit_code, 2);
  EXPECT_EQ(Parse({"--log-format=xml"}).exit_code, 2);
  EXPECT_EQ(Parse({"--device=two"}).exit_code, 2);
  EXPECT_EQ(Parse({"--listen"}).exit_code, 2);  // a value is missing
  // Both spellings of one flag at once is ambiguous.
  EXPECT_EQ(Parse({"--log-level=warn", "--log_level=info"}).exit_code, 2);
}

}  // namespace
}  // namespace moe_ep::server
