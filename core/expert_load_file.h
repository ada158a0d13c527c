#pragma once

// Reads a per-layer expert load matrix: {"logical_count": [[count x N] x L]},
// the format of SGLang's EPLB statistics of DeepSeek-V3
// (../shared/data/traces/sglang_ep_statistics_deepseek/*.json: L = 61 layers,
// N = 256 routed experts, layers 0-2 all zero as they are dense). Counts are
// tokens routed to each logical expert, possibly fractional averages.
// Source: sgl-project/sglang issue 6017 (`--init-expert-location` inputs);
// DESIGN §15; issue 17.

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moe_ep::core {

// ReadExpertLoadFile()
//
// Returns the matrix as [L][N] (layer, logical expert), L >= 1, N >= 1, every
// row of the same length.
//
// Errors:
//   kNotFound  `path` cannot be opened.
//   kDataLoss  not JSON; no non-empty "logical_count" array; a row that is not
//              an array of the first row's length; a count that is not a
//              finite number >= 0 (messages give path, layer and expert).
// Thread-safe (reads only `path`).
absl::StatusOr<std::vector<std::vector<double>>> ReadExpertLoadFile(const std::string& path);

}  // namespace moe_ep::core
