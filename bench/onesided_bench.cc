// onesided_bench: the one-sided data plane (kernels/onesided/) side by side
// with the NCCL plane (kernels/gpu_ep_dispatcher.h) in one run on one GPU,
// identity experts, so the figures are the data planes' alone (DESIGN §10,
// §13; issue 15 item 7).
//
// Configurations, for each --tokens value T (per rank, R = T):
//   nccl      EP 1 (NCCL refuses two ranks on one GPU), geometry check on
//             the device (GeometryCheck::kDevice, the capturable mode);
//   onesided  EP 1, and EP 2 as two threads of this process sharing the GPU
//             (ThreadWindowGroup windows, one CUDA context, kernels
//             co-resident, each rank's communication kernels bounded by
//             --sm-budget blocks), for each --path (sm: SM stores; ce: the
//             copy-engine bulk path; auto: by --ce-min-tokens; issue 15
//             item 3). The CSV's "path" column is the path the step took
//             (OneSidedDispatcher::last_path), "nccl" for the NCCL plane.
//             With ce, identity experts are a kernel of their own (in the
//             ComputeExperts phase, as on the NCCL plane), so graph_combine
//             is copies + reduction.
// Per rank and configuration:
//   graph_dispatch / graph_combine: the phases inside one CUDA graph
//     (Dispatch | ComputeExperts | Combine captured with external event
//     nodes between them), replayed --graph-iters times;
//   graph_step: the whole step replayed through ReplayForward (T updated per
//     replay; host update + launch included, the stream idle before it);
//   eager_dispatch / eager_combine: from the host call to completion — an
//     event recorded on the idle stream just before the call and one just
//     after, so the elapsed time covers the host enqueue and the GPU work;
//   enqueue_dispatch / enqueue_combine: the host call's own wall time.
// Every iteration starts after a barrier of the rank threads. The row is the
// p50 (and p99 of the step) of the slower rank: the largest per-rank figure.
// Source: DESIGN §10, §13; issue 15.

#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/ep_bench_inputs.h"
#include "core/expert_placement.h"
#include "kernels/gpu_ep_dispatcher.h"
#include "kernels/nccl_collective.h"
#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/onesided/peer_window.h"

namespace moe_ep::kernels {
namespace {

struct Times {
  double graph_dispatch = 0, graph_combine = 0, graph_phases = 0, graph_step = 0,
         graph_step_p99 = 0, eager_dispatch = 0, eager_combine = 0, enqueue_dispatch = 0,
         enqueue_combine = 0;
  std::string path = "nccl";  // the path the step took
};

Times SlowerOf(const std::vector<Times>& v) {
  Times t;
  for (const Times& x : v) {
    t.graph_dispatch = std::max(t.graph_dispatch, x.graph_dispatch);
    t.graph_combine = std::max(t.graph_combine, x.graph_combine);
    t.graph_phases = std::max(t.graph_phases, x.graph_phases);
    t.graph_step = std::max(t.graph_step, x.graph_step);
    t.graph_step_p99 = std::max(t.graph_step_p99, x.graph_step_p99);
    t.eager_dispatch = std::max(t.eager_dispatch, x.eager_dispatch);
    t.eager_combine = std::max(t.eager_combine, x.eager_combine);
    t.enqueue_dispatch = std::max(t.enqueue_dispatch, x.enqueue_dispatch);
    t.enqueue_combine = std::max(t.enqueue_combine, x.enqueue_combine);
    t.path = x.path;
  }
  return t;
}

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
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
#define CUDA_CHECK(expr)                                                                     \
  do {                                                                                       \
    cudaError_t e_ = (expr);                                                                 \
    if (e_ != cudaSuccess) {                                                                 \
      std::fprintf(stderr, "rank %d: %s failed: %s\n", rank, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                          \
    }                                                                                        \
  } while (0)

using bench::DeviceStepInputs;
using Inputs = DeviceStepInputs;

using Clock = std::chrono::steady_clock;
double UsSince(Clock::time_point t0) {
  return std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
}
double Elapsed(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  cudaEventElapsedTime(&ms, a, b);
  return ms * 1000.0;
}

// The measurement loop of one rank over dispatcher D (GpuEpDispatcher or
// OneSidedDispatcher: the same phase API).
template <typename D>
Times Measure(D& d, int rank, std::barrier<>& bar, const Inputs& in, const DeviceExpertSet& experts,
              int64_t tokens, int warmup, int iters, int graph_iters) {
  Times out;
  cudaStream_t s = d.stream();
  cudaEvent_t ev[4];
  for (auto& e : ev) CUDA_CHECK(cudaEventCreate(&e));
  BENCH_CHECK(d.CommitGeometry(1, tokens, tokens));
  std::vector<double> ed, ec, qd, qc;
  for (int it = 0; it < warmup + iters; ++it) {
    bar.arrive_and_wait();
    CUDA_CHECK(cudaEventRecord(ev[0], s));
    Clock::time_point t0 = Clock::now();
    BENCH_CHECK(d.Dispatch(in.hidden, in.ids, in.weights, tokens));
    const double dq = UsSince(t0);
    CUDA_CHECK(cudaEventRecord(ev[1], s));
    BENCH_CHECK(d.ComputeExperts(experts));
    CUDA_CHECK(cudaStreamSynchronize(s));
    bar.arrive_and_wait();
    CUDA_CHECK(cudaEventRecord(ev[2], s));
    t0 = Clock::now();
    BENCH_CHECK(d.Combine(in.out));
    const double cq = UsSince(t0);
    CUDA_CHECK(cudaEventRecord(ev[3], s));
    BENCH_CHECK(d.CheckStep());
    if (it >= warmup) {
      ed.push_back(Elapsed(ev[0], ev[1]));
      ec.push_back(Elapsed(ev[2], ev[3]));
      qd.push_back(dq);
      qc.push_back(cq);
    }
  }
  out.eager_dispatch = Percentile(ed, 0.5);
  out.eager_combine = Percentile(ec, 0.5);
  out.enqueue_dispatch = Percentile(qd, 0.5);
  out.enqueue_combine = Percentile(qc, 0.5);

  // The phases inside one graph, with external event nodes between them.
  cudaEvent_t g[4];
  for (auto& e : g) CUDA_CHECK(cudaEventCreate(&e));
  CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
  CUDA_CHECK(cudaEventRecordWithFlags(g[0], s, cudaEventRecordExternal));
  BENCH_CHECK(d.Dispatch(in.hidden, in.ids, in.weights, tokens));
  CUDA_CHECK(cudaEventRecordWithFlags(g[1], s, cudaEventRecordExternal));
  BENCH_CHECK(d.ComputeExperts(experts));
  CUDA_CHECK(cudaEventRecordWithFlags(g[2], s, cudaEventRecordExternal));
  BENCH_CHECK(d.Combine(in.out));
  CUDA_CHECK(cudaEventRecordWithFlags(g[3], s, cudaEventRecordExternal));
  cudaGraph_t graph = nullptr;
  CUDA_CHECK(cudaStreamEndCapture(s, &graph));
  cudaGraphExec_t exec = nullptr;
  CUDA_CHECK(cudaGraphInstantiate(&exec, graph, 0));
  std::vector<double> gd, gc, gp;
  for (int it = 0; it < warmup + graph_iters; ++it) {
    bar.arrive_and_wait();
    CUDA_CHECK(cudaGraphLaunch(exec, s));
    BENCH_CHECK(d.CheckStep());
    if (it >= warmup) {
      gd.push_back(Elapsed(g[0], g[1]));
      gc.push_back(Elapsed(g[2], g[3]));
      gp.push_back(Elapsed(g[0], g[3]));
    }
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  out.graph_dispatch = Percentile(gd, 0.5);
  out.graph_combine = Percentile(gc, 0.5);
  out.graph_phases = Percentile(gp, 0.5);

  // The whole step through the dispatcher's own graph (ReplayForward).
  BENCH_CHECK(d.CaptureForward(tokens, in.hidden, in.ids, in.weights, experts, in.out));
  std::vector<double> gs;
  for (int it = 0; it < warmup + graph_iters; ++it) {
    bar.arrive_and_wait();
    CUDA_CHECK(cudaEventRecord(ev[0], s));
    BENCH_CHECK(d.ReplayForward(tokens, 1, tokens));
    CUDA_CHECK(cudaEventRecord(ev[1], s));
    BENCH_CHECK(d.CheckStep());
    if (it >= warmup) gs.push_back(Elapsed(ev[0], ev[1]));
  }
  out.graph_step = Percentile(gs, 0.5);
  out.graph_step_p99 = Percentile(gs, 0.99);
  if constexpr (std::is_same_v<D, onesided::OneSidedDispatcher>) {
    out.path = onesided::OsPathName(d.last_path());
  }
  for (auto& e : ev) cudaEventDestroy(e);
  for (auto& e : g) cudaEventDestroy(e);
  return out;
}

struct Config {
  std::string plane;  // "nccl" or "onesided"
  int ep;
  int64_t tokens;
  int sm_budget;
  onesided::OsPathChoice path = onesided::OsPathChoice::kAuto;
};

Times RunConfig(const Config& c, int64_t hidden, int top_k, int num_experts, int warmup, int iters,
                int graph_iters, int64_t ce_min_tokens) {
  std::vector<Times> per_rank(c.ep);
  std::barrier<> bar(c.ep);
  auto placement = *core::ExpertPlacement::Contiguous(num_experts, c.ep);
  core::EpDispatcherOptions ep;
  ep.workspace = {c.ep, c.tokens, hidden, top_k, core::DispatchDType::kBF16};
  ep.num_experts = num_experts;
  std::shared_ptr<onesided::ThreadWindowGroup> group;
  std::string id;
  if (c.plane == "onesided") {
    group = *onesided::ThreadWindowGroup::Create(c.ep);
  } else {
    id = *NcclCollective::NewUniqueId();
  }
  std::vector<std::thread> threads;
  threads.reserve(c.ep);
  for (int rank = 0; rank < c.ep; ++rank) {
    threads.emplace_back([&, rank] {
      CUDA_CHECK(cudaSetDevice(0));
      auto experts = *DeviceExpertSet::Upload(core::ExpertSet::Identity(
          placement.FirstExpert(rank), placement.NumLocalExperts(rank), hidden));
      absl::StatusOr<Inputs> made =
          bench::MakeStepInputs(100 + rank, c.tokens, hidden, top_k, num_experts, false);
      BENCH_CHECK(made.status());
      Inputs in = *made;
      if (c.plane == "onesided") {
        auto bytes = onesided::OneSidedDispatcher::WindowBytes(ep);
        BENCH_CHECK(bytes.status());
        auto windows = group->Join(rank, 0, *bytes, absl::Seconds(60));
        BENCH_CHECK(windows.status());
        onesided::OneSidedDispatcherOptions o;
        o.dispatcher = ep;
        o.sm_budget = c.sm_budget;
        o.timeout = absl::Seconds(10);
        o.path = c.path;
        o.ce_min_tokens = ce_min_tokens;
        auto d = onesided::OneSidedDispatcher::Create(windows->get(), o, 0);
        BENCH_CHECK(d.status());
        per_rank[rank] =
            Measure(**d, rank, bar, in, *experts, c.tokens, warmup, iters, graph_iters);
        bar.arrive_and_wait();  // no rank frees its state while a peer is mid-step
      } else {
        auto coll = NcclCollective::Create(id, rank, c.ep, 0, std::chrono::seconds(60));
        BENCH_CHECK(coll.status());
        GpuEpDispatcherOptions o;
        o.dispatcher = ep;
        o.geometry_check = GeometryCheck::kDevice;
        auto d = GpuEpDispatcher::Create(coll->get(), o, 0);
        BENCH_CHECK(d.status());
        per_rank[rank] =
            Measure(**d, rank, bar, in, *experts, c.tokens, warmup, iters, graph_iters);
      }
      bench::FreeStepInputs(in);
    });
  }
  for (auto& t : threads) t.join();
  return SlowerOf(per_rank);
}

}  // namespace
}  // namespace moe_ep::kernels

namespace {

// The program; main() below only adds the last-resort catch.
int Main(int argc, char** argv) {
  using namespace moe_ep::kernels;
  CLI::App app{"onesided_bench: one-sided vs NCCL data plane on one GPU"};
  std::vector<int64_t> tokens = {1, 128, 4096};
  std::vector<int> sm_budgets = {16};
  int64_t hidden = 7168;
  int top_k = 8, num_experts = 256, warmup = 20, iters = 300, graph_iters = 1000;
  bool skip_nccl = false;
  std::vector<std::string> paths = {"sm", "ce"};
  int64_t ce_min_tokens = onesided::OneSidedDispatcherOptions::kDefaultCeMinTokens;
  app.add_option("--tokens", tokens, "tokens per rank (R = tokens)");
  app.add_option("--sm-budget", sm_budgets, "blocks of each one-sided communication kernel");
  app.add_option("--hidden", hidden);
  app.add_option("--topk", top_k);
  app.add_option("--experts", num_experts);
  app.add_option("--warmup", warmup);
  app.add_option("--iters", iters, "eager steps");
  app.add_option("--graph-iters", graph_iters, "graph replays (>= 1000 for the issue's figures)");
  app.add_flag("--skip-nccl", skip_nccl, "only the one-sided plane");
  app.add_option("--path", paths, "one-sided paths: sm, ce, auto (each a row)");
  app.add_option("--ce-min-tokens", ce_min_tokens, "auto: R from which the copy engine moves rows");
  CLI11_PARSE(app, argc, argv);
  std::vector<onesided::OsPathChoice> choices;
  for (const std::string& name : paths) {
    absl::StatusOr<onesided::OsPathChoice> c = onesided::ParseOsPathChoice(name);
    if (!c.ok()) {
      std::fprintf(stderr, "onesided_bench: --path: %s\n", c.status().ToString().c_str());
      return 2;
    }
    choices.push_back(*c);
  }
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "onesided_bench: no CUDA device\n");
    return 2;
  }
  std::printf(
      "plane,ep,tokens,sm_budget,path,dispatch_path,graph_dispatch_p50_us,graph_combine_p50_us,"
      "graph_phases_step_p50_us,graph_step_p50_us,graph_step_p99_us,eager_dispatch_p50_us,"
      "eager_combine_p50_us,enqueue_dispatch_p50_us,enqueue_combine_p50_us,graph_replays,"
      "eager_steps\n");
  for (int64_t t : tokens) {
    std::vector<Config> configs;
    if (!skip_nccl) configs.push_back({"nccl", 1, t, 0});
    for (int sm : sm_budgets) {
      for (const onesided::OsPathChoice path : choices) {
        configs.push_back({"onesided", 1, t, sm, path});
        configs.push_back({"onesided", 2, t, sm, path});
      }
    }
    for (const Config& c : configs) {
      const Times r =
          RunConfig(c, hidden, top_k, num_experts, warmup, iters, graph_iters, ce_min_tokens);
      const char* kernels = c.plane == "nccl"                    ? "nccl-grouped-send-recv"
                            : r.path == "ce"                     ? "route+copy+send"
                            : onesided::OsDispatchFused(t, c.ep) ? "fused-route-send"
                                                                 : "route+send";
      std::printf("%s,%d,%ld,%d,%s,%s,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%.2f,%d,%d\n",
                  c.plane.c_str(), c.ep, t, c.sm_budget, r.path.c_str(), kernels, r.graph_dispatch,
                  r.graph_combine, r.graph_phases, r.graph_step, r.graph_step_p99, r.eager_dispatch,
                  r.eager_combine, r.enqueue_dispatch, r.enqueue_combine, graph_iters, iters);
      std::fflush(stdout);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "onesided_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "onesided_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
