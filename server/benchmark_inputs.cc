#include "server/benchmark_inputs.h"

#include "absl/strings/str_cat.h"
#include "core/bf16.h"

namespace moe_ep::server {

absl::StatusOr<BenchmarkRouting> ParseBenchmarkRouting(absl::string_view routing) {
  if (routing.empty() || routing == "uniform") return BenchmarkRouting::kUniform;
  if (routing == "skewed") return BenchmarkRouting::kSkewed;
  return absl::InvalidArgumentError(
      absl::StrCat("routing: expected \"uniform\" or \"skewed\", got \"", routing, "\""));
}

std::vector<int32_t> SampleRouting(std::mt19937_64& rng, int64_t tokens, int top_k,
                                   const std::vector<double>& popularity) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens) * top_k);
  std::vector<double> w(popularity.size());
  for (int64_t t = 0; t < tokens; ++t) {
    w = popularity;
    for (int k = 0; k < top_k; ++k) {
      std::discrete_distribution<int32_t> pick(w.begin(), w.end());
      const int32_t e = pick(rng);
      ids[t * top_k + k] = e;
      w[e] = 0.0;
    }
  }
  return ids;
}

BenchmarkInputs GenerateBenchmarkInputs(uint64_t seed, int rank, int64_t tokens, int64_t hidden,
                                        int top_k, int num_experts, BenchmarkRouting routing) {
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(rank));
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  BenchmarkInputs inputs;
  inputs.num_tokens = tokens;
  inputs.hidden.resize(static_cast<size_t>(tokens * hidden));
  for (core::bf16_t& h : inputs.hidden) h = core::FloatToBf16(value(rng));
  std::vector<double> popularity(num_experts, 1.0);
  if (routing == BenchmarkRouting::kSkewed) {
    for (int e = 0; e < num_experts; ++e) popularity[e] = 1.0 / (e + 1);
  }
  inputs.topk_ids = SampleRouting(rng, tokens, top_k, popularity);
  std::vector<float>& weights = inputs.topk_weights;
  weights.resize(inputs.topk_ids.size());
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) sum += weights[t * top_k + k] = weight(rng);
    for (int k = 0; k < top_k; ++k) weights[t * top_k + k] /= sum;
  }
  return inputs;
}

}  // namespace moe_ep::server
