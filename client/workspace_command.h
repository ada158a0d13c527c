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
};

// Prints bytes per token (dispatch, combine), the FlashInfer-compatible
// per-rank total with its aux / dispatch / combine parts, and moe-ep's own
// allocation with its region breakdown (offsets and sizes).
// Errors: ResolveModel errors; kInvalidArgument for an unknown dtype, E < 1,
// N < 1 and the core::ComputeFlashInferWorkspace errors.
absl::Status RunWorkspaceCommand(const WorkspaceCommandOptions& options, std::ostream& out);

}  // namespace moe_ep::client
