// Integration test: `moe-ep bench --targets` (client::RunBenchCommand) against
// real workers that serve mutual TLS and require a bearer token, with the
// TLS/token options of client/worker_selection.h. Certificates are made with openssl at test time.

#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_join.h"
#include "client/bench_command.h"
#include "client/local_cluster.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_certs.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;

TEST(SecureTargets, BenchOverMutualTlsWithToken) {
  TestPki pki;
  if (!MakeTestPki("secure_targets_test", &pki)) GTEST_SKIP() << "openssl failed";
  const std::string token_file = pki.dir + "/token";
  WriteTextFile(token_file, "s3cret-token\n");

  client::LocalClusterOptions options;
  options.num_workers = 2;
  options.backend = "gloo";
  options.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  options.extra_args = {"--tls-cert=" + pki.server_cert, "--tls-key=" + pki.server_key,
                        "--tls-client-ca=" + pki.ca_cert, "--auth-token-file=" + token_file,
                        "--log-level=warn"};
  auto cluster = client::LocalCluster::Start(options);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  // The workers listen on 127.0.0.1; the server certificate names localhost.
  std::vector<std::string> targets;
  for (const std::string& t : (*cluster)->targets()) {
    targets.push_back("localhost" + t.substr(t.rfind(':')));
  }

  client::BenchCommandOptions bench;
  bench.workers.targets = absl::StrJoin(targets, ",");
  bench.workers.backend = "gloo";
  bench.tokens_per_rank = 4;
  bench.hidden = 32;
  bench.top_k = 2;
  bench.num_experts = 4;
  bench.iterations = 1;
  bench.warmup = 0;

  // (Refusals without the certificate or token: tests/client/coordinator_test.cc;
  // here they would only wait out WaitReady's 30 s.)
  bench.workers.security.tls_ca = pki.ca_cert;
  bench.workers.security.tls_cert = pki.client_cert;
  bench.workers.security.tls_key = pki.client_key;
  bench.workers.security.auth_token_file = token_file;
  std::ostringstream out;
  absl::Status ok = client::RunBenchCommand(bench, out);
  ASSERT_TRUE(ok.ok()) << ok << "\n" << out.str();
  EXPECT_THAT(out.str(), HasSubstr("dispatch p50"));
  std::filesystem::remove_all(pki.dir);
}

}  // namespace
}  // namespace moe_ep::testing
