#pragma once

// Test helper: one worker's services (Worker + Rendezvous) in process on a
// free loopback port, with a stub and request builders for the worker service,
// backend and GPU tests (tests/server/worker_service_test.cc,
// tests/server/backend_selection_test.cc, tests/server/gpu_worker_service_test.cc).

#include <chrono>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "gtest/gtest.h"
#include "proto/rpc/health.h"
#include "server/rendezvous_service.h"
#include "server/worker_service.h"

namespace moe_ep::server::testing {

class InProcessWorker {
 public:
  explicit InProcessWorker(WorkerOptions options = {}) : worker_(options, &health_) {
    rpc::EnableDefaultHealthService();
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port_);
    builder.SetMaxReceiveMessageSize(256 << 20);
    builder.SetMaxSendMessageSize(256 << 20);
    builder.RegisterService(&worker_);
    builder.RegisterService(&rendezvous_);
    server_ = builder.BuildAndStart();
    worker_.SetListenAddress(address());  // as server/worker_process.cc does
    health_.Attach(server_->GetHealthCheckService());
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetMaxSendMessageSize(256 << 20);
    stub_ = v1::Worker::NewStub(
        grpc::CreateCustomChannel(address(), grpc::InsecureChannelCredentials(), args));
  }
  ~InProcessWorker() {
    worker_.BeginShutdown();
    server_->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  }
  InProcessWorker(const InProcessWorker&) = delete;
  InProcessWorker& operator=(const InProcessWorker&) = delete;

  std::string address() const { return "127.0.0.1:" + std::to_string(port_); }
  // The service itself, for its in-process entry points (RunOnDataPlane).
  WorkerService& service() { return worker_; }

  template <typename Req, typename Resp>
  grpc::Status Call(grpc::Status (v1::Worker::Stub::*method)(grpc::ClientContext*, const Req&,
                                                             Resp*),
                    const Req& request, Resp* response) {
    return CallWithin(std::chrono::seconds(60), method, request, response);
  }
  // As Call, with the call's deadline `timeout` from now.
  template <typename Req, typename Resp>
  grpc::Status CallWithin(std::chrono::milliseconds timeout,
                          grpc::Status (v1::Worker::Stub::*method)(grpc::ClientContext*, const Req&,
                                                                   Resp*),
                          const Req& request, Resp* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    // The server runs as long as this object: a failed first connect is
    // transient (CI saw one fail a fail-fast Join at once, "ipv4:127.0.0.1:
    // 44475: No such file or directory", and its peer wait 8 s), so the call
    // waits for the channel, within its deadline, as GrpcStore's do.
    context.set_wait_for_ready(true);
    return (stub_.get()->*method)(&context, request, response);
  }

  v1::GetStatusResponse Status() {
    v1::GetStatusResponse response;
    EXPECT_TRUE(Call(&v1::Worker::Stub::GetStatus, v1::GetStatusRequest(), &response).ok());
    return response;
  }
  grpc::Status Join(int world, int rank, int64_t generation, const std::string& rendezvous,
                    const std::string& backend, int64_t timeout_ms = 20000,
                    v1::JoinResponse* response = nullptr) {
    v1::JoinRequest request;
    request.set_world_size(world);
    request.set_rank(rank);
    request.set_backend(backend);
    request.set_rendezvous_address(rendezvous);
    request.set_generation(generation);
    request.set_timeout_ms(timeout_ms);
    v1::JoinResponse ignored;
    return Call(&v1::Worker::Stub::Join, request, response ? response : &ignored);
  }
  grpc::Status Configure(const v1::ConfigureLayersRequest& request,
                         v1::ConfigureLayersResponse* response = nullptr) {
    v1::ConfigureLayersResponse ignored;
    return Call(&v1::Worker::Stub::ConfigureLayers, request, response ? response : &ignored);
  }
  grpc::Status Allocate(const v1::AllocateWorkspaceRequest& request,
                        v1::AllocateWorkspaceResponse* response = nullptr) {
    v1::AllocateWorkspaceResponse ignored;
    return Call(&v1::Worker::Stub::AllocateWorkspace, request, response ? response : &ignored);
  }
  grpc::Status Load(const v1::LoadExpertsRequest& request,
                    v1::LoadExpertsResponse* response = nullptr) {
    v1::LoadExpertsResponse ignored;
    return Call(&v1::Worker::Stub::LoadExperts, request, response ? response : &ignored);
  }
  grpc::Status Sync(int64_t epoch, int64_t local, v1::SyncTokenCountsResponse* response = nullptr) {
    v1::SyncTokenCountsRequest request;
    request.set_epoch(epoch);
    request.set_local_tokens(local);
    v1::SyncTokenCountsResponse ignored;
    return Call(&v1::Worker::Stub::SyncTokenCounts, request, response ? response : &ignored);
  }
  grpc::Status Commit(int64_t epoch, int64_t r, int64_t local) {
    v1::CommitGeometryRequest request;
    request.set_epoch(epoch);
    request.set_runtime_max_tokens_per_rank(r);
    request.set_local_tokens(local);
    v1::CommitGeometryResponse response;
    return Call(&v1::Worker::Stub::CommitGeometry, request, &response);
  }
  grpc::Status Forward(const v1::ForwardRequest& request, v1::ForwardResponse* response = nullptr) {
    v1::ForwardResponse ignored;
    return Call(&v1::Worker::Stub::Forward, request, response ? response : &ignored);
  }
  grpc::Status Benchmark(const v1::BenchmarkRequest& request, v1::BenchmarkResponse* response) {
    return Call(&v1::Worker::Stub::Benchmark, request, response);
  }
  grpc::Status Leave(int64_t generation) {
    v1::LeaveRequest request;
    request.set_generation(generation);
    v1::LeaveResponse response;
    return Call(&v1::Worker::Stub::Leave, request, &response);
  }

 private:
  rpc::HealthReporter health_;
  WorkerService worker_;
  RendezvousService rendezvous_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
  std::unique_ptr<v1::Worker::Stub> stub_;
};

// A ConfigureLayers request of one sparse layer ("hand": H = `hidden`, 4
// experts, top-2) over two ranks as one TP group with all-to-all.
inline v1::ConfigureLayersRequest OneLayerOverTwoRanks(int64_t hidden) {
  v1::ConfigureLayersRequest request;
  request.mutable_layout()->set_tp_size(2);
  request.mutable_layout()->set_attn_dp_size(1);
  request.set_a2a_enabled(true);
  v1::ModelDescription* model = request.mutable_model();
  model->set_name("hand");
  model->set_hidden_size(hidden);
  model->set_num_layers(1);
  model->set_num_experts(4);
  model->set_top_k(2);
  model->add_sparse_layers(true);
  return request;
}

// Runs f(0) .. f(n - 1) on n threads and waits for all.
inline void OnAllRanks(int n, const std::function<void(int)>& f) {
  std::vector<std::thread> threads;
  for (int r = 1; r < n; ++r) threads.emplace_back([&f, r] { f(r); });
  f(0);
  for (std::thread& t : threads) t.join();
}

}  // namespace moe_ep::server::testing
