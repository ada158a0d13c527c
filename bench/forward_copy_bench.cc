// forward_copy_bench: what the Forward RPC costs beyond its step, on one GPU
// (issue 11 item 2), in ONE run on the same inputs:
//   t_step     the in-process step: kernels::GpuEpDispatcher::Forward on
//              device inputs + NcclCollective::Synchronize (wall time);
//   t_plane    server::GpuDataPlane::ForwardBytes from host bytes to host
//              bytes (the worker's Forward path without gRPC), for both
//              ForwardHostCopy modes (pageable direct vs pinned staging);
//   t_Echo     the test-only Echo RPC of an in-process worker (--enable-echo)
//              over loopback gRPC with the request's hidden tensor;
//   t_Forward  the Forward RPC of the same worker (client wall time, from
//              the call to the parsed reply).
// Target: t_Forward <= 2 t_Echo + t_step. The worker's Forward output is
// checked to be bit-identical to the in-process step's.
// Defaults are DeepSeek-V3's MoE layer at EP 1: T 4096, H 7168, top-8 of 256
// seeded SwiGLU experts with I 2048. Figures: p50 (and min, max) over
// --iters calls after --warmup. Source: issue 11; DESIGN §8, §10.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "CLI/CLI.hpp"
#include "core/bf16.h"
#include "core/expert_source.h"
#include "gloo/rendezvous/hash_store.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "grpcpp/security/server_credentials.h"
#include "grpcpp/server.h"
#include "grpcpp/server_builder.h"
#include "kernels/device_experts.h"
#include "kernels/gpu_ep_dispatcher.h"
#include "kernels/nccl_collective.h"
#include "nlohmann/json.hpp"
#include "server/gpu_data_plane.h"
#include "server/tensor_codec.h"
#include "server/worker_service.h"

namespace moe_ep {
namespace {

struct Args {
  int64_t tokens = 4096;
  int64_t hidden = 7168;
  int top_k = 8;
  int experts = 256;
  int64_t intermediate = 2048;  // 0 = identity experts
  int iters = 10;
  int warmup = 2;
  uint64_t seed = 1;
  std::string json;  // optional output file
};

struct Times {
  std::vector<double> ms;
  double P50() const {
    std::vector<double> v = ms;
    std::sort(v.begin(), v.end());
    return v.empty() ? 0 : v[(v.size() - 1) / 2];
  }
  double Min() const { return ms.empty() ? 0 : *std::min_element(ms.begin(), ms.end()); }
  double Max() const { return ms.empty() ? 0 : *std::max_element(ms.begin(), ms.end()); }
  nlohmann::json Json() const { return {{"p50_ms", P50()}, {"min_ms", Min()}, {"max_ms", Max()}}; }
};

[[noreturn]] void Die(const std::string& what) {
  std::fprintf(stderr, "forward_copy_bench: %s\n", what.c_str());
  std::exit(1);
}

void Check(const absl::Status& status, const char* what) {
  if (!status.ok()) Die(std::string(what) + ": " + status.ToString());
}

void Check(cudaError_t error, const char* what) {
  if (error != cudaSuccess) Die(std::string(what) + ": " + cudaGetErrorString(error));
}

void Check(const grpc::Status& status, const char* what) {
  if (!status.ok()) Die(std::string(what) + ": " + status.error_message());
}

double Ms(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

// Runs f warmup + iters times; returns the timed iterations.
Times Time(const Args& args, const std::function<void()>& f) {
  Times t;
  for (int i = 0; i < args.warmup + args.iters; ++i) {
    const auto start = std::chrono::steady_clock::now();
    f();
    const auto end = std::chrono::steady_clock::now();
    if (i >= args.warmup) t.ms.push_back(Ms(start, end));
  }
  return t;
}

// The request: hidden uniform in [-1, 1) as bf16, K distinct experts per
// token uniformly, weights uniform in (0, 1) / K.
struct Inputs {
  std::vector<core::bf16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Inputs MakeInputs(const Args& a) {
  std::mt19937_64 rng(a.seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::uniform_real_distribution<float> weight(0.01f, 1.0f);
  std::uniform_int_distribution<int> expert(0, a.experts - 1);
  Inputs in;
  in.hidden.resize(a.tokens * a.hidden);
  for (core::bf16_t& v : in.hidden) v = core::FloatToBf16(value(rng));
  for (int64_t t = 0; t < a.tokens; ++t) {
    std::vector<int32_t> chosen;
    while (static_cast<int>(chosen.size()) < a.top_k) {
      const int32_t e = expert(rng);
      if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
    }
    for (int32_t e : chosen) {
      in.ids.push_back(e);
      in.weights.push_back(weight(rng) / static_cast<float>(a.top_k));
    }
  }
  return in;
}

core::ExpertSource Source(const Args& a) {
  if (a.intermediate == 0)
    return core::ExpertSource::Identity(0, a.experts, 0, a.experts, a.hidden);
  return core::ExpertSource::Seeded(a.seed, 0, a.experts, 0, a.experts, a.hidden, a.intermediate);
}

core::EpDispatcherOptions Options(const Args& a) {
  core::EpDispatcherOptions o;
  o.workspace = core::WorkspaceSpec{1, a.tokens, a.hidden, a.top_k};
  o.num_experts = a.experts;
  return o;
}

// t_step: the dispatcher's Forward on device inputs. Returns the output.
Times StepInProcess(const Args& a, const Inputs& in, std::string* output) {
  absl::StatusOr<std::string> id = kernels::NcclCollective::NewUniqueId();
  Check(id.status(), "NewUniqueId");
  auto coll = kernels::NcclCollective::Create(*id, 0, 1, 0, std::chrono::seconds(120));
  Check(coll.status(), "NcclCollective::Create");
  kernels::GpuEpDispatcherOptions o;
  o.dispatcher = Options(a);
  o.max_intermediate = a.intermediate;
  auto d = kernels::GpuEpDispatcher::Create(coll->get(), o, 0);
  Check(d.status(), "GpuEpDispatcher::Create");
  auto experts = kernels::DeviceExpertSet::Load(Source(a));
  Check(experts.status(), "DeviceExpertSet::Load");
  uint16_t* hidden = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  uint16_t* out = nullptr;
  const int64_t hidden_bytes = a.tokens * a.hidden * 2;
  const int64_t k_bytes = a.tokens * a.top_k * 4;
  Check(cudaMalloc(&hidden, hidden_bytes), "cudaMalloc");
  Check(cudaMalloc(&ids, k_bytes), "cudaMalloc");
  Check(cudaMalloc(&weights, k_bytes), "cudaMalloc");
  Check(cudaMalloc(&out, hidden_bytes), "cudaMalloc");
  Check(cudaMemcpy(hidden, in.hidden.data(), hidden_bytes, cudaMemcpyHostToDevice), "upload");
  Check(cudaMemcpy(ids, in.ids.data(), k_bytes, cudaMemcpyHostToDevice), "upload");
  Check(cudaMemcpy(weights, in.weights.data(), k_bytes, cudaMemcpyHostToDevice), "upload");
  Check((*d)->CommitGeometry(1, a.tokens, a.tokens), "CommitGeometry");
  Times t = Time(a, [&] {
    Check((*d)->Forward(hidden, ids, weights, a.tokens, **experts, out), "Forward");
    Check((*coll)->Synchronize(), "Synchronize");
  });
  output->resize(hidden_bytes);
  Check(cudaMemcpy(output->data(), out, hidden_bytes, cudaMemcpyDeviceToHost), "download");
  cudaFree(hidden);
  cudaFree(ids);
  cudaFree(weights);
  cudaFree(out);
  return t;
}

std::string Bytes(const void* data, size_t bytes) {
  return std::string(static_cast<const char*>(data), bytes);
}

// t_plane: GpuDataPlane::ForwardBytes in each host-copy mode.
std::pair<Times, Times> PlaneInProcess(const Args& a, const Inputs& in, const std::string& want,
                                       bool* identical) {
  server::DataPlaneGroup group;
  group.plane = server::PlaneRequest::kNccl;
  auto plane = server::GpuDataPlane::Form(group, std::make_shared<gloo::rendezvous::HashStore>());
  Check(plane.status(), "GpuDataPlane::Form");
  Check((*plane)->Allocate(Options(a), a.intermediate, 0).status(), "Allocate");
  Check((*plane)->LoadExperts(0, Source(a), 0).status(), "LoadExperts");
  Check((*plane)->CommitGeometry(1, a.tokens, a.tokens), "CommitGeometry");
  const std::string hidden = Bytes(in.hidden.data(), in.hidden.size() * 2);
  const std::string ids = Bytes(in.ids.data(), in.ids.size() * 4);
  const std::string weights = Bytes(in.weights.data(), in.weights.size() * 4);
  server::ForwardTensorBytes bytes;
  bytes.hidden = hidden;
  bytes.topk_ids = ids;
  bytes.topk_weights = weights;
  std::pair<Times, Times> times;
  *identical = true;
  using Copy = server::GpuDataPlane::ForwardHostCopy;
  for (Copy copy : {Copy::kPageable, Copy::kPinned}) {
    (*plane)->set_forward_host_copy(copy);
    std::string output;
    Times t = Time(a, [&] {
      output = std::string();  // a fresh reply each call, as gRPC's
      Check((*plane)->ForwardBytes(0, bytes, a.tokens, &output).status(), "ForwardBytes");
    });
    *identical = *identical && output == want;
    (copy == Copy::kPageable ? times.first : times.second) = t;
  }
  return times;
}

struct RpcTimes {
  Times echo;
  Times forward;
  Times forward_server_total;  // ForwardResponse.timings.total_us
  bool identical = false;
  int64_t tokens_sent = 0;
  int64_t tokens_received = 0;
};

RpcTimes OverGrpc(const Args& a, const Inputs& in, const std::string& want) {
  server::WorkerOptions options;
  options.enable_echo = true;
  server::WorkerService service(options, nullptr);
  int port = 0;
  grpc::ServerBuilder builder;
  builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(), &port);
  builder.SetMaxReceiveMessageSize(1 << 30);
  builder.SetMaxSendMessageSize(1 << 30);
  builder.RegisterService(&service);
  std::unique_ptr<grpc::Server> server = builder.BuildAndStart();
  if (server == nullptr) Die("gRPC server did not start");
  grpc::ChannelArguments channel_args;
  channel_args.SetMaxReceiveMessageSize(1 << 30);
  channel_args.SetMaxSendMessageSize(1 << 30);
  auto stub = v1::Worker::NewStub(grpc::CreateCustomChannel(
      "127.0.0.1:" + std::to_string(port), grpc::InsecureChannelCredentials(), channel_args));
  auto call = [&](auto method, const auto& request, auto* response, const char* what) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
    Check(((*stub).*method)(&context, request, response), what);
  };

  v1::JoinRequest join;
  join.set_world_size(1);
  join.set_rank(0);
  join.set_generation(1);
  join.set_backend("nccl");
  join.set_timeout_ms(120000);
  v1::JoinResponse joined;
  call(&v1::Worker::Stub::Join, join, &joined, "Join");
  v1::ConfigureLayersRequest configure;
  configure.mutable_layout()->set_tp_size(1);
  configure.mutable_layout()->set_attn_dp_size(1);
  configure.set_a2a_enabled(true);
  v1::ModelDescription* model = configure.mutable_model();
  model->set_name("deepseek-v3-moe-layer");
  model->set_hidden_size(a.hidden);
  model->set_num_layers(1);
  model->set_num_experts(a.experts);
  model->set_top_k(a.top_k);
  model->set_moe_intermediate_size(a.intermediate);
  model->add_sparse_layers(true);
  v1::ConfigureLayersResponse configured;
  call(&v1::Worker::Stub::ConfigureLayers, configure, &configured, "ConfigureLayers");
  v1::AllocateWorkspaceRequest allocate;
  allocate.set_hidden_size(a.hidden);
  allocate.set_top_k(a.top_k);
  allocate.set_num_experts(a.experts);
  allocate.set_capacity_tokens(a.tokens);
  allocate.set_dispatch_dtype(v1::DISPATCH_DTYPE_BF16);
  v1::AllocateWorkspaceResponse allocated;
  call(&v1::Worker::Stub::AllocateWorkspace, allocate, &allocated, "AllocateWorkspace");
  v1::LoadExpertsRequest load;
  load.set_layer(0);
  if (a.intermediate > 0) {
    load.set_kind(v1::EXPERT_KIND_SWIGLU);
    load.set_intermediate_size(a.intermediate);
    load.set_seed(a.seed);
  } else {
    load.set_kind(v1::EXPERT_KIND_IDENTITY);
  }
  v1::LoadExpertsResponse loaded;
  call(&v1::Worker::Stub::LoadExperts, load, &loaded, "LoadExperts");
  v1::SyncTokenCountsRequest sync;
  sync.set_epoch(1);
  sync.set_local_tokens(a.tokens);
  v1::SyncTokenCountsResponse synced;
  call(&v1::Worker::Stub::SyncTokenCounts, sync, &synced, "SyncTokenCounts");
  v1::CommitGeometryRequest commit;
  commit.set_epoch(1);
  commit.set_runtime_max_tokens_per_rank(a.tokens);
  commit.set_local_tokens(a.tokens);
  v1::CommitGeometryResponse committed;
  call(&v1::Worker::Stub::CommitGeometry, commit, &committed, "CommitGeometry");

  v1::ForwardRequest forward;
  forward.set_layer(0);
  forward.set_epoch(1);
  *forward.mutable_hidden_states() =
      server::EncodeBf16(in.hidden, std::vector<int64_t>{a.tokens, a.hidden});
  *forward.mutable_topk_ids() =
      server::EncodeInt32(in.ids, std::vector<int64_t>{a.tokens, a.top_k});
  *forward.mutable_topk_weights() =
      server::EncodeFloat32(in.weights, std::vector<int64_t>{a.tokens, a.top_k});
  v1::EchoRequest echo;
  *echo.mutable_tensor() = forward.hidden_states();

  RpcTimes out;
  // Interleaved, so both see the same machine state.
  for (int i = 0; i < a.warmup + a.iters; ++i) {
    v1::EchoResponse echoed;
    auto t0 = std::chrono::steady_clock::now();
    call(&v1::Worker::Stub::Echo, echo, &echoed, "Echo");
    auto t1 = std::chrono::steady_clock::now();
    v1::ForwardResponse reply;
    call(&v1::Worker::Stub::Forward, forward, &reply, "Forward");
    auto t2 = std::chrono::steady_clock::now();
    if (echoed.tensor().data() != echo.tensor().data()) Die("Echo returned other bytes");
    if (i < a.warmup) continue;
    out.echo.ms.push_back(Ms(t0, t1));
    out.forward.ms.push_back(Ms(t1, t2));
    out.forward_server_total.ms.push_back(reply.timings().total_us() / 1000.0);
    out.identical = reply.output().data() == want;
    out.tokens_sent = reply.tokens_sent();
    out.tokens_received = reply.tokens_received();
  }
  service.BeginShutdown();
  server->Shutdown(std::chrono::system_clock::now() + std::chrono::seconds(5));
  return out;
}

int Main(int argc, char** argv) {
  Args a;
  CLI::App app{"forward_copy_bench: t_Echo, t_Forward and t_step on one GPU (issue 11 item 2)"};
  app.add_option("--tokens", a.tokens, "T, tokens of the request")->capture_default_str();
  app.add_option("--hidden", a.hidden, "H")->capture_default_str();
  app.add_option("--top-k", a.top_k, "K")->capture_default_str();
  app.add_option("--experts", a.experts, "routed experts (all on this GPU, EP 1)")
      ->capture_default_str();
  app.add_option("--intermediate", a.intermediate, "SwiGLU I; 0 = identity experts")
      ->capture_default_str();
  app.add_option("--iters", a.iters, "timed calls")->capture_default_str();
  app.add_option("--warmup", a.warmup, "untimed calls first")->capture_default_str();
  app.add_option("--seed", a.seed, "inputs and expert weights")->capture_default_str();
  app.add_option("--json", a.json, "also write the figures to this file");
  CLI11_PARSE(app, argc, argv);
  if (a.iters < 1) Die("--iters: expected >= 1");
  Check(cudaSetDevice(0), "cudaSetDevice");
  cudaDeviceProp prop{};
  Check(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");

  const Inputs in = MakeInputs(a);
  std::string step_output;
  const Times step = StepInProcess(a, in, &step_output);
  bool plane_identical = false;
  const auto [pageable, pinned] = PlaneInProcess(a, in, step_output, &plane_identical);
  const RpcTimes rpc = OverGrpc(a, in, step_output);

  const double budget = 2 * rpc.echo.P50() + step.P50();
  const bool met = rpc.forward.P50() <= budget;
  std::printf(
      "device %s; T %lld, H %lld, top-%d of %d experts (%s), EP 1; %d iters after %d\n", prop.name,
      static_cast<long long>(a.tokens), static_cast<long long>(a.hidden), a.top_k, a.experts,
      a.intermediate > 0 ? ("SwiGLU I " + std::to_string(a.intermediate)).c_str() : "identity",
      a.iters, a.warmup);
  auto row = [](const char* name, const Times& t) {
    std::printf("  %-34s p50 %9.3f ms  min %9.3f  max %9.3f\n", name, t.P50(), t.Min(), t.Max());
  };
  row("t_step (in-process dispatcher)", step);
  row("t_plane pageable (ForwardBytes)", pageable);
  row("t_plane pinned (ForwardBytes)", pinned);
  row("t_Echo (gRPC)", rpc.echo);
  row("t_Forward (gRPC)", rpc.forward);
  row("  Forward total_us (server side)", rpc.forward_server_total);
  std::printf("  outputs identical to the in-process step: plane %s, Forward RPC %s\n",
              plane_identical ? "yes" : "NO", rpc.identical ? "yes" : "NO");
  std::printf("  tokens_sent %lld, tokens_received %lld\n", static_cast<long long>(rpc.tokens_sent),
              static_cast<long long>(rpc.tokens_received));
  std::printf("target t_Forward <= 2 t_Echo + t_step: %.3f <= 2 * %.3f + %.3f = %.3f ms: %s\n",
              rpc.forward.P50(), rpc.echo.P50(), step.P50(), budget, met ? "MET" : "MISSED");
  if (!a.json.empty()) {
    nlohmann::json j = {{"device", prop.name},
                        {"tokens", a.tokens},
                        {"hidden", a.hidden},
                        {"top_k", a.top_k},
                        {"experts", a.experts},
                        {"intermediate", a.intermediate},
                        {"iters", a.iters},
                        {"warmup", a.warmup},
                        {"t_step", step.Json()},
                        {"t_plane_pageable", pageable.Json()},
                        {"t_plane_pinned", pinned.Json()},
                        {"t_echo", rpc.echo.Json()},
                        {"t_forward", rpc.forward.Json()},
                        {"forward_server_total", rpc.forward_server_total.Json()},
                        {"outputs_identical", plane_identical && rpc.identical},
                        {"budget_ms", budget},
                        {"target_met", met}};
    std::ofstream(a.json) << j.dump(2) << "\n";
  }
  return plane_identical && rpc.identical ? 0 : 1;
}

}  // namespace
}  // namespace moe_ep

int main(int argc, char** argv) {
  try {
    return moe_ep::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "forward_copy_bench: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "forward_copy_bench: unknown exception\n");
  }
  return 1;
}
