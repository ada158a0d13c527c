#include "client/workspace_command.h"

#include "absl/strings/str_cat.h"
#include "client/model_source.h"
#include "client/text_table.h"
#include "core/quantized_weights.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {
namespace {

std::vector<std::string> BytesRow(const std::string& quantity, int64_t bytes) {
  return {quantity, absl::StrCat(bytes), FormatBytes(static_cast<double>(bytes))};
}

}  // namespace

absl::Status RunWorkspaceCommand(const WorkspaceCommandOptions& options, std::ostream& out) {
  ASSIGN_OR_RETURN(core::ModelDescription model, ResolveModel(options.model));
  ASSIGN_OR_RETURN(core::DispatchDType dtype, core::ParseDispatchDType(options.dtype));
  if (options.ep_size < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--ep: expected >= 1, got ", options.ep_size));
  }
  if (options.max_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-tokens: expected >= 1 (tokens per rank), got ", options.max_tokens));
  }
  core::WorkspaceSpec spec;
  spec.ep_size = options.ep_size;
  spec.capacity_tokens = options.max_tokens;
  spec.hidden = model.hidden_size;
  spec.top_k = model.top_k;
  spec.dtype = dtype;
  ASSIGN_OR_RETURN(int64_t dispatch_bytes,
                   core::DispatchBytesPerToken(dtype, spec.hidden, spec.top_k));
  ASSIGN_OR_RETURN(core::FlashInferWorkspace fi, core::ComputeFlashInferWorkspace(spec));
  ASSIGN_OR_RETURN(core::AllocatedWorkspace own, core::ComputeAllocatedWorkspace(spec));
  // Routed-expert weights in the checkpoint's format (issue 35 item 1): the
  // rank holding the most experts under the contiguous placement, all MoE
  // layers.
  const int64_t expert_bytes = model.ExpertWeightBytes();
  const int64_t experts_per_rank = (model.num_experts + spec.ep_size - 1) / spec.ep_size;
  const int64_t rank_expert_bytes = expert_bytes * experts_per_rank * model.NumSparseLayers();
  const char* format = core::quant::ExpertWeightFormatName(model.quantization.expert_format);
  if (options.json) {
    nlohmann::json regions = nlohmann::json::array();
    for (const core::WorkspaceRegion& r : own.regions) {
      regions.push_back(
          {{"name", r.name}, {"offset_bytes", r.offset_bytes}, {"size_bytes", r.size_bytes}});
    }
    const nlohmann::json j = {
        {"model", model.name},
        {"hidden", spec.hidden},
        {"top_k", spec.top_k},
        {"num_experts", model.num_experts},
        {"ep", spec.ep_size},
        {"capacity_tokens", spec.capacity_tokens},
        {"dtype", core::DispatchDTypeName(dtype)},
        {"dispatch_bytes_per_token", dispatch_bytes},
        {"combine_bytes_per_token", core::CombineBytesPerToken(spec.hidden)},
        {"flashinfer",
         {{"aux_bytes", fi.aux_bytes},
          {"dispatch_region_bytes", fi.dispatch_region_bytes},
          {"combine_region_bytes", fi.combine_region_bytes},
          {"total_bytes", fi.total_bytes}}},
        {"allocated", {{"total_bytes", own.total_bytes}, {"regions", std::move(regions)}}},
        {"expert_weights",
         {{"format", format},
          {"expert_bytes", expert_bytes},
          {"experts_per_rank", experts_per_rank},
          {"num_sparse_layers", model.NumSparseLayers()},
          {"per_rank_bytes", rank_expert_bytes}}}};
    out << j.dump(2) << "\n";
    return absl::OkStatus();
  }

  out << model.name << ": hidden " << spec.hidden << ", top-" << spec.top_k << ", "
      << model.num_experts << " experts; ep " << spec.ep_size << ", capacity "
      << spec.capacity_tokens << " tokens per rank, dispatch dtype "
      << core::DispatchDTypeName(dtype) << "\n\n";
  TextTable sizes({"quantity", "bytes", "size"});
  sizes.AddRow(BytesRow("dispatch bytes per token", dispatch_bytes));
  sizes.AddRow(BytesRow("combine bytes per token", core::CombineBytesPerToken(spec.hidden)));
  sizes.AddRow(BytesRow("FlashInfer-compatible aux", fi.aux_bytes));
  sizes.AddRow(BytesRow("FlashInfer-compatible dispatch region", fi.dispatch_region_bytes));
  sizes.AddRow(BytesRow("FlashInfer-compatible combine region", fi.combine_region_bytes));
  sizes.AddRow(BytesRow("FlashInfer-compatible total per rank", fi.total_bytes));
  sizes.AddRow(BytesRow("moe-ep allocated per rank", own.total_bytes));
  out << sizes.Render() << "\nrouted experts (" << format
      << "): " << FormatBytes(static_cast<double>(expert_bytes)) << " each (" << expert_bytes
      << " bytes); " << experts_per_rank << " a rank x " << model.NumSparseLayers()
      << " MoE layers = " << FormatBytes(static_cast<double>(rank_expert_bytes)) << " ("
      << rank_expert_bytes << " bytes) a rank\n"
      << "\nmoe-ep allocation (each region 128-byte aligned):\n";
  TextTable regions({"region", "offset", "bytes", "size"});
  for (const core::WorkspaceRegion& r : own.regions) {
    regions.AddRow({r.name, absl::StrCat(r.offset_bytes), absl::StrCat(r.size_bytes),
                    FormatBytes(static_cast<double>(r.size_bytes))});
  }
  out << regions.Render();
  return absl::OkStatus();
}

}  // namespace moe_ep::client
