#pragma once

// Latency percentiles of the Benchmark RPC (proto/moe_ep/v1/worker.proto
// BenchmarkResponse: dispatch/combine p50 and p99). Nearest-rank definition:
// the p-th percentile of n ascending samples is the ceil(p / 100 * n)-th
// smallest (1-based, clamped to [1, n]), so it is always one of the samples.
//
// Pure functions; thread-safe. Source: DESIGN §9 (benchmark); issue 10 item 5.

#include <vector>

#include "absl/types/span.h"

namespace moe_ep::core {

// Percentile()
//
// Nearest-rank percentile `p` (in (0, 100]) of `sorted` (ascending).
// 0.0 when `sorted` is empty. Example: {1, 2, 3, 4}: p50 = 2, p99 = 4.
double Percentile(absl::Span<const double> sorted, double p);

struct LatencySummary {
  double p50_us = 0.0;
  double p99_us = 0.0;
};

// Summarize()
//
// p50 and p99 of `samples_us` (any order; sorted in place).
LatencySummary Summarize(std::vector<double>& samples_us);

}  // namespace moe_ep::core
