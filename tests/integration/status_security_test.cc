// `moe-ep status` (client/status_command.h) against real workers that serve
// TLS and require a bearer token, reached the wrong way: the table says what
// the worker is and which flag fixes it, an error every worker repeats prints
// once with the ranks (issue 9 item 8). Certificates are made with openssl at
// test time; workers listen on loopback.

#include <sstream>

#include "client/local_cluster.h"
#include "client/status_command.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/test_certs.h"

namespace moe_ep::testing {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

class StatusSecurity : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!MakeTestPki("status_security_test", &pki_)) GTEST_SKIP() << "openssl failed";
    token_file_ = pki_.dir + "/token";
    WriteTextFile(token_file_, "s3cret-token\n");
    client::LocalClusterOptions options;
    options.num_workers = 2;
    options.backend = "gloo";
    options.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
    options.extra_args = {"--tls-cert=" + pki_.server_cert, "--tls-key=" + pki_.server_key,
                          "--auth-token-file=" + token_file_, "--log-level=warn"};
    auto cluster = client::LocalCluster::Start(options);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster);
    // The server certificate names localhost and 127.0.0.1.
    targets_ = cluster_->targets()[0] + "," + cluster_->targets()[1];
  }

  TestPki pki_;
  std::string token_file_;
  std::unique_ptr<client::LocalCluster> cluster_;
  std::string targets_;
};

TEST_F(StatusSecurity, WithoutTokenShowsUnauthenticatedOnceWithTheRanks) {
  client::StatusCommandOptions options;
  options.targets = targets_;
  options.security.tls_ca = pki_.ca_cert;
  std::ostringstream out;
  const absl::Status s = client::RunStatusCommand(options, out);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable);
  const std::string text = out.str();
  EXPECT_THAT(text, HasSubstr("UNAUTHENTICATED"));
  EXPECT_THAT(text, Not(HasSubstr("UNREACHABLE")));
  EXPECT_THAT(text, HasSubstr("error 1, ranks 0, 1 (every worker): UNAUTHENTICATED"));
  EXPECT_THAT(text, HasSubstr("pass --auth-token-file"));

  options.security.auth_token_file = token_file_;
  std::ostringstream good;
  EXPECT_TRUE(client::RunStatusCommand(options, good).ok()) << good.str();
  EXPECT_THAT(good.str(), HasSubstr("STARTED"));
}

TEST_F(StatusSecurity, PlaintextAgainstTlsSaysPassTlsCa) {
  client::StatusCommandOptions options;
  options.targets = targets_;
  std::ostringstream out;
  EXPECT_EQ(client::RunStatusCommand(options, out).code(), absl::StatusCode::kUnavailable);
  // The note wraps at 100 columns; its parts:
  EXPECT_THAT(out.str(), HasSubstr("Socket closed (hint: the worker closed a plaintext connection"))
      << out.str();
  EXPECT_THAT(out.str(), HasSubstr("pass --tls-ca")) << out.str();
  EXPECT_THAT(out.str(), HasSubstr("(every worker)")) << out.str();
}

}  // namespace
}  // namespace moe_ep::testing
