#pragma once

// What the expert-compute benches share (bench/expert_bench.cc,
// bench/mxfp4_expert_bench.cc): exit-on-error checks, event timing, the
// device copy rate and the received rows of a seeded step. Bench code only:
// errors print and exit.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "core/bf16.h"

#define BENCH_CHECK(expr)                                                             \
  do {                                                                                \
    const absl::Status& s_ = (expr);                                                  \
    if (!s_.ok()) {                                                                   \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.ToString().c_str()); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
#define CUDA_CHECK(expr)                                                                          \
  do {                                                                                            \
    cudaError_t e_ = (expr);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

namespace moe_ep::bench {

// The median of `v` (the lower one of an even count).
inline double P50(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[(v.size() - 1) / 2];
}

// Times `fn` (enqueues on `stream`) with events: p50 of `iters` calls after
// `warmup`, in µs.
template <typename Fn>
double TimeP50(cudaStream_t stream, int warmup, int iters, Fn fn) {
  cudaEvent_t a;
  cudaEvent_t b;
  CUDA_CHECK(cudaEventCreate(&a));
  CUDA_CHECK(cudaEventCreate(&b));
  std::vector<double> us;
  for (int it = 0; it < warmup + iters; ++it) {
    CUDA_CHECK(cudaEventRecord(a, stream));
    fn();
    CUDA_CHECK(cudaEventRecord(b, stream));
    CUDA_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, a, b));
    if (it >= warmup) us.push_back(ms * 1000.0);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return P50(us);
}

// The device-to-device copy rate (read + write) of 2 GiB, TB/s.
inline double CopyTbps(cudaStream_t stream) {
  const size_t bytes = size_t{2} << 30;
  void* src = nullptr;
  void* dst = nullptr;
  CUDA_CHECK(cudaMalloc(&src, bytes));
  CUDA_CHECK(cudaMalloc(&dst, bytes));
  CUDA_CHECK(cudaMemset(src, 1, bytes));
  const double us = TimeP50(stream, 3, 20, [&] {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream));
  });
  cudaFree(src);
  cudaFree(dst);
  return 2.0 * static_cast<double>(bytes) / (us * 1e-6) / 1e12;
}

// The received rows of a step of `tokens` tokens, [tokens, row_bytes]:
// hidden ~ U(-1, 1) bf16 | top_k distinct ids of num_experts | weights ~
// U(0, 1). `hit` gets every id chosen.
inline std::vector<uint8_t> MakeRecvRows(std::mt19937_64& rng, int64_t tokens, int64_t hidden,
                                         int top_k, int num_experts, int64_t row_bytes,
                                         std::set<int>* hit) {
  std::uniform_real_distribution<float> v(-1.0f, 1.0f);
  std::vector<uint8_t> host(tokens * row_bytes);
  std::vector<int> perm(num_experts);
  for (int64_t t = 0; t < tokens; ++t) {
    uint8_t* row = host.data() + t * row_bytes;
    auto* h = reinterpret_cast<uint16_t*>(row);
    for (int64_t j = 0; j < hidden; ++j) h[j] = core::FloatToBf16(v(rng));
    auto* ids = reinterpret_cast<int32_t*>(row + 2 * hidden);
    auto* w = reinterpret_cast<float*>(row + 2 * hidden + 4 * top_k);
    for (int e = 0; e < num_experts; ++e) perm[e] = e;
    for (int k = 0; k < top_k; ++k) {
      std::uniform_int_distribution<int> pick(k, num_experts - 1);
      std::swap(perm[k], perm[pick(rng)]);
      ids[k] = perm[k];
      w[k] = 0.5f * (v(rng) + 1.0f);
      hit->insert(ids[k]);
    }
  }
  return host;
}

}  // namespace moe_ep::bench
