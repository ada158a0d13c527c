#pragma once

// The inputs of the Benchmark RPC (proto/moe_ep/v1/worker.proto): one rank's
// hidden states, routing and routing weights, seeded per (seed, rank) so
// every run of the same request on the same rank is identical.
//   - hidden [T, H] bf16: uniform in [-1, 1) (std::mt19937_64 draws, rounded
//     to bf16);
//   - topk_ids [T, K] int32: K distinct experts per token, drawn without
//     replacement in proportion to a popularity: equal ("uniform") or
//     1 / (e + 1) (Zipf with s = 1, "skewed");
//   - topk_weights [T, K] fp32: uniform in [0.05, 1), each row normalized to
//     sum 1.
// The engine is std::mt19937_64 seeded with seed * 0x9E3779B97F4A7C15 + rank,
// drawn in the order hidden, routing (token-major), weights (token-major).
//
// Pure functions; thread-safe. Source: DESIGN §9; issue 10 item 5.

#include <cstdint>
#include <random>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "server/data_plane.h"

namespace moe_ep::server {

enum class BenchmarkRouting { kUniform, kSkewed };

// ParseBenchmarkRouting()
//
// "" or "uniform" -> kUniform, "skewed" -> kSkewed; anything else
// kInvalidArgument: routing: expected "uniform" or "skewed", got "<text>".
absl::StatusOr<BenchmarkRouting> ParseBenchmarkRouting(absl::string_view routing);

// SampleRouting()
//
// `top_k` distinct experts for each of `tokens` tokens, drawn from `rng` in
// proportion to `popularity` (one weight per expert, >= 0) without
// replacement; ids [tokens, top_k] row-major.
// REQUIRES: at least top_k entries of `popularity` are > 0.
std::vector<int32_t> SampleRouting(std::mt19937_64& rng, int64_t tokens, int top_k,
                                   const std::vector<double>& popularity);

// GenerateBenchmarkInputs()
//
// This rank's inputs as described above, T = `tokens`.
// REQUIRES: tokens >= 0, hidden >= 1, 1 <= top_k <= num_experts (the request
// checks of server/request_options.h).
BenchmarkInputs GenerateBenchmarkInputs(uint64_t seed, int rank, int64_t tokens, int64_t hidden,
                                        int top_k, int num_experts, BenchmarkRouting routing);

}  // namespace moe_ep::server
