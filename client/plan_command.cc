#include "client/plan_command.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/model_source.h"
#include "client/text_table.h"
#include "core/layer_plan.h"
#include "core/quantized_weights.h"
#include "core/status_macros.h"

namespace moe_ep::client {

nlohmann::json SharedExpertJson(const core::ModelDescription& model) {
  const core::SharedExpertConfig& s = model.shared_expert;
  return {{"count", s.count},
          {"intermediate_size", s.intermediate_size},
          {"gate", s.sigmoid_gate ? "sigmoid" : "none"},
          {"source_key", s.source_key}};
}

std::string DescribeSharedExperts(const core::ModelDescription& model) {
  const core::SharedExpertConfig& s = model.shared_expert;
  std::string text = s.present() ? absl::StrCat("shared experts: ", s.count, " (", s.source_key,
                                                "), intermediate ", s.intermediate_size, ", gate ",
                                                s.sigmoid_gate ? "sigmoid" : "none")
                                 : std::string("shared experts: none");
  absl::StrAppend(&text, "; routed scaling ", model.routed_scaling_factor,
                  " (folded into the top-k weights); router weight scales the expert's ",
                  core::RouterWeightUseName(model.router_weight_use));
  return text;
}

nlohmann::json QuantizationJson(const core::ModelDescription& model) {
  const core::QuantizationConfig& q = model.quantization;
  const int64_t expert = model.ExpertWeightBytes();
  const int64_t layer = expert * model.num_experts;
  return {{"method", q.present() ? q.method : "none"},
          {"fmt", q.fmt},
          {"weight_block_size", q.weight_block_size},
          {"activation_scheme", q.activation_scheme},
          {"modules_to_not_convert", q.modules_to_not_convert},
          {"expert_format", core::quant::ExpertWeightFormatName(q.expert_format)},
          {"expert_bytes", expert},
          {"layer_expert_bytes", layer},
          {"model_expert_bytes", layer * model.NumSparseLayers()}};
}

std::string DescribeQuantization(const core::ModelDescription& model) {
  const core::QuantizationConfig& q = model.quantization;
  std::string text = "weights: ";
  if (!q.present()) {
    absl::StrAppend(&text, "bf16 (no quantization_config)");
  } else {
    absl::StrAppend(&text, q.method, " (");
    if (!q.fmt.empty()) absl::StrAppend(&text, q.fmt, ", ");
    if (q.weight_block_size.size() == 2) {
      absl::StrAppend(&text, q.weight_block_size[0], " x ", q.weight_block_size[1], " blocks");
    }
    if (!q.activation_scheme.empty()) {
      absl::StrAppend(&text, ", ", q.activation_scheme, " activations");
    }
    absl::StrAppend(&text, ")");
    if (!q.modules_to_not_convert.empty()) {
      absl::StrAppend(&text, ", not converted: ", absl::StrJoin(q.modules_to_not_convert, " "));
    }
  }
  const int64_t expert = model.ExpertWeightBytes();
  const double layer = static_cast<double>(expert) * model.num_experts;
  absl::StrAppend(&text, "; routed experts ", core::quant::ExpertWeightFormatName(q.expert_format),
                  ": ", FormatBytes(static_cast<double>(expert)), " each, ", FormatBytes(layer),
                  " a layer, ", FormatBytes(layer * model.NumSparseLayers()), " in all");
  if (q.expert_format == core::quant::ExpertWeightFormat::kFp8Block128) {
    const int64_t weights = 3 * model.hidden_size * model.moe_intermediate_size;
    absl::StrAppend(&text, " (scales ",
                    absl::StrFormat("%.3f%%", 100.0 * static_cast<double>(expert - weights) /
                                                  static_cast<double>(weights)),
                    ")");
  }
  return text;
}

nlohmann::json PlanJson(const core::ModelDescription& model, const core::ParallelLayout& layout,
                        bool a2a_enabled, const std::vector<core::LayerPlan>& plans) {
  nlohmann::json layers = nlohmann::json::array();
  for (const core::LayerPlan& p : plans) {
    layers.push_back({{"layer", p.layer},
                      {"sparse", p.sparse},
                      {"input", core::ScatterModeName(p.input)},
                      {"attention", core::ScatterModeName(p.attention)},
                      {"residual", core::ScatterModeName(p.residual)},
                      {"mlp", core::ScatterModeName(p.mlp)},
                      {"output", core::ScatterModeName(p.output)},
                      {"before_attention", core::StepName(p.before_attention)},
                      {"before_mlp", core::StepName(p.before_mlp)},
                      {"after_mlp", core::StepName(p.after_mlp)}});
  }
  return {{"model", model.name},
          {"model_type", model.model_type},
          {"hidden_size", model.hidden_size},
          {"num_experts", model.num_experts},
          {"top_k", model.top_k},
          {"moe_intermediate_size", model.moe_intermediate_size},
          {"shared_expert", SharedExpertJson(model)},
          {"routed_scaling_factor", model.routed_scaling_factor},
          {"router_weight_scales", core::RouterWeightUseName(model.router_weight_use)},
          {"quantization", QuantizationJson(model)},
          {"num_layers", model.num_layers},
          {"num_sparse_layers", model.NumSparseLayers()},
          {"tp", layout.tp_size},
          {"attn_dp", layout.attn_dp_size},
          {"attn_tp", layout.attn_tp_size()},
          {"moe_dense_tp", layout.moe_dense_tp_size},
          {"effective_moe_dense_tp", layout.effective_moe_dense_tp_size()},
          {"a2a", a2a_enabled},
          {"fingerprint", core::PlanFingerprint(layout, model.sparse_layers, a2a_enabled)},
          {"layers", std::move(layers)}};
}

absl::Status RunPlanCommand(const PlanCommandOptions& options, std::ostream& out) {
  ASSIGN_OR_RETURN(core::ModelDescription model, ResolveModel(options.model));
  core::ParallelLayout layout;
  layout.tp_size = options.tp_size;
  layout.attn_dp_size = options.attn_dp_size;
  layout.moe_dense_tp_size = options.moe_dense_tp_size;
  ASSIGN_OR_RETURN(std::vector<core::LayerPlan> plans,
                   core::PlanLayers(layout, model.sparse_layers, options.a2a_enabled));
  if (options.json) {
    out << PlanJson(model, layout, options.a2a_enabled, plans).dump(2) << "\n";
    return absl::OkStatus();
  }
  out << model.name << ": " << model.num_layers << " layers (" << model.NumSparseLayers()
      << " sparse), tp " << layout.tp_size << ", attn_dp " << layout.attn_dp_size << " (attn_tp "
      << layout.attn_tp_size() << "), moe_dense_tp "
      << (options.moe_dense_tp_size == 0 ? std::string("unset")
                                         : std::to_string(options.moe_dense_tp_size))
      << ", a2a " << (options.a2a_enabled ? "on" : "off") << ", fingerprint "
      << core::PlanFingerprint(layout, model.sparse_layers, options.a2a_enabled) << "\n"
      << "routed experts: " << model.num_experts << ", top-" << model.top_k << ", intermediate "
      << model.moe_intermediate_size << "; " << DescribeSharedExperts(model) << "\n"
      << DescribeQuantization(model) << "\n"
      << core::FormatPlanTable(plans);
  return absl::OkStatus();
}

}  // namespace moe_ep::client
