#pragma once

// The step inputs bench/ep_bench.cc and bench/onesided_bench.cc share
// (review duplicate D8): K distinct experts per token (uniform, or skewed
// with probability proportional to 1 / (e + 1) so low ids are hot), hidden
// rows of 1.0 (bf16 0x3f80) and weights 1 / K, uploaded to device buffers
// with room for an output of the same shape. Header-only (both benches are
// single files); host code.

#include <cuda_runtime.h>

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace moe_ep::bench {

// [tokens, top_k] distinct expert ids from `seed`; deterministic.
inline std::vector<int32_t> DistinctExpertIds(uint64_t seed, int64_t tokens, int top_k,
                                              int num_experts, bool skewed) {
  std::mt19937_64 rng(seed);
  std::vector<double> p(num_experts);
  for (int e = 0; e < num_experts; ++e) p[e] = skewed ? 1.0 / (e + 1) : 1.0;
  std::discrete_distribution<int> pick(p.begin(), p.end());
  std::vector<int32_t> ids(tokens * top_k);
  for (int64_t t = 0; t < tokens; ++t) {
    for (int k = 0; k < top_k; ++k) {
      int32_t e;
      bool dup;
      do {
        e = pick(rng);
        dup = false;
        for (int j = 0; j < k; ++j) dup = dup || ids[t * top_k + j] == e;
      } while (dup);
      ids[t * top_k + k] = e;
    }
  }
  return ids;
}

// Device buffers of one rank's step: hidden [T, H] bf16, ids [T, K],
// weights [T, K], out [T, H] bf16 (each with 16 spare bytes, so T = 0 still
// gets a valid aligned pointer). Free with FreeStepInputs.
struct DeviceStepInputs {
  uint16_t* hidden = nullptr;
  int32_t* ids = nullptr;
  float* weights = nullptr;
  uint16_t* out = nullptr;
};

inline void FreeStepInputs(DeviceStepInputs& in) {
  cudaFree(in.hidden);
  cudaFree(in.out);
  cudaFree(in.ids);
  cudaFree(in.weights);
  in = DeviceStepInputs{};
}

// Errors: kInternal naming the failed CUDA call (nothing is left allocated).
inline absl::StatusOr<DeviceStepInputs> MakeStepInputs(uint64_t seed, int64_t tokens,
                                                       int64_t hidden, int top_k, int num_experts,
                                                       bool skewed) {
  const std::vector<int32_t> ids = DistinctExpertIds(seed, tokens, top_k, num_experts, skewed);
  const std::vector<uint16_t> h(tokens * hidden, 0x3f80);  // 1.0
  const std::vector<float> w(tokens * top_k, 1.0f / top_k);
  DeviceStepInputs in;
  auto check = [&](cudaError_t e, const char* what) -> absl::Status {
    if (e == cudaSuccess) return absl::OkStatus();
    FreeStepInputs(in);
    return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  };
  absl::Status s = check(cudaMalloc(&in.hidden, h.size() * 2 + 16), "cudaMalloc(hidden)");
  if (s.ok()) s = check(cudaMalloc(&in.out, h.size() * 2 + 16), "cudaMalloc(out)");
  if (s.ok()) s = check(cudaMalloc(&in.ids, ids.size() * 4 + 16), "cudaMalloc(ids)");
  if (s.ok()) s = check(cudaMalloc(&in.weights, w.size() * 4 + 16), "cudaMalloc(weights)");
  if (s.ok()) {
    s = check(cudaMemcpy(in.hidden, h.data(), h.size() * 2, cudaMemcpyHostToDevice),
              "cudaMemcpy(hidden)");
  }
  if (s.ok()) {
    s = check(cudaMemcpy(in.ids, ids.data(), ids.size() * 4, cudaMemcpyHostToDevice),
              "cudaMemcpy(ids)");
  }
  if (s.ok()) {
    s = check(cudaMemcpy(in.weights, w.data(), w.size() * 4, cudaMemcpyHostToDevice),
              "cudaMemcpy(weights)");
  }
  if (!s.ok()) return s;
  return in;
}

}  // namespace moe_ep::bench
