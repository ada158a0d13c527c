#pragma once

// `moe-ep workspace`: payload and workspace sizes of a model at an EP size and
// per-rank token capacity (DESIGN §5), offline (no workers).

#include <cstdint>
#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace moe_ep::client {

struct WorkspaceCommandOptions {
  std::string model = "qwen3-30b-a3b";  // config path or preset
  int ep_size = 0;                      // E
  int64_t max_tokens = 0;               // N, per rank (never scaled by E)
  std::string dtype = "bf16";           // bf16 | nvfp4 | mxfp8
  bool json = false;                    // one JSON object instead of the tables
};

// Prints bytes per token (dispatch, combine), the FlashInfer-compatible
// per-rank total with its aux / dispatch / combine parts, and moe-ep's own
// allocation with its region breakdown (offsets and sizes).
// With json (issue 9 item 6) one object: {"model", "hidden", "top_k",
// "num_experts", "ep", "capacity_tokens", "dtype", "dispatch_bytes_per_token",
// "combine_bytes_per_token", "flashinfer": {"aux_bytes",
// "dispatch_region_bytes", "combine_region_bytes", "total_bytes"},
// "allocated": {"total_bytes", "regions": [{"name", "offset_bytes",
// "size_bytes"}]}, "expert_weights": {"format" (the checkpoint's:
// "bf16", "fp8-block128", "mxfp4"), "expert_bytes" (one routed expert),
// "experts_per_rank" (ceil(experts / E)), "num_sparse_layers",
// "per_rank_bytes" (their product: DeepSeek-V3 fp8 at E 8: 32 * 58 *
// 44,050,944 = 81.8 GB)}}, every size an integer count of bytes.
// Errors: ResolveModel errors; kInvalidArgument for an unknown dtype, E < 1,
// N < 1 and the core::ComputeFlashInferWorkspace errors.
absl::Status RunWorkspaceCommand(const WorkspaceCommandOptions& options, std::ostream& out);

}  // namespace moe_ep::client
