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

// The checkpoint's quantization as JSON (issue 35 item 1): {"method" ("none",
// "fp8", "mxfp4"), "fmt", "weight_block_size" ([128, 128] fp8, [1, 32]
// mxfp4, [] bf16), "activation_scheme", "modules_to_not_convert",
// "expert_format" ("bf16", "fp8-block128", "mxfp4"), "expert_bytes" (one
// routed expert in that format), "layer_expert_bytes" (all routed experts of
// one MoE layer), "model_expert_bytes" (of every MoE layer)}.
nlohmann::json QuantizationJson(const core::ModelDescription& model);
// One line for people: "weights: fp8 (e4m3, 128 x 128 blocks, dynamic
// activations); routed experts fp8-block128: 42.0 MiB each, 10.5 GiB a layer,
// 609 GiB in all (scales 0.024%)".
std::string DescribeQuantization(const core::ModelDescription& model);

// The plan as JSON (issue 9 item 6): {"model", "model_type", "hidden_size",
// "num_experts", "top_k", "moe_intermediate_size", "shared_expert"
// (SharedExpertJson), "routed_scaling_factor", "router_weight_scales"
// ("output" | "input"; issue 18), "quantization" (QuantizationJson), "num_layers",
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
