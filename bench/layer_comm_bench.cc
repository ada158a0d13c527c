// layer_comm_bench: the before-MLP TP all-reduce + residual add + RMSNorm
// (DESIGN §3, kernels/rms_norm.cuh) fused against unfused on the GPUs of one
// host, one thread and one GPU per rank, NCCL unique id shared in process.
//
// For every token count T in --min-tokens, 2 * --min-tokens, ..., <=
// --max-tokens, each rank holds x [T, H] (its partial attention output) and
// the residual [T, H], fp32, and runs, --warmup then --iters times each,
// interleaved per T:
//   allreduce_only  the in-place NCCL all-reduce of x alone (the floor);
//   fused           AllReduceAddRmsNorm(kFused): all-reduce, one add+norm pass;
//   unfused         AllReduceAddRmsNorm(kUnfused): all-reduce, add kernel,
//                   norm kernel.
// Before each iteration x and the residual are reset from pristine copies
// (outside the timed region); each iteration is timed with CUDA events around
// the call on the group's stream. Reported per (T, impl): p50, p10 and p90 in
// microseconds of the slower rank's time per iteration, and for unfused the
// largest |unfused - fused| over the outputs of its last iteration (0 expected:
// both compute the same float operations in the same order).
// Output: CSV on stdout, one header line. Source: issue 4.

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "kernels/nccl_collective.h"
#include "kernels/rms_norm.cuh"

namespace moe_ep::kernels {
namespace {

enum class Impl { kAllReduceOnly, kFused, kUnfused };
constexpr Impl kImpls[] = {Impl::kAllReduceOnly, Impl::kFused, Impl::kUnfused};

const char* ImplName(Impl impl) {
  switch (impl) {
    case Impl::kAllReduceOnly:
      return "allreduce_only";
    case Impl::kFused:
      return "fused";
    case Impl::kUnfused:
      return "unfused";
  }
  return "unknown";
}

struct Options {
  int ranks = 2;
  int64_t hidden = 7168;
  int64_t min_tokens = 1;
  int64_t max_tokens = 2048;
  int iters = 100;
  int warmup = 10;
  float eps = 1e-6f;
};

// times[t][impl][iter] in microseconds, one per rank.
using Times = std::vector<std::vector<std::vector<float>>>;

bool Check(cudaError_t e, const char* what, int rank) {
  if (e == cudaSuccess) return true;
  std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, cudaGetErrorString(e));
  return false;
}

bool CheckStatus(const absl::Status& s, const char* what, int rank) {
  if (s.ok()) return true;
  std::fprintf(stderr, "rank %d: %s: %s\n", rank, what, s.ToString().c_str());
  return false;
}

// One rank's loop. Returns false on any error (printed).
bool RunRank(const Options& opt, const std::string& id, int rank,
             const std::vector<int64_t>& token_counts, Times& times, std::vector<float>& max_diff) {
  if (!Check(cudaSetDevice(rank), "cudaSetDevice", rank)) return false;
  auto group = NcclCollective::Create(id, rank, opt.ranks, rank, std::chrono::seconds(60));
  if (!CheckStatus(group.status(), "NcclCollective::Create", rank)) return false;
  NcclCollective& g = **group;
  const cudaStream_t stream = g.stream();
  const int64_t max_elems = opt.max_tokens * opt.hidden;
  const size_t bytes = static_cast<size_t>(max_elems) * sizeof(float);
  float *x = nullptr, *res = nullptr, *x0 = nullptr, *res0 = nullptr, *w = nullptr,
        *fused_out = nullptr;
  for (float** p : {&x, &res, &x0, &res0, &fused_out}) {
    if (!Check(cudaMalloc(p, bytes), "cudaMalloc", rank)) return false;
  }
  if (!Check(cudaMalloc(&w, opt.hidden * sizeof(float)), "cudaMalloc", rank)) return false;
  {
    std::mt19937_64 rng(17 + rank);
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    std::vector<float> host(max_elems);
    for (float& v : host) v = d(rng);
    if (!Check(cudaMemcpy(x0, host.data(), bytes, cudaMemcpyHostToDevice), "upload", rank))
      return false;
    std::mt19937_64 rng_r(99);  // the residual is the same on every rank
    for (float& v : host) v = d(rng_r);
    if (!Check(cudaMemcpy(res0, host.data(), bytes, cudaMemcpyHostToDevice), "upload", rank))
      return false;
    std::vector<float> weight(opt.hidden);
    for (float& v : weight) v = 0.5f + 0.5f * (d(rng_r) + 1.0f);
    if (!Check(cudaMemcpy(w, weight.data(), weight.size() * sizeof(float), cudaMemcpyHostToDevice),
               "upload", rank))
      return false;
  }
  // The uploads are ordered on the legacy stream; the group's is non-blocking.
  if (!Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", rank)) return false;
  const int total = opt.warmup + opt.iters;
  std::vector<cudaEvent_t> start(total), stop(total);
  for (int i = 0; i < total; ++i) {
    if (!Check(cudaEventCreate(&start[i]), "cudaEventCreate", rank) ||
        !Check(cudaEventCreate(&stop[i]), "cudaEventCreate", rank))
      return false;
  }
  times.assign(token_counts.size(), std::vector<std::vector<float>>(3));
  max_diff.assign(token_counts.size(), 0.0f);
  for (size_t ti = 0; ti < token_counts.size(); ++ti) {
    const int64_t rows = token_counts[ti];
    const int64_t elems = rows * opt.hidden;
    const size_t n_bytes = static_cast<size_t>(elems) * sizeof(float);
    for (int k = 0; k < 3; ++k) {
      const Impl impl = kImpls[k];
      for (int i = 0; i < total; ++i) {
        if (!Check(cudaMemcpyAsync(x, x0, n_bytes, cudaMemcpyDeviceToDevice, stream), "reset",
                   rank) ||
            !Check(cudaMemcpyAsync(res, res0, n_bytes, cudaMemcpyDeviceToDevice, stream), "reset",
                   rank) ||
            !Check(cudaEventRecord(start[i], stream), "cudaEventRecord", rank))
          return false;
        absl::Status s;
        if (impl == Impl::kAllReduceOnly) {
          s = g.AllReduceSum(x, elems);
        } else {
          s = AllReduceAddRmsNorm(
              g, impl == Impl::kFused ? AllReduceNormImpl::kFused : AllReduceNormImpl::kUnfused, x,
              res, w, rows, opt.hidden, opt.eps);
        }
        if (!CheckStatus(s, ImplName(impl), rank)) return false;
        if (!Check(cudaEventRecord(stop[i], stream), "cudaEventRecord", rank)) return false;
      }
      if (!CheckStatus(g.Synchronize(), "Synchronize", rank)) return false;
      for (int i = opt.warmup; i < total; ++i) {
        float ms = 0;
        if (!Check(cudaEventElapsedTime(&ms, start[i], stop[i]), "cudaEventElapsedTime", rank))
          return false;
        times[ti][k].push_back(ms * 1000.0f);
      }
      if (impl == Impl::kFused) {
        // Device-to-device cudaMemcpy does not wait on the host: sync before the
        // next impl's resets overwrite x on the group's stream.
        if (!Check(cudaMemcpy(fused_out, x, n_bytes, cudaMemcpyDeviceToDevice), "copy", rank) ||
            !Check(cudaDeviceSynchronize(), "cudaDeviceSynchronize", rank))
          return false;
      } else if (impl == Impl::kUnfused) {
        std::vector<float> a(elems), b(elems);
        if (!Check(cudaMemcpy(a.data(), fused_out, n_bytes, cudaMemcpyDeviceToHost), "download",
                   rank) ||
            !Check(cudaMemcpy(b.data(), x, n_bytes, cudaMemcpyDeviceToHost), "download", rank))
          return false;
        for (int64_t e = 0; e < elems; ++e) {
          max_diff[ti] = std::max(max_diff[ti], std::fabs(a[e] - b[e]));
        }
      }
    }
  }
  for (int i = 0; i < total; ++i) {
    cudaEventDestroy(start[i]);
    cudaEventDestroy(stop[i]);
  }
  for (float* p : {x, res, x0, res0, w, fused_out}) cudaFree(p);
  return true;
}

float Percentile(std::vector<float> v, double q) {
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(std::lround(q * (v.size() - 1)));
  return v[std::min(i, v.size() - 1)];
}

int Main(int argc, char** argv) {
  Options opt;
  CLI::App app{"fused vs unfused all-reduce + residual + RMSNorm on the GPUs of one host"};
  app.add_option("--ranks", opt.ranks, "GPUs (one rank each)")->check(CLI::Range(1, 8));
  app.add_option("--hidden", opt.hidden, "H, elements")->check(CLI::PositiveNumber);
  app.add_option("--min-tokens", opt.min_tokens, "first token count")->check(CLI::PositiveNumber);
  app.add_option("--max-tokens", opt.max_tokens, "last token count (doubling from the first)")
      ->check(CLI::PositiveNumber);
  app.add_option("--iters", opt.iters, "timed iterations per (tokens, impl)")
      ->check(CLI::PositiveNumber);
  app.add_option("--warmup", opt.warmup, "untimed iterations first")->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < opt.ranks) {
    std::fprintf(stderr, "needs %d CUDA devices, found %d\n", opt.ranks, devices);
    return 2;
  }
  std::vector<int64_t> token_counts;
  for (int64_t t = opt.min_tokens; t <= opt.max_tokens; t *= 2) token_counts.push_back(t);
  auto id = NcclCollective::NewUniqueId();
  if (!id.ok()) {
    std::fprintf(stderr, "%s\n", id.status().ToString().c_str());
    return 1;
  }
  std::vector<Times> times(opt.ranks);
  std::vector<std::vector<float>> diffs(opt.ranks);
  std::vector<char> ok(opt.ranks, 0);
  std::vector<std::thread> threads;
  threads.reserve(opt.ranks);
  for (int r = 0; r < opt.ranks; ++r) {
    threads.emplace_back(
        [&, r] { ok[r] = RunRank(opt, *id, r, token_counts, times[r], diffs[r]) ? 1 : 0; });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < opt.ranks; ++r) {
    if (!ok[r]) return 1;
  }
  std::printf("ranks,hidden,tokens,impl,p50_us,p10_us,p90_us,iters,max_abs_diff_vs_fused\n");
  for (size_t ti = 0; ti < token_counts.size(); ++ti) {
    for (int k = 0; k < 3; ++k) {
      // Per iteration, the slower rank's time.
      std::vector<float> slowest(times[0][ti][k].size(), 0.0f);
      for (int r = 0; r < opt.ranks; ++r) {
        for (size_t i = 0; i < slowest.size(); ++i) {
          slowest[i] = std::max(slowest[i], times[r][ti][k][i]);
        }
      }
      float diff = 0.0f;
      if (kImpls[k] == Impl::kUnfused) {
        for (int r = 0; r < opt.ranks; ++r) diff = std::max(diff, diffs[r][ti]);
      }
      std::printf("%d,%lld,%lld,%s,%.1f,%.1f,%.1f,%d,%s\n", opt.ranks,
                  static_cast<long long>(opt.hidden), static_cast<long long>(token_counts[ti]),
                  ImplName(kImpls[k]), Percentile(slowest, 0.5), Percentile(slowest, 0.1),
                  Percentile(slowest, 0.9), opt.iters,
                  kImpls[k] == Impl::kUnfused ? std::to_string(diff).c_str() : "");
    }
  }
  return 0;
}

}  // namespace
}  // namespace moe_ep::kernels

int main(int argc, char** argv) {
  try {
    return moe_ep::kernels::Main(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "layer_comm_bench: error: %s\n", e.what());
  } catch (...) {
    std::fprintf(stderr, "layer_comm_bench: error: an exception that is not a std::exception\n");
  }
  return 1;
}
