#include "client/unsent_retry.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::client {
namespace {

// gRPC 1.51's texts for a fail-fast call with no connection to pick.
constexpr char kMisreportedConnect[] =
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:44475: No such file "
    "or directory";
constexpr char kRefused[] =
    "failed to connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:1: Connection "
    "refused";

std::chrono::system_clock::time_point In(absl::Duration d) {
  return std::chrono::system_clock::now() +
         std::chrono::duration_cast<std::chrono::system_clock::duration>(
             absl::ToChronoNanoseconds(d));
}

// A listening server whose Worker methods are all unimplemented: calls reach
// it and end UNIMPLEMENTED.
struct BareServer {
  BareServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
    builder.RegisterService(&service);
    server = builder.BuildAndStart();
  }
  std::string target() const { return absl::StrCat("127.0.0.1:", port); }
  int port = 0;
  v1::Worker::Service service;
  std::unique_ptr<grpc::Server> server;
};

// A loopback port held by a socket that is bound and never listens: a
// connect to it is refused, and no other test can take the port while this
// object lives.
class ClosedPort {
 public:
  ClosedPort() : fd_(socket(AF_INET, SOCK_STREAM, 0)) {
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0)
        << std::strerror(errno);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~ClosedPort() { close(fd_); }
  ClosedPort(const ClosedPort&) = delete;
  ClosedPort& operator=(const ClosedPort&) = delete;
  std::string target() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int fd_;
  int port_ = 0;
};

grpc::Status GetStatus(grpc::Channel& channel, grpc::ClientContext* context) {
  auto stub = v1::Worker::NewStub(std::shared_ptr<grpc::Channel>(&channel, [](grpc::Channel*) {}));
  v1::GetStatusResponse response;
  return stub->GetStatus(context, v1::GetStatusRequest(), &response);
}

TEST(FailedBeforeSending, TellsAnUnsentCallFromEveryOtherFailure) {
  const grpc::Status misreported(grpc::StatusCode::UNAVAILABLE, kMisreportedConnect);
  const grpc::Status refused(grpc::StatusCode::UNAVAILABLE, kRefused);
  EXPECT_TRUE(FailedBeforeSending(misreported));
  EXPECT_TRUE(FailedBeforeSendingTransiently(misreported));
  EXPECT_TRUE(FailedBeforeSending(refused));
  EXPECT_FALSE(FailedBeforeSendingTransiently(refused));
  // Sent, then the connection broke: the worker may have run it.
  const grpc::Status closed(grpc::StatusCode::UNAVAILABLE, "Socket closed");
  EXPECT_FALSE(FailedBeforeSending(closed));
  // The worker's own UNAVAILABLE, and the same text under another code.
  EXPECT_FALSE(FailedBeforeSending(grpc::Status(grpc::StatusCode::UNAVAILABLE, "draining")));
  EXPECT_FALSE(FailedBeforeSending(grpc::Status(grpc::StatusCode::INTERNAL, kMisreportedConnect)));
  // A worker's answer quoting gRPC about a connection of its own (a host
  // error naming rank 0's store): that call ran, and must not be resent.
  EXPECT_FALSE(FailedBeforeSending(grpc::Status(
      grpc::StatusCode::UNAVAILABLE,
      absl::StrCat("Forward: the arrival round on the store of rank 0 failed: gRPC 14: ",
                   kMisreportedConnect, " (the host rank is lost)"))));
  EXPECT_FALSE(FailedBeforeSending(grpc::Status::OK));
}

TEST(FailedBeforeSending, MatchesThisGrpcsTextForARefusedConnection) {
  const ClosedPort closed;
  auto channel = grpc::CreateChannel(closed.target(), grpc::InsecureChannelCredentials());
  grpc::ClientContext context;
  context.set_deadline(In(absl::Seconds(10)));
  const grpc::Status s = GetStatus(*channel, &context);
  EXPECT_TRUE(FailedBeforeSending(s)) << s.error_code() << ": " << s.error_message();
  EXPECT_FALSE(FailedBeforeSendingTransiently(s)) << s.error_message();
}

TEST(CallRetryingUnsent, SendsAnUnsentCallOnceMoreWhenTheChannelConnects) {
  BareServer server;
  auto channel = grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  int calls = 0;
  const grpc::Status s = CallRetryingUnsent(
      *channel, In(absl::Seconds(10)), absl::Seconds(5), [&](grpc::ClientContext* context) {
        if (++calls == 1) return grpc::Status(grpc::StatusCode::UNAVAILABLE, kMisreportedConnect);
        return GetStatus(*channel, context);
      });
  EXPECT_EQ(calls, 2);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNIMPLEMENTED) << s.error_message();  // it arrived
}

TEST(CallRetryingUnsent, NeverResendsASentOrRefusedCall) {
  BareServer server;
  auto channel = grpc::CreateChannel(server.target(), grpc::InsecureChannelCredentials());
  for (const grpc::Status& first :
       {grpc::Status(grpc::StatusCode::UNAVAILABLE, "Socket closed"),
        grpc::Status(grpc::StatusCode::UNAVAILABLE, kRefused),
        grpc::Status(grpc::StatusCode::DEADLINE_EXCEEDED, "Deadline Exceeded"), grpc::Status::OK}) {
    int calls = 0;
    const grpc::Status s = CallRetryingUnsent(*channel, In(absl::Seconds(10)), absl::Seconds(5),
                                              [&](grpc::ClientContext*) {
                                                ++calls;
                                                return first;
                                              });
    EXPECT_EQ(calls, 1) << first.error_message();
    EXPECT_EQ(s.error_code(), first.error_code());
    EXPECT_EQ(s.error_message(), first.error_message());
  }
}

TEST(CallRetryingUnsent, GivesUpAfterTheGraceWhenTheChannelNeverConnects) {
  const ClosedPort closed;
  auto channel = grpc::CreateChannel(closed.target(), grpc::InsecureChannelCredentials());
  int calls = 0;
  const absl::Time start = absl::Now();
  const grpc::Status s = CallRetryingUnsent(
      *channel, In(absl::Seconds(30)), absl::Milliseconds(300), [&](grpc::ClientContext*) {
        ++calls;
        return grpc::Status(grpc::StatusCode::UNAVAILABLE, kMisreportedConnect);
      });
  const absl::Duration took = absl::Now() - start;
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(s.error_message(), kMisreportedConnect);  // the first failure, as it was
  EXPECT_GE(took, absl::Milliseconds(250));
  EXPECT_LT(took, absl::Seconds(5));
}

TEST(ConnectGrace, IsOneJitteredBackoffPlusOneSecond) {
  EXPECT_EQ(ConnectGrace(absl::ZeroDuration()), absl::Milliseconds(2200));
  EXPECT_EQ(ConnectGrace(absl::Milliseconds(100)), absl::Milliseconds(1120));
}

}  // namespace
}  // namespace moe_ep::client
