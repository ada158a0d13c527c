#pragma once

// What bench/embedded_forward_bench.cc and bench/forward_rpc_client.cc share
// (issue 16 item 5): the options of the 4096-token layer, its seeded inputs
// (bf16 hidden ~ N(0, 1), K distinct uniform experts per token, weights
// normalised to 1), and the timing helpers.

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace moe_ep::bench {

struct Options {
  std::string moe_ep = "moe-ep";
  std::string address;      // RPC client: the worker
  std::string output_file;  // RPC client: where its output goes
  std::string json;
  int64_t tokens = 4096;
  int64_t hidden = 7168;
  int experts = 256;
  int top_k = 8;
  int64_t intermediate = 2048;
  int warmup = 3;
  int iterations = 20;
  uint64_t seed = 1;
};

struct Inputs {
  std::vector<uint16_t> hidden;
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

inline Inputs MakeInputs(const Options& o) {
  std::mt19937_64 rng(o.seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_real_distribution<float> unit(0.05f, 1.0f);
  Inputs in;
  in.hidden.resize(o.tokens * o.hidden);
  for (auto& v : in.hidden) {
    float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16);
  }
  std::vector<int32_t> all(o.experts);
  for (int e = 0; e < o.experts; ++e) all[e] = e;
  for (int64_t t = 0; t < o.tokens; ++t) {
    std::shuffle(all.begin(), all.end(), rng);
    float sum = 0.0f;
    std::vector<float> w(o.top_k);
    for (int k = 0; k < o.top_k; ++k) sum += (w[k] = unit(rng));
    for (int k = 0; k < o.top_k; ++k) {
      in.ids.push_back(all[k]);
      in.weights.push_back(w[k] / sum);
    }
  }
  return in;
}

inline double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

inline double NowUs() {
  return std::chrono::duration<double, std::micro>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace moe_ep::bench
