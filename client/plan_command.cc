#include "client/plan_command.h"

#include "client/model_source.h"
#include "core/layer_plan.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::Status RunPlanCommand(const PlanCommandOptions& options, std::ostream& out) {
  ASSIGN_OR_RETURN(core::ModelDescription model, ResolveModel(options.model));
  core::ParallelLayout layout;
  layout.tp_size = options.tp_size;
  layout.attn_dp_size = options.attn_dp_size;
  layout.moe_dense_tp_size = options.moe_dense_tp_size;
  ASSIGN_OR_RETURN(std::vector<core::LayerPlan> plans,
                   core::PlanLayers(layout, model.sparse_layers, options.a2a_enabled));
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
