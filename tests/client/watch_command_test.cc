#include "client/watch_command.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <memory>
#include <sstream>
#include <string>

#include "gmock/gmock.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "moe_ep/v1/worker.grpc.pb.h"

namespace moe_ep::client {
namespace {

using ::testing::HasSubstr;

// Reports rank 1 of 2, ALLOCATED, R = 42, and how often it was asked.
class StatusWorker final : public v1::Worker::Service {
 public:
  grpc::Status GetStatus(grpc::ServerContext*, const v1::GetStatusRequest*,
                         v1::GetStatusResponse* response) override {
    ++calls;
    response->set_rank(1);
    response->set_world_size(2);
    response->set_state(v1::WORKER_STATE_ALLOCATED);
    response->set_backend("gloo");
    response->set_runtime_max_tokens_per_rank(42);
    return grpc::Status::OK;
  }
  std::atomic<int> calls{0};
};

// A loopback port nobody listens on.
int ClosedPort() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << std::strerror(errno);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

class WatchCommandTest : public ::testing::Test {
 protected:
  void SetUp() override {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&worker_);
    server_ = builder.BuildAndStart();
  }
  void TearDown() override {
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(2));
  }
  std::string live() const { return "127.0.0.1:" + std::to_string(port_); }

  StatusWorker worker_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

size_t Count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST_F(WatchCommandTest, RefreshesTheTableCountTimesAndShowsUnreachableWorkers) {
  WatchCommandOptions options;
  options.targets = live() + ",127.0.0.1:" + std::to_string(ClosedPort());
  options.interval_ms = 20;
  options.count = 3;
  std::ostringstream out;
  ASSERT_TRUE(RunWatchCommand(options, out, nullptr).ok());
  const std::string text = out.str();
  EXPECT_EQ(Count(text, "moe-ep watch: 2 workers (1 unreachable), every 20 ms"), 3u);
  EXPECT_EQ(Count(text, "\x1b[H\x1b[2J"), 3u);
  EXPECT_EQ(Count(text, "UNREACHABLE"), 3u);
  EXPECT_EQ(Count(text, "ALLOCATED"), 3u);
  EXPECT_THAT(text, HasSubstr("1/2"));
  EXPECT_THAT(text, HasSubstr("42"));
  EXPECT_EQ(worker_.calls.load(), 3);
}

TEST_F(WatchCommandTest, StopsWhenAsked) {
  WatchCommandOptions options;
  options.targets = live();
  options.interval_ms = 10;
  options.clear_screen = false;
  std::ostringstream out;
  int polls = 0;
  // count = 0 runs until stop() says so; here after the second table.
  ASSERT_TRUE(
      RunWatchCommand(options, out, [&] { return worker_.calls.load() >= 2 && ++polls; }).ok());
  EXPECT_EQ(worker_.calls.load(), 2);
  EXPECT_EQ(Count(out.str(), "\x1b[H"), 0u);
}

TEST_F(WatchCommandTest, RejectsBadOptions) {
  WatchCommandOptions options;
  options.targets = live();
  options.interval_ms = 0;
  std::ostringstream out;
  auto status = RunWatchCommand(options, out, nullptr);
  EXPECT_EQ(status.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(status.message(), HasSubstr("--interval-ms"));
  options.interval_ms = 10;
  options.count = -1;
  EXPECT_EQ(RunWatchCommand(options, out, nullptr).code(), absl::StatusCode::kInvalidArgument);
  options.count = 1;
  options.targets = "";
  EXPECT_EQ(RunWatchCommand(options, out, nullptr).code(), absl::StatusCode::kInvalidArgument);
  options.targets = live();
  options.security.auth_token_file = "/nonexistent";
  EXPECT_EQ(RunWatchCommand(options, out, nullptr).code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(out.str().empty());
}

}  // namespace
}  // namespace moe_ep::client
