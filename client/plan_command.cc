#include "client/plan_command.h"

#include "client/model_source.h"
#include "core/layer_plan.h"
#include "core/status_macros.h"

namespace moe_ep::client {

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
      << core::FormatPlanTable(plans);
  return absl::OkStatus();
}

}  // namespace moe_ep::client
