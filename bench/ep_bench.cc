// ep_bench: dispatch and combine latency (p50/p99) and GB/s of the GPU data
// plane (kernels/gpu_ep_dispatcher.h) on the GPUs of one host, one thread and
// one GPU per rank, NCCL unique id shared in process. Identity experts, so the
// numbers are the data plane's alone. Usable without the coordinator.
//
// Reported per configuration (rank 0's view; every rank runs the same loop):
//   dispatch_us / combine_us p50 and p99 over --iters steps, timed with CUDA
//   events around Dispatch (route, pack, all-to-all) and Combine (all-to-all,
//   reduction) after an all-rank barrier each step;
//   logical GB/s = payload bytes of all token copies (one per distinct
//   destination rank, the local share included) / time, dispatch 2H + 8K and
//   combine 2H bytes per copy; remote GB/s = bytes to other ranks / time and
//   its fraction of 450 GB/s (NVLink 4, one direction); wire bytes/token =
//   bytes this data plane moves per token (padded to R per peer);
//   *_host_call_us = wall time of the Dispatch / Combine host calls (enqueue
//   cost; with kHostAllGather it includes the synchronous all-gather);
//   graph_step_us = one whole step (device (epoch, R) check, dispatch,
//   identity experts, combine) replayed from a CUDA graph captured at R.
// --check host,device runs the eager loop once per (epoch, R) agreement mode
// (GeometryCheck::kHostAllGather: synchronous host all-gather in Dispatch;
// kDevice: header in the payload's NCCL group, checked on the device, read
// at CheckStep after the step). --swiglu-intermediate I > 0 also times
// ComputeExperts with seeded SwiGLU experts (one set per rank and hidden)
// for both GEMM paths (grouped with device counts; cuBLAS with host counts)
// and a whole SwiGLU step replayed from a graph (grouped path).
// --data-plane nccl,one-sided times each configuration on either plane of
// the service (issue 15 item 5): "nccl" is the dispatcher above, "one-sided"
// kernels/onesided/onesided_dispatcher.h over NCCL symmetric windows of the
// same communicator (kernels/onesided/nccl_peer_window.h; one rank per GPU
// as here, every GPU in one NVLink domain); it always agrees on (epoch, R)
// in its flags, so its rows carry check "device" and --check host adds no
// one-sided row; SwiGLU columns are the nccl plane's only (0 on one-sided
// rows). The last CSV column names the plane that ran.
// Source: DESIGN §10, §13; issues 3, 15.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/ep_bench_inputs.h"
#include "core/routing.h"
#include "kernels/gpu_ep_dispatcher.h"
#include "kernels/nccl_collective.h"
#include "kernels/onesided/nccl_peer_window.h"
#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/staged_control_collective.h"

namespace moe_ep::kernels {
namespace {

struct Config {
  int64_t tokens;
  int64_t hidden;
  int top_k;
  bool skewed;
  GeometryCheck check;
  bool one_sided = false;  // the one-sided plane (else the NCCL plane)
};

struct Result {
  double dispatch_p50 = 0, dispatch_p99 = 0, combine_p50 = 0, combine_p99 = 0;
  double logical_dispatch_bytes = 0, logical_combine_bytes = 0;
  double remote_dispatch_bytes = 0, remote_combine_bytes = 0;
  double wire_bytes_per_token = 0;
  double graph_step_p50 = 0, graph_step_p99 = 0;         // whole step replayed from a CUDA graph
  double swiglu_grouped_p50 = 0, swiglu_cublas_p50 = 0;  // ComputeExperts, SwiGLU
  double swiglu_graph_step_p50 = 0;                      // whole SwiGLU step, graph
  double dispatch_host_p50 = 0, combine_host_p50 = 0;    // wall time of the host calls
};

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = std::min(v.size() - 1, static_cast<size_t>(std::ceil(q * v.size())) - 1);
  return v[i];
}

#define BENCH_CHECK(expr)                                                                   \
  do {                                                                                      \
    const absl::Status& s_ = (expr);                                                        \
    if (!s_.ok()) {                                                                         \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #expr, s_.ToString().c_str()); \
      std::exit(1);                                                                         \
    }                                                                                       \
  } while (0)

void RunRank(int rank, int ep, const std::string& id, const std::vector<Config>& configs,
             int num_experts, int warmup, int iters, int64_t swiglu_intermediate,
             std::vector<Result>* results) {
  cudaSetDevice(rank);
  auto coll_or = NcclCollective::Create(id, rank, ep, rank, std::chrono::seconds(120));
  if (!coll_or.ok()) {
    std::fprintf(stderr, "rank %d: %s\n", rank, coll_or.status().ToString().c_str());
    std::exit(1);
  }
  NcclCollective& coll = **coll_or;
  StagedControlCollective ctrl(&coll);  // host barriers between timed steps
  auto placement = *core::ExpertPlacement::Contiguous(num_experts, ep);
  std::map<int64_t, std::unique_ptr<DeviceExpertSet>> swiglu;  // by hidden
  for (size_t ci = 0; ci < configs.size(); ++ci) {
    const Config& c = configs[ci];
    GpuEpDispatcherOptions options;
    options.dispatcher.workspace = {ep, c.tokens, c.hidden, c.top_k, core::DispatchDType::kBF16};
    options.dispatcher.num_experts = num_experts;
    options.geometry_check = c.check;
    options.max_intermediate = swiglu_intermediate;
    std::unique_ptr<GpuEpDispatcher> nccl_plane;
    std::unique_ptr<onesided::PeerWindows> windows;
    std::unique_ptr<onesided::OneSidedDispatcher> one_sided;
    if (c.one_sided) {
      auto bytes = onesided::OneSidedDispatcher::WindowBytes(options.dispatcher);
      BENCH_CHECK(bytes.status());
      auto w = onesided::CreateNcclPeerWindows(&coll, *bytes);
      BENCH_CHECK(w.status());
      windows = std::move(*w);
      onesided::OneSidedDispatcherOptions o;
      o.dispatcher = options.dispatcher;
      o.sm_budget = c.tokens >= 128 ? 64 : 32;  // bench/results/onesided's best budgets
      auto d = onesided::OneSidedDispatcher::Create(windows.get(), o, 0);
      BENCH_CHECK(d.status());
      one_sided = std::move(*d);
    } else {
      auto d = GpuEpDispatcher::Create(&coll, options, 0);
      BENCH_CHECK(d.status());
      nccl_plane = std::move(*d);
    }
    auto experts = *DeviceExpertSet::Upload(core::ExpertSet::Identity(
        placement.FirstExpert(rank), placement.NumLocalExperts(rank), c.hidden));
    const uint64_t seed = 1000 * ci + rank;
    const auto ids = bench::DistinctExpertIds(seed, c.tokens, c.top_k, num_experts, c.skewed);
    absl::StatusOr<bench::DeviceStepInputs> inputs =
        bench::MakeStepInputs(seed, c.tokens, c.hidden, c.top_k, num_experts, c.skewed);
    BENCH_CHECK(inputs.status());
    uint16_t* d_hidden = inputs->hidden;
    uint16_t* d_out = inputs->out;
    int32_t* d_ids = inputs->ids;
    float* d_weights = inputs->weights;
    cudaEvent_t ev[4];
    for (auto& e : ev) cudaEventCreate(&e);
    std::vector<double> dispatch_us, combine_us, dispatch_host_us, combine_host_us;
    std::vector<double> graph_us;
    // The eager loop, then whole steps replayed from a graph, on either plane.
    auto time_plane = [&](auto& disp) {
      BENCH_CHECK(disp.CommitGeometry(ci, c.tokens, c.tokens));
      using Clock = std::chrono::steady_clock;
      auto us_since = [](Clock::time_point t0) {
        return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
      };
      for (int it = 0; it < warmup + iters; ++it) {
        BENCH_CHECK(ctrl.Barrier());
        cudaEventRecord(ev[0], disp.stream());
        Clock::time_point t0 = Clock::now();
        BENCH_CHECK(disp.Dispatch(d_hidden, d_ids, d_weights, c.tokens));
        const double dh = us_since(t0);
        cudaEventRecord(ev[1], disp.stream());
        BENCH_CHECK(disp.ComputeExperts(*experts));
        cudaEventRecord(ev[2], disp.stream());
        t0 = Clock::now();
        BENCH_CHECK(disp.Combine(d_out));
        const double ch = us_since(t0);
        cudaEventRecord(ev[3], disp.stream());
        if (it >= warmup) {
          dispatch_host_us.push_back(dh);
          combine_host_us.push_back(ch);
        }
        BENCH_CHECK(disp.CheckStep());
        float a = 0, b = 0;
        cudaEventElapsedTime(&a, ev[0], ev[1]);
        cudaEventElapsedTime(&b, ev[2], ev[3]);
        if (it >= warmup) {
          dispatch_us.push_back(a * 1000.0);
          combine_us.push_back(b * 1000.0);
        }
      }
      // Whole step (device-side (epoch, R) check, dispatch, identity experts,
      // combine) captured at bucket R = tokens and replayed: no host sync inside.
      BENCH_CHECK(disp.CaptureForward(c.tokens, d_hidden, d_ids, d_weights, *experts, d_out));
      for (int it = 0; it < warmup + iters; ++it) {
        BENCH_CHECK(ctrl.Barrier());
        cudaEventRecord(ev[0], disp.stream());
        BENCH_CHECK(disp.ReplayForward(c.tokens, ci, c.tokens));
        cudaEventRecord(ev[1], disp.stream());
        BENCH_CHECK(disp.CheckStep());
        float a = 0;
        cudaEventElapsedTime(&a, ev[0], ev[1]);
        if (it >= warmup) graph_us.push_back(a * 1000.0);
      }
    };
    if (c.one_sided) {
      time_plane(*one_sided);
    } else {
      time_plane(*nccl_plane);
    }

    std::vector<double> grouped_us, cublas_us, swiglu_graph_us;
    if (swiglu_intermediate > 0 && c.check == GeometryCheck::kDevice && !c.one_sided) {
      GpuEpDispatcher& disp = *nccl_plane;
      if (swiglu.find(c.hidden) == swiglu.end()) {
        auto host = core::ExpertSet::GenerateSwiGlu(7, 3, placement.FirstExpert(rank),
                                                    placement.NumLocalExperts(rank), c.hidden,
                                                    swiglu_intermediate);
        BENCH_CHECK(host.status());
        auto dev = DeviceExpertSet::Upload(*host);
        BENCH_CHECK(dev.status());
        swiglu[c.hidden] = std::move(*dev);
      }
      const DeviceExpertSet& sw = *swiglu[c.hidden];
      for (ExpertGemm gemm : {ExpertGemm::kGroupedDevice, ExpertGemm::kCublasHostCounts}) {
        GpuEpDispatcherOptions o = options;
        o.expert_gemm = gemm;
        auto d2 = GpuEpDispatcher::Create(&coll, o, 0);
        BENCH_CHECK(d2.status());
        BENCH_CHECK((*d2)->CommitGeometry(ci, c.tokens, c.tokens));
        auto& out = gemm == ExpertGemm::kGroupedDevice ? grouped_us : cublas_us;
        for (int it = 0; it < warmup + iters; ++it) {
          BENCH_CHECK(ctrl.Barrier());
          BENCH_CHECK((*d2)->Dispatch(d_hidden, d_ids, d_weights, c.tokens));
          cudaEventRecord(ev[0], disp.stream());
          BENCH_CHECK((*d2)->ComputeExperts(sw));
          cudaEventRecord(ev[1], disp.stream());
          BENCH_CHECK((*d2)->Combine(d_out));
          BENCH_CHECK((*d2)->CheckStep());
          float a = 0;
          cudaEventElapsedTime(&a, ev[0], ev[1]);
          if (it >= warmup) out.push_back(a * 1000.0);
        }
        if (gemm == ExpertGemm::kGroupedDevice) {
          BENCH_CHECK((*d2)->CaptureForward(c.tokens, d_hidden, d_ids, d_weights, sw, d_out));
          for (int it = 0; it < warmup + iters; ++it) {
            BENCH_CHECK(ctrl.Barrier());
            cudaEventRecord(ev[0], disp.stream());
            BENCH_CHECK((*d2)->ReplayForward(c.tokens, ci, c.tokens));
            cudaEventRecord(ev[1], disp.stream());
            BENCH_CHECK((*d2)->CheckReplay());
            float a = 0;
            cudaEventElapsedTime(&a, ev[0], ev[1]);
            if (it >= warmup) swiglu_graph_us.push_back(a * 1000.0);
          }
        }
      }
    }
    if (rank == 0) {
      Result& r = (*results)[ci];
      if (!grouped_us.empty()) {
        r.swiglu_grouped_p50 = Percentile(grouped_us, 0.5);
        r.swiglu_cublas_p50 = Percentile(cublas_us, 0.5);
        r.swiglu_graph_step_p50 = Percentile(swiglu_graph_us, 0.5);
      }
      r.graph_step_p50 = Percentile(graph_us, 0.5);
      r.dispatch_host_p50 = Percentile(dispatch_host_us, 0.5);
      r.combine_host_p50 = Percentile(combine_host_us, 0.5);
      r.graph_step_p99 = Percentile(graph_us, 0.99);
      r.dispatch_p50 = Percentile(dispatch_us, 0.5);
      r.dispatch_p99 = Percentile(dispatch_us, 0.99);
      r.combine_p50 = Percentile(combine_us, 0.5);
      r.combine_p99 = Percentile(combine_us, 0.99);
      auto route = *core::ComputeDispatchRoute(ids, c.tokens, c.top_k, placement);
      const double dispatch_row = 2.0 * c.hidden + 8.0 * c.top_k;
      const double combine_row = 2.0 * c.hidden;
      for (int d = 0; d < ep; ++d) {
        r.logical_dispatch_bytes += route.send_counts[d] * dispatch_row;
        r.logical_combine_bytes += route.send_counts[d] * combine_row;
        if (d != rank) {
          r.remote_dispatch_bytes += route.send_counts[d] * dispatch_row;
          r.remote_combine_bytes += route.send_counts[d] * combine_row;
        }
      }
      r.wire_bytes_per_token = (ep - 1) * (dispatch_row + combine_row);
    }
    for (auto& e : ev) cudaEventDestroy(e);
    if (c.one_sided) {
      // No peer may still store into the windows when they go (a collective).
      BENCH_CHECK(ctrl.Barrier());
      one_sided.reset();
      windows.reset();
    }
    bench::FreeStepInputs(*inputs);
  }
}

}  // namespace
}  // namespace moe_ep::kernels

namespace {

// The program; main() below only adds the last-resort catch.
int Main(int argc, char** argv) {
  using namespace moe_ep::kernels;
  CLI::App app{"ep_bench: GPU dispatch/combine latency and bandwidth"};
  std::vector<int64_t> tokens = {1, 16, 128, 512, 4096, 16384};
  std::vector<int64_t> hiddens = {2048, 7168};
  std::vector<int> topks = {2, 8};
  std::vector<std::string> routings = {"uniform", "skewed"};
  std::vector<std::string> checks = {"host", "device"};
  std::vector<std::string> planes = {"nccl"};
  int num_experts = 256, warmup = 5, iters = 50, ep = 0;
  int64_t swiglu_intermediate = 0;
  app.add_option("--tokens", tokens, "tokens per rank");
  app.add_option("--hidden", hiddens, "hidden sizes");
  app.add_option("--topk", topks, "top-k values");
  app.add_option("--routing", routings, "uniform and/or skewed");
  app.add_option("--experts", num_experts, "routed experts");
  app.add_option("--warmup", warmup);
  app.add_option("--iters", iters);
  app.add_option("--ep", ep, "ranks (default: all visible GPUs)");
  app.add_option("--check", checks, "(epoch, R) agreement: host and/or device");
  app.add_option("--data-plane", planes, "nccl and/or one-sided (the service's two GPU planes)")
      ->check(CLI::IsMember({"nccl", "one-sided"}));
  app.add_option(
      "--swiglu-intermediate", swiglu_intermediate,
      "I > 0: also time SwiGLU expert compute (grouped vs cuBLAS) and a SwiGLU graph step");
  CLI11_PARSE(app, argc, argv);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "ep_bench: no CUDA device\n");
    return 2;
  }
  if (ep <= 0) ep = gpus;
  std::vector<Config> configs;
  for (const auto& r : routings)
    for (int64_t h : hiddens)
      for (int k : topks)
        for (int64_t t : tokens)
          for (const auto& plane : planes)
            for (const auto& chk : checks) {
              if (plane == "one-sided" && chk != "device") continue;
              configs.push_back(
                  {t, h, k, r == "skewed",
                   chk == "device" ? GeometryCheck::kDevice : GeometryCheck::kHostAllGather,
                   plane == "one-sided"});
            }
  auto id = NcclCollective::NewUniqueId();
  if (!id.ok()) {
    std::fprintf(stderr, "%s\n", id.status().ToString().c_str());
    return 1;
  }
  std::vector<Result> results(configs.size());
  std::vector<std::thread> threads;
  threads.reserve(ep);
  for (int r = 0; r < ep; ++r) {
    threads.emplace_back(RunRank, r, ep, *id, configs, num_experts, warmup, iters,
                         swiglu_intermediate, &results);
  }
  for (auto& t : threads) t.join();
  std::printf(
      "ep,check,routing,hidden,top_k,tokens,dispatch_p50_us,dispatch_p99_us,combine_p50_us,"
      "combine_p99_us,dispatch_logical_GBps,combine_logical_GBps,dispatch_remote_GBps,"
      "combine_remote_GBps,dispatch_nvlink_frac,combine_nvlink_frac,wire_bytes_per_token,"
      "graph_step_p50_us,graph_step_p99_us,swiglu_expert_grouped_p50_us,"
      "swiglu_expert_cublas_p50_us,swiglu_graph_step_p50_us,dispatch_host_call_p50_us,"
      "combine_host_call_p50_us,data_plane\n");
  for (size_t i = 0; i < configs.size(); ++i) {
    const Config& c = configs[i];
    const Result& r = results[i];
    const double dl = r.logical_dispatch_bytes / (r.dispatch_p50 * 1e3);
    const double cl = r.logical_combine_bytes / (r.combine_p50 * 1e3);
    const double dr = r.remote_dispatch_bytes / (r.dispatch_p50 * 1e3);
    const double cr = r.remote_combine_bytes / (r.combine_p50 * 1e3);
    std::printf(
        "%d,%s,%s,%ld,%d,%ld,%.1f,%.1f,%.1f,%.1f,%.2f,%.2f,%.2f,%.2f,%.3f,%.3f,%.0f,%.1f,%.1f,%.1f,"
        "%.1f,%.1f,%.1f,%.1f,%s\n",
        ep, c.check == GeometryCheck::kDevice ? "device" : "host", c.skewed ? "skewed" : "uniform",
        c.hidden, c.top_k, c.tokens, r.dispatch_p50, r.dispatch_p99, r.combine_p50, r.combine_p99,
        dl, cl, dr, cr, dr / 450.0, cr / 450.0, r.wire_bytes_per_token, r.graph_step_p50,
        r.graph_step_p99, r.swiglu_grouped_p50, r.swiglu_cublas_p50, r.swiglu_graph_step_p50,
        r.dispatch_host_p50, r.combine_host_p50, c.one_sided ? "one-sided" : "nccl");
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ep_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "ep_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
