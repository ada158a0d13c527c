#pragma once

// `moe-ep plan`: the per-layer scatter-mode plan of a model under a parallel
// layout (DESIGN §2-§3), offline (no workers).

#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/layer_plan.h"
#include "core/model_config.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {

struct PlanCommandOptions {
  std::string model = "qwen3-30b-a3b";  // config path or preset
  int tp_size = 1;
  int attn_dp_size = 1;
  int moe_dense_tp_size = 0;  // 0 = unset
  bool a2a_enabled = true;
  bool json = false;  // PlanJson instead of the text
};

// The model's shared experts as JSON (issue 18): {"count",
// "intermediate_size", "gate": "sigmoid" | "none", "source_key"}; count 0
// and size 0 when the family has none.
nlohmann::json SharedExpertJson(const core::ModelDescription& model);
// One line for people: "shared experts: 1 (n_shared_experts), intermediate
// 2048, gate none; routed scaling 2.5 (folded into the top-k weights);
// router weight scales the expert's output".
std::string DescribeSharedExperts(const core::ModelDescription& model);

// The plan as JSON (issue 9 item 6): {"model", "model_type", "hidden_size",
// "num_experts", "top_k", "moe_intermediate_size", "shared_expert"
// (SharedExpertJson), "routed_scaling_factor", "router_weight_scales"
// ("output" | "input"; issue 18), "num_layers",
// "num_sparse_layers", "tp", "attn_dp", "attn_tp", "moe_dense_tp" (0 =
// unset), "effective_moe_dense_tp", "a2a", "fingerprint", "layers": [{"layer",
// "sparse", "input", "attention", "residual", "mlp", "output" (scatter-mode
// names), "before_attention", "before_mlp", "after_mlp" (step names)}]}.
nlohmann::json PlanJson(const core::ModelDescription& model, const core::ParallelLayout& layout,
                        bool a2a_enabled, const std::vector<core::LayerPlan>& plans);

// Prints a summary line then core::FormatPlanTable (or, with json, PlanJson).
// Errors: ResolveModel errors; core::PlanLayers errors (kInvalidArgument
// naming the field, or the layer, step and modes of a rejected plan).
absl::Status RunPlanCommand(const PlanCommandOptions& options, std::ostream& out);

}  // namespace moe_ep::client
