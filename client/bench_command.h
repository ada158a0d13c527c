#pragma once

// `moe-ep bench`: the Benchmark RPC (inputs generated on the workers) after
// forming the group and allocating a workspace for the given sizes; prints
// dispatch / combine latency percentiles and logical GB/s per rank.

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/worker_selection.h"

namespace moe_ep::client {

struct BenchCommandOptions {
  WorkerSelection workers;
  int64_t tokens_per_rank = 128;
  int64_t hidden = 7168;
  int top_k = 8;
  int num_experts = 256;
  std::string routing = "uniform";  // uniform | skewed
  int iterations = 20;
  int warmup = 3;
  uint64_t seed = 1;
  bool json = false;  // one JSON object instead of the table
};

// Errors: kInvalidArgument naming the flag (sizes < 1, top_k > num_experts,
// num_experts < ranks, iterations < 1, warmup < 0, unknown routing);
// worker errors aggregated per rank.
absl::Status ValidateBenchOptions(const BenchCommandOptions& options, int world);
// Runs the benchmark and prints the table, or with json (issue 9 item 6) one
// object: {"world", "backend", "tokens_per_rank", "hidden", "top_k",
// "num_experts", "routing", "iterations", "warmup", "seed", "ranks": [{"rank",
// "dispatch_p50_us", "dispatch_p99_us", "combine_p50_us", "combine_p99_us",
// "dispatch_bytes", "combine_bytes", "dispatch_logical_gbps",
// "combine_logical_gbps"}]} (the BenchmarkResponse of each rank as is).
absl::Status RunBenchCommand(const BenchCommandOptions& options, std::ostream& out);

}  // namespace moe_ep::client
