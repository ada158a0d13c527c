// floor_bench: the irreducible pieces of a data-plane phase on one GPU, so
// each phase of bench/onesided_bench.cc measured in the same call can be
// read as a ratio to its floor (issue 32 item 1, DESIGN §10).
//
// Pieces (CSV column "piece"; "ranks" threads of this process share the GPU,
// each on its own non-blocking stream, as the one-sided plane's thread-ranks
// do; every iteration starts after a barrier of the rank threads):
//   event_pair      two events recorded back to back (eager: their elapsed
//                   time; host: the two cudaEventRecord calls' wall time);
//   empty_graph     events around cudaGraphLaunch of a graph of one empty
//                   node, the stream idle before it;
//   kernel          one empty kernel, 1 block x 32 threads;
//   kernel64        one empty kernel, 64 blocks x 256 threads (a phase
//                   kernel's grid at SM budget 64);
//   step_graph      what ReplayForward does: events around the rewrite of
//                   the first kernel node's argument and cudaGraphLaunch of a
//                   graph of two dependent one-block kernels (the identity
//                   step's dispatch and combine kernels);
//   flag            one kernel: a release store of the rank's epoch into the
//                   peer's flag and an acquire spin on its own (ranks 1: its
//                   own flag, as the one-sided plane signals at EP 1);
//   copy_dispatch_T cudaMemcpyAsync device-to-device of the bytes one rank's
//                   dispatch moves at T tokens (token copies the route sends,
//                   x (2H + 8K)); at ranks 2 both ranks copy at once;
//   copy_combine_T  the same for the combine (rows received x 2H).
// The copies' bytes come from the routes of onesided_bench's inputs
// (bench::DistinctExpertIds, seed 100 + rank, uniform, contiguous placement),
// so they are the bytes of the phases they floor; "bytes" is the sum over
// ranks.
// Modes: graph — the piece captured between external event nodes (as
// onesided_bench times its graph phases), replayed; eager — an event on the
// idle stream, the host call(s), an event (as onesided_bench times its eager
// phases and graph_step); host — host wall time.
// Each row: p10 / p50 / p90 over --replays of the slower rank (the largest
// per-rank figure). Output: CSV on stdout.

#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "bench/ep_bench_inputs.h"
#include "bench/floor_kernels.h"
#include "core/expert_placement.h"
#include "core/percentile.h"
#include "core/routing.h"
#include "core/workspace.h"

namespace moe_ep::bench {
namespace {

#define FLOOR_CHECK(expr)                                                                  \
  do {                                                                                     \
    const cudaError_t e_ = (expr);                                                         \
    if (e_ != cudaSuccess) {                                                               \
      std::fprintf(stderr, "floor_bench: %s failed: %s\n", #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                        \
    }                                                                                      \
  } while (0)

struct Stats {
  double p10 = 0, p50 = 0, p90 = 0;
};

// Nearest-rank percentiles, as the Benchmark RPC reports them.
Stats Summarize(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return {core::Percentile(v, 10), core::Percentile(v, 50), core::Percentile(v, 90)};
}

Stats SlowerOf(const std::vector<Stats>& per_rank) {
  Stats s;
  for (const Stats& r : per_rank) {
    s.p10 = std::max(s.p10, r.p10);
    s.p50 = std::max(s.p50, r.p50);
    s.p90 = std::max(s.p90, r.p90);
  }
  return s;
}

double ElapsedUs(cudaEvent_t a, cudaEvent_t b) {
  float ms = 0;
  FLOOR_CHECK(cudaEventElapsedTime(&ms, a, b));
  return ms * 1000.0;
}

enum class Mode { kGraph, kEager, kHost };
const char* ModeName(Mode m) {
  return m == Mode::kGraph ? "graph" : m == Mode::kEager ? "eager" : "host";
}

// What one rank enqueues for one iteration of a piece, on its stream.
using Enqueue = std::function<cudaError_t(int rank, cudaStream_t stream)>;

// One rank's samples of `enqueue` in `mode` (see the file comment).
std::vector<double> RankSamples(int rank, Mode mode, const Enqueue& enqueue, std::barrier<>& bar,
                                int warmup, int replays) {
  FLOOR_CHECK(cudaSetDevice(0));
  cudaStream_t s;
  FLOOR_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaEvent_t e0, e1;
  FLOOR_CHECK(cudaEventCreate(&e0));
  FLOOR_CHECK(cudaEventCreate(&e1));
  cudaGraphExec_t exec = nullptr;
  if (mode == Mode::kGraph) {
    cudaGraph_t graph;
    FLOOR_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    FLOOR_CHECK(cudaEventRecordWithFlags(e0, s, cudaEventRecordExternal));
    FLOOR_CHECK(enqueue(rank, s));
    FLOOR_CHECK(cudaEventRecordWithFlags(e1, s, cudaEventRecordExternal));
    FLOOR_CHECK(cudaStreamEndCapture(s, &graph));
    FLOOR_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    FLOOR_CHECK(cudaGraphDestroy(graph));
  }
  std::vector<double> us;
  for (int it = 0; it < warmup + replays; ++it) {
    bar.arrive_and_wait();
    double sample = 0;
    if (mode == Mode::kGraph) {
      FLOOR_CHECK(cudaGraphLaunch(exec, s));
    } else if (mode == Mode::kEager) {
      FLOOR_CHECK(cudaEventRecord(e0, s));
      FLOOR_CHECK(enqueue(rank, s));
      FLOOR_CHECK(cudaEventRecord(e1, s));
    } else {
      const auto t0 = std::chrono::steady_clock::now();
      FLOOR_CHECK(enqueue(rank, s));
      sample =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
    }
    FLOOR_CHECK(cudaStreamSynchronize(s));
    if (mode != Mode::kHost) sample = ElapsedUs(e0, e1);
    if (it >= warmup) us.push_back(sample);
  }
  if (exec != nullptr) FLOOR_CHECK(cudaGraphExecDestroy(exec));
  FLOOR_CHECK(cudaEventDestroy(e0));
  FLOOR_CHECK(cudaEventDestroy(e1));
  FLOOR_CHECK(cudaStreamDestroy(s));
  return us;
}

Stats Measure(int ranks, Mode mode, const Enqueue& enqueue, int warmup, int replays) {
  std::vector<Stats> per_rank(ranks);
  std::barrier<> bar(ranks);
  std::vector<std::thread> threads;
  threads.reserve(ranks);
  for (int r = 0; r < ranks; ++r) {
    threads.emplace_back(
        [&, r] { per_rank[r] = Summarize(RankSamples(r, mode, enqueue, bar, warmup, replays)); });
  }
  for (std::thread& t : threads) t.join();
  return SlowerOf(per_rank);
}

void PrintRow(const std::string& piece, int ranks, Mode mode, int64_t bytes, const Stats& s,
              int replays) {
  std::printf("%s,%d,%s,%ld,%.2f,%.2f,%.2f,%d\n", piece.c_str(), ranks, ModeName(mode),
              static_cast<long>(bytes), s.p10, s.p50, s.p90, replays);
  std::fflush(stdout);
}

// Per rank, the bytes its dispatch and its combine move at `tokens` tokens
// and `ep` ranks, from onesided_bench's routes.
struct PhaseBytes {
  std::vector<int64_t> dispatch, combine;
};

PhaseBytes BytesOfPhases(int64_t tokens, int ep, int64_t hidden, int top_k, int num_experts) {
  const core::ExpertPlacement placement = *core::ExpertPlacement::Contiguous(num_experts, ep);
  const int64_t per_dispatch =
      *core::DispatchBytesPerToken(core::DispatchDType::kBF16, hidden, top_k);
  PhaseBytes b{std::vector<int64_t>(ep, 0), std::vector<int64_t>(ep, 0)};
  for (int r = 0; r < ep; ++r) {
    const std::vector<int32_t> ids = DistinctExpertIds(100 + r, tokens, top_k, num_experts, false);
    const core::DispatchRoute route = *core::ComputeDispatchRoute(ids, tokens, top_k, placement);
    b.dispatch[r] = static_cast<int64_t>(route.dest_rank.size()) * per_dispatch;
    // Rank d pushes back every row it received: rows of r's tokens sent to d.
    for (int d = 0; d < ep; ++d)
      b.combine[d] += route.send_counts[d] * core::CombineBytesPerToken(hidden);
  }
  return b;
}

// Device-to-device copies of `bytes[rank]` per rank, buffers owned here.
class RankCopies {
 public:
  explicit RankCopies(const std::vector<int64_t>& bytes) : bytes_(bytes) {
    for (const int64_t n : bytes_) {
      void* src = nullptr;
      void* dst = nullptr;
      FLOOR_CHECK(cudaMalloc(&src, std::max<int64_t>(n, 16)));
      FLOOR_CHECK(cudaMalloc(&dst, std::max<int64_t>(n, 16)));
      FLOOR_CHECK(cudaMemset(src, 1, std::max<int64_t>(n, 16)));
      src_.push_back(src);
      dst_.push_back(dst);
    }
  }
  ~RankCopies() {
    for (void* p : src_) cudaFree(p);
    for (void* p : dst_) cudaFree(p);
  }
  RankCopies(const RankCopies&) = delete;
  RankCopies& operator=(const RankCopies&) = delete;
  Enqueue Copy() const {
    return [this](int r, cudaStream_t s) {
      return cudaMemcpyAsync(dst_[r], src_[r], bytes_[r], cudaMemcpyDeviceToDevice, s);
    };
  }
  int64_t Total() const {
    int64_t t = 0;
    for (const int64_t n : bytes_) t += n;
    return t;
  }

 private:
  std::vector<int64_t> bytes_;
  std::vector<void*> src_, dst_;
};

// Flag words of two ranks: [epoch 0, epoch 1, flag 0, flag 1], a line each.
class Flags {
 public:
  Flags() {
    FLOOR_CHECK(cudaMalloc(&words_, 4 * kLine * sizeof(uint64_t)));
    FLOOR_CHECK(cudaMemset(words_, 0, 4 * kLine * sizeof(uint64_t)));
  }
  ~Flags() { cudaFree(words_); }
  Flags(const Flags&) = delete;
  Flags& operator=(const Flags&) = delete;
  // Rank r's slots among `ranks` (1: it signals itself).
  FlagSlots Slots(int r, int ranks) const {
    uint64_t* own = words_ + (2 + r) * kLine;
    uint64_t* peer = ranks == 1 ? own : words_ + (2 + (1 - r)) * kLine;
    return {words_ + r * kLine, own, peer};
  }

 private:
  static constexpr int kLine = 16;  // 128 bytes
  uint64_t* words_ = nullptr;
};

// A graph of one empty node, and the two-kernel step graph with the handle
// of its first kernel node (ReplayForward rewrites that node's argument).
struct Graphs {
  cudaGraphExec_t empty = nullptr, step = nullptr;
  cudaGraph_t step_graph = nullptr;  // kept: step_first is its node
  cudaGraphNode_t step_first = nullptr;
  cudaKernelNodeParams step_params{};

  Graphs() {
    cudaGraph_t g;
    FLOOR_CHECK(cudaGraphCreate(&g, 0));
    cudaGraphNode_t node;
    FLOOR_CHECK(cudaGraphAddEmptyNode(&node, g, nullptr, 0));
    FLOOR_CHECK(cudaGraphInstantiate(&empty, g, 0));
    FLOOR_CHECK(cudaGraphDestroy(g));

    cudaStream_t s;
    FLOOR_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    FLOOR_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    FLOOR_CHECK(LaunchStepNode(s, 1));
    FLOOR_CHECK(LaunchStepNode(s, 1));
    FLOOR_CHECK(cudaStreamEndCapture(s, &step_graph));
    FLOOR_CHECK(cudaStreamDestroy(s));
    size_t n = 0;
    FLOOR_CHECK(cudaGraphGetRootNodes(step_graph, nullptr, &n));
    if (n != 1) {
      std::fprintf(stderr, "floor_bench: the step graph has %zu roots, not 1\n", n);
      std::exit(1);
    }
    FLOOR_CHECK(cudaGraphGetRootNodes(step_graph, &step_first, &n));
    FLOOR_CHECK(cudaGraphKernelNodeGetParams(step_first, &step_params));
    FLOOR_CHECK(cudaGraphInstantiate(&step, step_graph, 0));
  }
  ~Graphs() {
    cudaGraphExecDestroy(empty);
    cudaGraphExecDestroy(step);
    cudaGraphDestroy(step_graph);
  }
  Graphs(const Graphs&) = delete;
  Graphs& operator=(const Graphs&) = delete;

  cudaError_t ReplayStep(cudaStream_t s, int64_t tokens) const {
    void* args[] = {&tokens};
    cudaKernelNodeParams p = step_params;
    p.kernelParams = args;
    p.extra = nullptr;
    const cudaError_t e = cudaGraphExecKernelNodeSetParams(step, step_first, &p);
    return e != cudaSuccess ? e : cudaGraphLaunch(step, s);
  }
};

int Main(int argc, char** argv) {
  CLI::App app{"floor_bench: the irreducible pieces of a data-plane phase on one GPU"};
  std::vector<int64_t> tokens = {128, 4096};
  int64_t hidden = 7168;
  int top_k = 8, num_experts = 256, warmup = 20, replays = 1000;
  app.add_option("--tokens", tokens, "tokens per rank whose dispatch / combine bytes are copied");
  app.add_option("--hidden", hidden);
  app.add_option("--topk", top_k);
  app.add_option("--experts", num_experts);
  app.add_option("--warmup", warmup);
  app.add_option("--replays", replays, "samples per row (>= 300 for the issue's figures)")
      ->check(CLI::Range(1, 1 << 24));
  CLI11_PARSE(app, argc, argv);
  int gpus = 0;
  if (cudaGetDeviceCount(&gpus) != cudaSuccess || gpus == 0) {
    std::fprintf(stderr, "floor_bench: no CUDA device\n");
    return 2;
  }
  FLOOR_CHECK(cudaSetDevice(0));
  cudaDeviceProp prop;
  FLOOR_CHECK(cudaGetDeviceProperties(&prop, 0));
  std::fprintf(stderr, "floor_bench: %s, %d SMs\n", prop.name, prop.multiProcessorCount);

  std::printf("piece,ranks,mode,bytes,p10_us,p50_us,p90_us,samples\n");
  const Enqueue nothing = [](int, cudaStream_t) { return cudaSuccess; };
  PrintRow("event_pair", 1, Mode::kEager, 0, Measure(1, Mode::kEager, nothing, warmup, replays),
           replays);
  cudaEvent_t a, b;
  FLOOR_CHECK(cudaEventCreate(&a));
  FLOOR_CHECK(cudaEventCreate(&b));
  const Enqueue record_pair = [&](int, cudaStream_t s) {
    const cudaError_t e = cudaEventRecord(a, s);
    return e != cudaSuccess ? e : cudaEventRecord(b, s);
  };
  PrintRow("event_pair", 1, Mode::kHost, 0, Measure(1, Mode::kHost, record_pair, warmup, replays),
           replays);

  const Graphs graphs;
  const Enqueue empty_graph = [&](int, cudaStream_t s) { return cudaGraphLaunch(graphs.empty, s); };
  PrintRow("empty_graph", 1, Mode::kEager, 0,
           Measure(1, Mode::kEager, empty_graph, warmup, replays), replays);
  const Enqueue step = [&](int, cudaStream_t s) { return graphs.ReplayStep(s, 128); };
  PrintRow("step_graph", 1, Mode::kEager, 0, Measure(1, Mode::kEager, step, warmup, replays),
           replays);

  const Enqueue kernel = [](int, cudaStream_t s) { return LaunchEmpty(s, 1, 32); };
  const Enqueue kernel64 = [](int, cudaStream_t s) { return LaunchEmpty(s, 64, 256); };
  for (const Mode mode : {Mode::kGraph, Mode::kEager}) {
    PrintRow("kernel", 1, mode, 0, Measure(1, mode, kernel, warmup, replays), replays);
    PrintRow("kernel64", 1, mode, 0, Measure(1, mode, kernel64, warmup, replays), replays);
    for (const int ranks : {1, 2}) {
      const Flags flags;  // epochs from 0 on every rank: they must agree
      const Enqueue flag = [&, ranks](int r, cudaStream_t s) {
        return LaunchFlagExchange(s, flags.Slots(r, ranks));
      };
      PrintRow("flag", ranks, mode, 0, Measure(ranks, mode, flag, warmup, replays), replays);
    }
  }

  for (const int64_t t : tokens) {
    for (const int ep : {1, 2}) {
      const PhaseBytes bytes = BytesOfPhases(t, ep, hidden, top_k, num_experts);
      for (const bool dispatch : {true, false}) {
        const RankCopies copies(dispatch ? bytes.dispatch : bytes.combine);
        const std::string piece =
            std::string(dispatch ? "copy_dispatch_" : "copy_combine_") + std::to_string(t);
        PrintRow(piece, ep, Mode::kGraph, copies.Total(),
                 Measure(ep, Mode::kGraph, copies.Copy(), warmup, replays), replays);
      }
    }
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return 0;
}

}  // namespace
}  // namespace moe_ep::bench

int main(int argc, char** argv) {
  try {
    return moe_ep::bench::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "floor_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "floor_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
