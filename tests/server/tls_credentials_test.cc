#include "proto/rpc/tls_credentials.h"

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/rpc/auth.h"
#include "proto/rpc/health.h"
#include "server/grpc_store.h"
#include "server/rendezvous_service.h"
#include "server/worker_service.h"
#include "tests/server/health_probe.h"
#include "tests/test_certs.h"

namespace moe_ep::server {
namespace {

using ::moe_ep::testing::MakeTestPki;
using ::moe_ep::testing::ReadTextFile;
using ::moe_ep::testing::TestPki;
using ::moe_ep::testing::WriteTextFile;
using ::testing::HasSubstr;

TEST(IsLoopbackHost, AcceptsOnlyLoopbackNames) {
  EXPECT_TRUE(rpc::IsLoopbackHost("127.0.0.1"));
  EXPECT_TRUE(rpc::IsLoopbackHost("127.1.2.3"));
  EXPECT_TRUE(rpc::IsLoopbackHost("localhost"));
  EXPECT_TRUE(rpc::IsLoopbackHost("::1"));
  EXPECT_TRUE(rpc::IsLoopbackHost("[::1]"));
  EXPECT_FALSE(rpc::IsLoopbackHost("0.0.0.0"));
  EXPECT_FALSE(rpc::IsLoopbackHost("10.0.0.7"));
  EXPECT_FALSE(rpc::IsLoopbackHost("[::]"));
  EXPECT_FALSE(rpc::IsLoopbackHost("127.0.0.256"));
  EXPECT_FALSE(rpc::IsLoopbackHost("127.0.0"));
  EXPECT_FALSE(rpc::IsLoopbackHost("worker-0.moe-ep.default.svc"));
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!MakeTestPki("moe-ep-tls-test", &pki_)) GTEST_SKIP() << "openssl could not make a PKI";
  }
  void TearDown() override {
    if (!pki_.dir.empty()) std::filesystem::remove_all(pki_.dir);
  }
  rpc::ServerSecurityOptions Tls() const {
    rpc::ServerSecurityOptions options;
    options.listen = "127.0.0.1:0";
    options.tls_cert = pki_.server_cert;
    options.tls_key = pki_.server_key;
    options.tls_client_ca = pki_.ca_cert;
    options.refresh_interval = absl::Seconds(1);
    return options;
  }
  TestPki pki_;
};

TEST(MakeServerCredentials, PlaintextOnLoopbackIsAllowedByDefault) {
  rpc::ServerSecurityOptions options;
  for (const char* listen : {"127.0.0.1:0", "localhost:50051", "[::1]:0"}) {
    options.listen = listen;
    EXPECT_TRUE(rpc::MakeServerCredentials(options).ok()) << listen;
  }
}

TEST(MakeServerCredentials, PlaintextOnOtherAddressesNeedsAllowInsecure) {
  rpc::ServerSecurityOptions options;
  options.listen = "0.0.0.0:50051";
  auto refused = rpc::MakeServerCredentials(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("--allow-insecure"));
  EXPECT_THAT(refused.status().message(), HasSubstr("0.0.0.0"));
  options.allow_insecure = true;
  EXPECT_TRUE(rpc::MakeServerCredentials(options).ok());
}

TEST(MakeServerCredentials, TokenWithoutTlsIsFailedPrecondition) {
  rpc::ServerSecurityOptions options;
  options.listen = "127.0.0.1:0";
  options.auth_token = true;
  auto refused = rpc::MakeServerCredentials(options);
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(refused.status().message(), HasSubstr("--auth-token-file needs TLS"));
}

TEST_F(TlsTest, RejectsInconsistentOrUnreadableFiles) {
  rpc::ServerSecurityOptions options = Tls();
  options.tls_key.clear();
  auto status = rpc::MakeServerCredentials(options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--tls-cert and --tls-key go together"));

  options = rpc::ServerSecurityOptions();
  options.listen = "127.0.0.1:0";
  options.tls_client_ca = pki_.ca_cert;
  status = rpc::MakeServerCredentials(options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--tls-client-ca (mutual TLS) needs TLS"));

  options = Tls();
  options.tls_client_ca = pki_.dir + "/missing.crt";
  status = rpc::MakeServerCredentials(options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--tls-client-ca: cannot read"));

  options = Tls();
  WriteTextFile(pki_.dir + "/not-pem.crt", "hello\n");
  options.tls_cert = pki_.dir + "/not-pem.crt";
  status = rpc::MakeServerCredentials(options).status();
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("holds no PEM block"));

  options = Tls();
  options.refresh_interval = absl::Milliseconds(100);
  EXPECT_EQ(rpc::MakeServerCredentials(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

// A worker serving TLS (+ mTLS, + optional token) in process.
class SecureWorker {
 public:
  SecureWorker(const rpc::ServerSecurityOptions& security, const std::string& token_file)
      : worker_(WorkerOptions(), &health_) {
    auto credentials = rpc::MakeServerCredentials(security);
    EXPECT_TRUE(credentials.ok()) << credentials.status();
    if (!token_file.empty()) {
      auto auth = rpc::BearerTokenAuth::Create(token_file);
      EXPECT_TRUE(auth.ok()) << auth.status();
      (*credentials)->SetAuthMetadataProcessor(*auth);
    }
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", *credentials, &port_);
    builder.RegisterService(&worker_);
    builder.RegisterService(&rendezvous_);
    server_ = builder.BuildAndStart();
  }
  ~SecureWorker() {
    worker_.BeginShutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  std::string address() const { return "localhost:" + std::to_string(port_); }

 private:
  rpc::HealthReporter health_;
  WorkerService worker_;
  RendezvousService rendezvous_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// Independent of the code under test: gRPC's SSL credentials from PEM text.
std::shared_ptr<grpc::ChannelCredentials> ClientCredentials(const std::string& ca,
                                                            const std::string& cert,
                                                            const std::string& key,
                                                            const std::string& token) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadTextFile(ca);
  if (!cert.empty()) {
    ssl.pem_cert_chain = ReadTextFile(cert);
    ssl.pem_private_key = ReadTextFile(key);
  }
  auto channel = grpc::SslCredentials(ssl);
  if (token.empty()) return channel;
  return grpc::CompositeChannelCredentials(channel, grpc::AccessTokenCredentials(token));
}

grpc::Status CallStatus(const std::string& address,
                        const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                        v1::GetStatusResponse* response) {
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(address, credentials));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return stub->GetStatus(&context, v1::GetStatusRequest(), response);
}

grpc::Status CallJoin(const std::string& address,
                      const std::shared_ptr<grpc::ChannelCredentials>& credentials, int world,
                      int rank, const std::string& rendezvous) {
  auto stub = v1::Worker::NewStub(grpc::CreateChannel(address, credentials));
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(20));
  v1::JoinRequest request;
  request.set_world_size(world);
  request.set_rank(rank);
  request.set_backend("gloo");
  request.set_generation(1);
  request.set_rendezvous_address(rendezvous);
  request.set_timeout_ms(10000);
  v1::JoinResponse response;
  return stub->Join(&context, request, &response);
}

TEST_F(TlsTest, MutualTlsAndTokenAdmitOnlyFullyCredentialedClients) {
  const std::string token_file = pki_.dir + "/token";
  WriteTextFile(token_file, "s3cret-token\n");
  SecureWorker worker(Tls(), token_file);
  const auto good =
      ClientCredentials(pki_.ca_cert, pki_.client_cert, pki_.client_key, "s3cret-token");
  v1::GetStatusResponse before;
  ASSERT_TRUE(CallStatus(worker.address(), good, &before).ok());
  EXPECT_EQ(before.state(), v1::WORKER_STATE_STARTED);

  struct Refused {
    const char* what;
    std::shared_ptr<grpc::ChannelCredentials> credentials;
    grpc::StatusCode code;
  };
  const std::vector<Refused> refused = {
      {"plaintext", grpc::InsecureChannelCredentials(), grpc::StatusCode::UNAVAILABLE},
      {"no client certificate", ClientCredentials(pki_.ca_cert, "", "", "s3cret-token"),
       grpc::StatusCode::UNAVAILABLE},
      {"client certificate of another CA",
       ClientCredentials(pki_.ca_cert, pki_.other_client_cert, pki_.other_client_key,
                         "s3cret-token"),
       grpc::StatusCode::UNAVAILABLE},
      {"no token", ClientCredentials(pki_.ca_cert, pki_.client_cert, pki_.client_key, ""),
       grpc::StatusCode::UNAUTHENTICATED},
      {"wrong token",
       ClientCredentials(pki_.ca_cert, pki_.client_cert, pki_.client_key, "s3cret-tokem"),
       grpc::StatusCode::UNAUTHENTICATED},
      {"server checked against another CA",
       ClientCredentials(pki_.other_ca_cert, pki_.client_cert, pki_.client_key, "s3cret-token"),
       grpc::StatusCode::UNAVAILABLE},
  };
  for (const Refused& r : refused) {
    SCOPED_TRACE(r.what);
    // A state-changing call: it must not reach the service.
    const grpc::Status join = CallJoin(worker.address(), r.credentials, 1, 0, "");
    EXPECT_EQ(join.error_code(), r.code) << join.error_message();
    v1::GetStatusResponse ignored;
    EXPECT_EQ(CallStatus(worker.address(), r.credentials, &ignored).error_code(), r.code);
  }
  // No trace: the snapshot (state, generation, counters incl. errors) is as before.
  v1::GetStatusResponse after;
  ASSERT_TRUE(CallStatus(worker.address(), good, &after).ok());
  EXPECT_EQ(after.SerializeAsString(), before.SerializeAsString());
  EXPECT_EQ(after.counters().errors(), 0);

  // The same Join with full credentials goes through.
  ASSERT_TRUE(CallJoin(worker.address(), good, 1, 0, "").ok());
  ASSERT_TRUE(CallStatus(worker.address(), good, &after).ok());
  EXPECT_EQ(after.state(), v1::WORKER_STATE_JOINED);
}

TEST_F(TlsTest, TlsWithoutClientCaAcceptsClientsWithoutCertificate) {
  rpc::ServerSecurityOptions options = Tls();
  options.tls_client_ca.clear();
  SecureWorker worker(options, "");
  v1::GetStatusResponse status;
  EXPECT_TRUE(
      CallStatus(worker.address(), ClientCredentials(pki_.ca_cert, "", "", ""), &status).ok());
  EXPECT_EQ(CallStatus(worker.address(), grpc::InsecureChannelCredentials(), &status).error_code(),
            grpc::StatusCode::UNAVAILABLE);
}

TEST_F(TlsTest, RotatedServerCertificateIsPickedUpWithoutRestart) {
  // The worker serves copies of the files, which the test then replaces.
  const std::string cert = pki_.dir + "/serving.crt";
  const std::string key = pki_.dir + "/serving.key";
  std::filesystem::copy_file(pki_.server_cert, cert);
  std::filesystem::copy_file(pki_.server_key, key);
  rpc::ServerSecurityOptions options = Tls();
  options.tls_cert = cert;
  options.tls_key = key;
  options.tls_client_ca.clear();
  SecureWorker worker(options, "");
  const auto trusts_first = ClientCredentials(pki_.ca_cert, "", "", "");
  const auto trusts_other = ClientCredentials(pki_.other_ca_cert, "", "", "");
  v1::GetStatusResponse status;
  ASSERT_TRUE(CallStatus(worker.address(), trusts_first, &status).ok());
  ASSERT_FALSE(CallStatus(worker.address(), trusts_other, &status).ok());

  // Rotate atomically (rename), as a Kubernetes secret update does.
  std::filesystem::copy_file(pki_.other_server_cert, cert + ".new");
  std::filesystem::copy_file(pki_.other_server_key, key + ".new");
  std::filesystem::rename(key + ".new", key);
  std::filesystem::rename(cert + ".new", cert);
  const absl::Time deadline = absl::Now() + absl::Seconds(15);
  bool switched = false;
  while (!switched && absl::Now() < deadline) {
    switched = CallStatus(worker.address(), trusts_other, &status).ok();
    if (!switched) absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(switched) << "the worker still serves the old certificate after 15 s";
  EXPECT_FALSE(CallStatus(worker.address(), trusts_first, &status).ok());
}

TEST_F(TlsTest, TwoRanksFormAGroupOverMutualTlsWithToken) {
  const std::string token_file = pki_.dir + "/token";
  WriteTextFile(token_file, "group-token");
  const rpc::ServerSecurityOptions options = Tls();
  SecureWorker rank0(options, token_file);
  SecureWorker rank1(options, token_file);
  // The peers' rendezvous client (GrpcStore) presents the worker's own
  // certificate and the token, and checks rank 0 against the CA.
  auto peer = rpc::MakePeerChannelCredentials(options, "group-token");
  ASSERT_TRUE(peer.ok()) << peer.status();
  SetPeerChannelCredentials(*peer);
  const auto good =
      ClientCredentials(pki_.ca_cert, pki_.client_cert, pki_.client_key, "group-token");
  grpc::Status joined[2];
  std::thread t0([&] { joined[0] = CallJoin(rank0.address(), good, 2, 0, rank0.address()); });
  std::thread t1([&] { joined[1] = CallJoin(rank1.address(), good, 2, 1, rank0.address()); });
  t0.join();
  t1.join();
  SetPeerChannelCredentials(nullptr);
  EXPECT_TRUE(joined[0].ok()) << joined[0].error_message();
  EXPECT_TRUE(joined[1].ok()) << joined[1].error_message();
  v1::GetStatusResponse status;
  ASSERT_TRUE(CallStatus(rank1.address(), good, &status).ok());
  EXPECT_EQ(status.state(), v1::WORKER_STATE_JOINED);
  EXPECT_EQ(status.world_size(), 2);
  EXPECT_EQ(status.rank(), 1);
}

}  // namespace
}  // namespace moe_ep::server

namespace moe_ep::server {
namespace {

// --health-listen: a TLS control plane plus a plaintext port serving only
// grpc.health.v1, both fed by one rpc::HealthReporter (Kubernetes gRPC probes
// speak neither TLS nor tokens).
TEST_F(TlsTest, PlaintextProbePortMirrorsHealthOfTlsServer) {
  rpc::EnableDefaultHealthService();
  auto credentials = rpc::MakeServerCredentials(Tls());
  ASSERT_TRUE(credentials.ok());
  rpc::HealthReporter health;
  int tls_port = 0;
  int probe_port = 0;
  // Servers without sync services need a callback service to poll their
  // completion queue; unknown methods get UNIMPLEMENTED.
  grpc::CallbackGenericService unimplemented[2];  // one per server
  grpc::ServerBuilder tls_builder;
  tls_builder.AddListeningPort("127.0.0.1:0", *credentials, &tls_port);
  tls_builder.RegisterCallbackGenericService(&unimplemented[0]);
  std::unique_ptr<grpc::Server> tls_server = tls_builder.BuildAndStart();
  grpc::ServerBuilder probe_builder;
  probe_builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &probe_port);
  probe_builder.RegisterCallbackGenericService(&unimplemented[1]);
  std::unique_ptr<grpc::Server> probe_server = probe_builder.BuildAndStart();
  ASSERT_NE(probe_server, nullptr);
  health.Attach(tls_server->GetHealthCheckService());
  health.Attach(probe_server->GetHealthCheckService());
  const std::string probe = "127.0.0.1:" + std::to_string(probe_port);
  EXPECT_EQ(ProbeHealth(probe, rpc::kWorkerServiceName), kNotServing);
  health.SetReady(true);
  EXPECT_EQ(ProbeHealth(probe, rpc::kWorkerServiceName), kServing);
  EXPECT_EQ(ProbeHealth(probe, ""), kServing);
  // The TLS port itself refuses a plaintext probe.
  EXPECT_LT(ProbeHealth("127.0.0.1:" + std::to_string(tls_port), ""), 0);
  health.Shutdown();
  EXPECT_EQ(ProbeHealth(probe, ""), kNotServing);
  tls_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  probe_server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
}

}  // namespace
}  // namespace moe_ep::server
