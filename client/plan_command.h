#pragma once

// `moe-ep plan`: the per-layer scatter-mode plan of a model under a parallel
// layout (DESIGN §2-§3), offline (no workers).

#include <ostream>
#include <string>

#include "absl/status/status.h"

namespace moe_ep::client {

struct PlanCommandOptions {
  std::string model = "qwen3-30b-a3b";  // config path or preset
  int tp_size = 1;
  int attn_dp_size = 1;
  int moe_dense_tp_size = 0;  // 0 = unset
  bool a2a_enabled = true;
};

// Prints a summary line then core::FormatPlanTable.
// Errors: ResolveModel errors; core::PlanLayers errors (kInvalidArgument
// naming the field, or the layer, step and modes of a rejected plan).
absl::Status RunPlanCommand(const PlanCommandOptions& options, std::ostream& out);

}  // namespace moe_ep::client
