#include "server/metrics.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "core/bf16.h"
#include "gmock/gmock.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/rpc/health.h"
#include "server/tensor_codec.h"
#include "server/worker_service.h"

namespace moe_ep::server {
namespace {

using ::testing::HasSubstr;

// GET http://127.0.0.1:port/metrics over a plain socket; returns the body.
std::string Scrape(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  EXPECT_GE(fd, 0);
  sockaddr_in addr = {};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  const std::string request =
      "GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n";
  EXPECT_EQ(write(fd, request.data(), request.size()), static_cast<ssize_t>(request.size()));
  std::string response;
  char buffer[4096];
  ssize_t n;
  while ((n = read(fd, buffer, sizeof(buffer))) > 0) response.append(buffer, n);
  close(fd);
  EXPECT_THAT(response, HasSubstr("200 OK"));
  const size_t body = response.find("\r\n\r\n");
  return body == std::string::npos ? "" : response.substr(body + 4);
}

// The value of the sample `series` (name plus labels exactly as exposed), or
// -1 when absent.
double Sample(const std::string& text, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double value = 0;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
    }
  }
  return -1;
}

std::string Rpc(const std::string& method, const std::string& code) {
  return absl::StrCat("moe_ep_rpcs_total{code=\"", code, "\",method=\"/moe_ep.v1.Worker/", method,
                      "\"}");
}

// A one-rank worker with the metrics interceptor and /metrics on a free port.
class MeteredWorker {
 public:
  MeteredWorker()
      : worker_(WorkerOptions(), &health_), metrics_([this] {
          v1::GetStatusRequest request;
          v1::GetStatusResponse status;
          worker_.GetStatus(nullptr, &request, &status);
          return status;
        }) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.RegisterService(&worker_);
    std::vector<std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>> factories;
    factories.push_back(metrics_.MakeInterceptorFactory());
    builder.experimental().SetInterceptorCreators(std::move(factories));
    server_ = builder.BuildAndStart();
    auto http = MetricsServer::Start("127.0.0.1:0", metrics_);
    EXPECT_TRUE(http.ok()) << http.status();
    http_ = std::move(*http);
    stub_ = v1::Worker::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                                    grpc::InsecureChannelCredentials()));
  }
  ~MeteredWorker() {
    worker_.BeginShutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  std::string Scrape() { return ::moe_ep::server::Scrape(http_->port()); }
  template <typename Req, typename Resp>
  grpc::Status Call(grpc::Status (v1::Worker::Stub::*method)(grpc::ClientContext*, const Req&,
                                                             Resp*),
                    const Req& request, Resp* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
    return (stub_.get()->*method)(&context, request, response);
  }
  WorkerMetrics& metrics() { return metrics_; }

 private:
  rpc::HealthReporter health_;
  WorkerService worker_;
  WorkerMetrics metrics_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<MetricsServer> http_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

// Hand case: H=4, K=2, 4 experts, 1 rank; 3 tokens, every token to rank 0
// once -> 3 tokens sent and received, 0 bytes to other ranks.
v1::ForwardRequest ThreeTokens(int64_t epoch) {
  std::vector<core::bf16_t> hidden(12);
  for (int i = 0; i < 12; ++i) hidden[i] = core::FloatToBf16(static_cast<float>(i));
  const int32_t ids[6] = {0, 1, 2, 3, 3, -1};
  const float weights[6] = {0.5f, 0.5f, 0.25f, 0.75f, 1.0f, 0.0f};
  v1::ForwardRequest request;
  request.set_layer(0);
  request.set_epoch(epoch);
  *request.mutable_hidden_states() = EncodeBf16(hidden, std::vector<int64_t>{3, 4});
  *request.mutable_topk_ids() = EncodeInt32(ids, std::vector<int64_t>{3, 2});
  *request.mutable_topk_weights() = EncodeFloat32(weights, std::vector<int64_t>{3, 2});
  return request;
}

TEST(WorkerMetrics, ScrapedValuesFollowTheCalls) {
  MeteredWorker w;
  std::string text = w.Scrape();
  EXPECT_EQ(Sample(text, "moe_ep_state{state=\"STARTED\"}"), 1);
  EXPECT_EQ(Sample(text, "moe_ep_capacity_tokens"), 0);
  EXPECT_EQ(Sample(text, "moe_ep_forward_tokens_sent_total"), 0);
  EXPECT_EQ(Sample(text, Rpc("Forward", "OK")), -1);

  v1::JoinRequest join;
  join.set_world_size(1);
  join.set_rank(0);
  join.set_backend("gloo");
  join.set_generation(4);
  v1::JoinResponse joined;
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::Join, join, &joined).ok());
  v1::ConfigureLayersRequest configure;
  configure.mutable_layout()->set_tp_size(1);
  configure.mutable_layout()->set_attn_dp_size(1);
  configure.set_a2a_enabled(true);
  configure.mutable_model()->set_hidden_size(4);
  configure.mutable_model()->set_num_layers(1);
  configure.mutable_model()->set_num_experts(4);
  configure.mutable_model()->set_top_k(2);
  configure.mutable_model()->add_sparse_layers(true);
  v1::ConfigureLayersResponse configured;
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::ConfigureLayers, configure, &configured).ok());
  v1::AllocateWorkspaceRequest allocate;
  allocate.set_hidden_size(4);
  allocate.set_top_k(2);
  allocate.set_num_experts(4);
  allocate.set_capacity_tokens(8);
  v1::AllocateWorkspaceResponse allocated;
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::AllocateWorkspace, allocate, &allocated).ok());
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  load.set_kind(v1::EXPERT_KIND_IDENTITY);
  v1::LoadExpertsResponse loaded;
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::LoadExperts, load, &loaded).ok());
  v1::CommitGeometryRequest commit;
  commit.set_epoch(7);
  commit.set_runtime_max_tokens_per_rank(5);
  commit.set_local_tokens(3);
  v1::CommitGeometryResponse committed;
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::CommitGeometry, commit, &committed).ok());

  v1::ForwardResponse forward;
  for (int i = 0; i < 2; ++i) {
    ASSERT_TRUE(w.Call(&v1::Worker::Stub::Forward, ThreeTokens(7), &forward).ok());
  }
  // A rejected call (stale epoch) counts under its code.
  EXPECT_EQ(w.Call(&v1::Worker::Stub::Forward, ThreeTokens(6), &forward).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);

  v1::GetStatusResponse status;
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::GetStatus, v1::GetStatusRequest(), &status).ok());
  text = w.Scrape();
  EXPECT_EQ(Sample(text, Rpc("Forward", "OK")), 2);
  EXPECT_EQ(Sample(text, Rpc("Forward", "FAILED_PRECONDITION")), 1);
  EXPECT_EQ(Sample(text, Rpc("Join", "OK")), 1);
  EXPECT_EQ(
      Sample(text,
             "moe_ep_rpc_duration_seconds_count{code=\"OK\",method=\"/moe_ep.v1.Worker/Forward\"}"),
      2);
  EXPECT_GT(
      Sample(text,
             "moe_ep_rpc_duration_seconds_sum{code=\"OK\",method=\"/moe_ep.v1.Worker/Forward\"}"),
      0);
  EXPECT_EQ(Sample(text, "moe_ep_forward_phase_seconds_count{phase=\"dispatch\"}"), 2);
  EXPECT_EQ(Sample(text, "moe_ep_forward_phase_seconds_count{phase=\"expert\"}"), 2);
  EXPECT_EQ(Sample(text, "moe_ep_forward_phase_seconds_count{phase=\"combine\"}"), 2);
  EXPECT_EQ(Sample(text, "moe_ep_forward_tokens_sent_total"), 6);  // 3 tokens x 2 steps
  EXPECT_EQ(Sample(text, "moe_ep_forward_tokens_received_total"), 6);
  EXPECT_EQ(Sample(text, "moe_ep_forward_bytes_sent_total"), 0);  // one rank: nothing remote
  EXPECT_EQ(Sample(text, "moe_ep_runtime_max_tokens_per_rank"), 5);
  EXPECT_EQ(Sample(text, "moe_ep_capacity_tokens"), 8);
  EXPECT_EQ(Sample(text, "moe_ep_geometry_epoch"), 7);
  EXPECT_EQ(Sample(text, "moe_ep_generation"), 4);
  EXPECT_EQ(Sample(text, "moe_ep_workspace_bytes"), static_cast<double>(status.workspace_bytes()));
  EXPECT_EQ(Sample(text, "moe_ep_workspace_bytes"),
            static_cast<double>(allocated.allocated_bytes()));
  EXPECT_GT(Sample(text, "moe_ep_workspace_bytes"), 0);
  EXPECT_EQ(Sample(text, "moe_ep_state{state=\"ALLOCATED\"}"), 1);
  EXPECT_EQ(Sample(text, "moe_ep_state{state=\"STARTED\"}"), 0);
  EXPECT_EQ(Sample(text, "moe_ep_forwards_total"), 2);
  EXPECT_EQ(Sample(text, "moe_ep_errors_total"), 1);
  // Load statistics (DESIGN §15): ids {0, 1, 2, 3, 3, -1} twice.
  EXPECT_EQ(Sample(text, "moe_ep_expert_tokens_total{layer=\"0\",expert=\"0\"}"), 2);
  EXPECT_EQ(Sample(text, "moe_ep_expert_tokens_total{layer=\"0\",expert=\"2\"}"), 2);
  EXPECT_EQ(Sample(text, "moe_ep_expert_tokens_total{layer=\"0\",expert=\"3\"}"), 4);
  v1::GetExpertLoadRequest read;
  read.set_layer(0);
  read.set_reset(true);
  v1::GetExpertLoadResponse window;
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::GetExpertLoad, read, &window).ok());
  EXPECT_EQ(
      std::vector<int64_t>(window.tokens_per_expert().begin(), window.tokens_per_expert().end()),
      (std::vector<int64_t>{2, 2, 2, 4}));
  EXPECT_EQ(window.steps(), 2);
  ASSERT_TRUE(w.Call(&v1::Worker::Stub::GetExpertLoad, read, &window).ok());
  EXPECT_EQ(window.steps(), 0);
  EXPECT_EQ(window.tokens_per_expert(3), 0);
  // The counter is monotonic: a reset of the window leaves it.
  EXPECT_EQ(Sample(w.Scrape(), "moe_ep_expert_tokens_total{layer=\"0\",expert=\"3\"}"), 4);
  // FAILED_PRECONDITION does not break the group.
  EXPECT_EQ(Sample(text,
                   "moe_ep_communicator_errors_total{code=\"FAILED_PRECONDITION\",method=\"/"
                   "moe_ep.v1.Worker/Forward\"}"),
            -1);
}

TEST(WorkerMetrics, CommunicatorErrorsCountGroupBreakingCodesOfCollectives) {
  MeteredWorker w;
  w.metrics().RecordRpc("/moe_ep.v1.Worker/Forward", grpc::StatusCode::DEADLINE_EXCEEDED, 1.5);
  w.metrics().RecordRpc("/moe_ep.v1.Worker/Join", grpc::StatusCode::UNAVAILABLE, 0.1);
  w.metrics().RecordRpc("/moe_ep.v1.Worker/Forward", grpc::StatusCode::INVALID_ARGUMENT, 0.1);
  w.metrics().RecordRpc("/moe_ep.v1.Worker/GetStatus", grpc::StatusCode::UNAVAILABLE, 0.1);
  w.metrics().RecordRpc("/moe_ep.v1.Rendezvous/Get", grpc::StatusCode::DEADLINE_EXCEEDED, 0.1);
  const std::string text = w.Scrape();
  EXPECT_EQ(Sample(text,
                   "moe_ep_communicator_errors_total{code=\"DEADLINE_EXCEEDED\",method=\"/"
                   "moe_ep.v1.Worker/Forward\"}"),
            1);
  EXPECT_EQ(Sample(text,
                   "moe_ep_communicator_errors_total{code=\"UNAVAILABLE\",method=\"/moe_ep.v1."
                   "Worker/Join\"}"),
            1);
  EXPECT_EQ(Sample(text,
                   "moe_ep_communicator_errors_total{code=\"UNAVAILABLE\",method=\"/moe_ep.v1."
                   "Worker/GetStatus\"}"),
            -1);
  EXPECT_EQ(Sample(text,
                   "moe_ep_communicator_errors_total{code=\"INVALID_ARGUMENT\",method=\"/"
                   "moe_ep.v1.Worker/Forward\"}"),
            -1);
  // 1.5 s falls in the bucket with upper bound 50us * 2^15 = 1.6384 s, not below.
  EXPECT_EQ(Sample(text,
                   "moe_ep_rpc_duration_seconds_bucket{code=\"DEADLINE_EXCEEDED\",method=\"/"
                   "moe_ep.v1.Worker/Forward\",le=\"1.6384\"}"),
            1);
  EXPECT_EQ(Sample(text,
                   "moe_ep_rpc_duration_seconds_bucket{code=\"DEADLINE_EXCEEDED\",method=\"/"
                   "moe_ep.v1.Worker/Forward\",le=\"0.8192\"}"),
            0);
}

TEST(MetricsServer, RejectsAddressWithoutPort) {
  WorkerMetrics metrics([] { return v1::GetStatusResponse(); });
  auto server = MetricsServer::Start("127.0.0.1", metrics);
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(server.status().message(), HasSubstr("expected host:port"));
}

TEST(MetricsServer, BusyPortIsUnavailable) {
  WorkerMetrics metrics([] { return v1::GetStatusResponse(); });
  auto first = MetricsServer::Start("127.0.0.1:0", metrics);
  ASSERT_TRUE(first.ok()) << first.status();
  auto second = MetricsServer::Start(absl::StrCat("127.0.0.1:", (*first)->port()), metrics);
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(second.status().message(), HasSubstr("cannot serve /metrics"));
}

}  // namespace
}  // namespace moe_ep::server
