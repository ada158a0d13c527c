#include "client/credentials.h"

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>

#include "client/coordinator.h"
#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "tests/test_certs.h"

namespace moe_ep::client {
namespace {

using ::moe_ep::testing::MakeTestPki;
using ::moe_ep::testing::ReadTextFile;
using ::moe_ep::testing::TestPki;
using ::moe_ep::testing::WriteTextFile;
using ::testing::HasSubstr;

// Answers GetStatus (rank 3) only to calls that carry "Bearer t0ken".
class TokenCheckingWorker final : public v1::Worker::Service {
  grpc::Status GetStatus(grpc::ServerContext* context, const v1::GetStatusRequest*,
                         v1::GetStatusResponse* response) override {
    const auto& metadata = context->client_metadata();
    const auto it = metadata.find("authorization");
    if (it == metadata.end() ||
        std::string(it->second.data(), it->second.size()) != "Bearer t0ken") {
      return grpc::Status(grpc::StatusCode::UNAUTHENTICATED, "no token");
    }
    response->set_rank(3);
    return grpc::Status::OK;
  }
};

class ClientCredentialsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!MakeTestPki("moe-ep-client-tls-test", &pki_)) GTEST_SKIP() << "openssl failed";
    token_file_ = pki_.dir + "/token";
    WriteTextFile(token_file_, "t0ken\n");
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
    if (!pki_.dir.empty()) std::filesystem::remove_all(pki_.dir);
  }
  // A server requiring a client certificate signed by the test CA.
  std::string StartMutualTlsServer() {
    grpc::SslServerCredentialsOptions ssl(
        GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
    ssl.pem_root_certs = ReadTextFile(pki_.ca_cert);
    ssl.pem_key_cert_pairs.push_back(
        {ReadTextFile(pki_.server_key), ReadTextFile(pki_.server_cert)});
    grpc::ServerBuilder builder;
    int port = 0;
    builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(ssl), &port);
    builder.RegisterService(&worker_);
    server_ = builder.BuildAndStart();
    return "localhost:" + std::to_string(port);
  }
  absl::StatusOr<v1::GetStatusResponse> StatusWith(const std::string& target,
                                                   const ClientSecurityOptions& security) {
    CoordinatorOptions options;
    auto credentials = MakeClientChannelCredentials(security);
    if (!credentials.ok()) return credentials.status();
    options.channel_credentials = *credentials;
    options.rpc_timeout = absl::Seconds(5);
    auto coordinator = Coordinator::Connect({target}, options);
    if (!coordinator.ok()) return coordinator.status();
    auto each = (*coordinator)->StatusEach();
    return each[0];
  }

  TestPki pki_;
  std::string token_file_;
  TokenCheckingWorker worker_;
  std::unique_ptr<grpc::Server> server_;
};

TEST_F(ClientCredentialsTest, CoordinatorReachesMutualTlsWorkerWithToken) {
  const std::string target = StartMutualTlsServer();
  ClientSecurityOptions full{pki_.ca_cert, pki_.client_cert, pki_.client_key, token_file_};
  auto status = StatusWith(target, full);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->rank(), 3);

  ClientSecurityOptions no_token = full;
  no_token.auth_token_file.clear();
  EXPECT_EQ(StatusWith(target, no_token).status().code(), absl::StatusCode::kUnauthenticated);
  ClientSecurityOptions no_cert{pki_.ca_cert, "", "", token_file_};
  EXPECT_EQ(StatusWith(target, no_cert).status().code(), absl::StatusCode::kUnavailable);
  ClientSecurityOptions wrong_ca{pki_.other_ca_cert, pki_.client_cert, pki_.client_key,
                                 token_file_};
  EXPECT_EQ(StatusWith(target, wrong_ca).status().code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(StatusWith(target, ClientSecurityOptions()).status().code(),
            absl::StatusCode::kUnavailable);
}

TEST_F(ClientCredentialsTest, RejectsInconsistentOptions) {
  ClientSecurityOptions half{pki_.ca_cert, pki_.client_cert, "", ""};
  auto status = MakeClientChannelCredentials(half).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--tls-cert and --tls-key go together"));

  ClientSecurityOptions token_in_clear{"", "", "", token_file_};
  status = MakeClientChannelCredentials(token_in_clear).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--auth-token-file needs TLS"));

  ClientSecurityOptions missing_ca{pki_.dir + "/missing.crt", "", "", ""};
  status = MakeClientChannelCredentials(missing_ca).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--tls-ca: cannot read"));

  ClientSecurityOptions not_pem{token_file_, "", "", ""};
  status = MakeClientChannelCredentials(not_pem).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("holds no PEM block"));

  WriteTextFile(pki_.dir + "/empty-token", "\n");
  ClientSecurityOptions empty_token{pki_.ca_cert, "", "", pki_.dir + "/empty-token"};
  status = MakeClientChannelCredentials(empty_token).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("holds no token"));

  EXPECT_TRUE(MakeClientChannelCredentials(ClientSecurityOptions()).ok());  // plaintext
}

}  // namespace
}  // namespace moe_ep::client
