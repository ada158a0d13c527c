#include "client/group_setup.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"

namespace moe_ep::client {
namespace {

absl::Status AtLeastOne(const char* flag, int64_t value) {
  if (value >= 1) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, ": expected >= 1, got ", value));
}

}  // namespace

absl::Status ValidateGroupSetup(const GroupSetupOptions& o, int world) {
  if (!(o.group_timeout_s > 0 && o.group_timeout_s <= 3600)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--group-timeout: expected seconds in (0, 3600], got ", o.group_timeout_s));
  }
  if (o.invalid_expert_id != "-1" && o.invalid_expert_id != "num_experts") {
    return absl::InvalidArgumentError(absl::StrCat(
        "--invalid-expert-id: expected -1 or num_experts, got '", o.invalid_expert_id, "'"));
  }
  if (o.dispatch_dtype != "bf16" && o.dispatch_dtype != "fp8_e4m3") {
    return absl::InvalidArgumentError(
        absl::StrCat("--dispatch-dtype: expected bf16 or fp8_e4m3, got '", o.dispatch_dtype, "'"));
  }
  if (o.hidden == 0) return absl::OkStatus();
  RETURN_IF_ERROR(AtLeastOne("--hidden", o.hidden));
  RETURN_IF_ERROR(AtLeastOne("--num-experts", o.num_experts));
  RETURN_IF_ERROR(AtLeastOne("--top-k", o.top_k));
  RETURN_IF_ERROR(AtLeastOne("--capacity", o.capacity_tokens));
  RETURN_IF_ERROR(AtLeastOne("--layers", o.layers));
  if (o.top_k > o.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("--top-k: expected <= --num-experts (", o.num_experts, "), got ", o.top_k));
  }
  if (world > 0 && o.num_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--num-experts: expected >= the number of ranks (", world, "), got ", o.num_experts));
  }
  if (o.experts != "none" && o.experts != "identity" && o.experts != "swiglu") {
    return absl::InvalidArgumentError(
        absl::StrCat("--load-experts: expected none, identity or swiglu, got '", o.experts, "'"));
  }
  if (o.experts == "swiglu") RETURN_IF_ERROR(AtLeastOne("--intermediate", o.intermediate));
  return absl::OkStatus();
}

absl::Status SetUpGroup(Coordinator& coordinator, const GroupSetupOptions& o, std::ostream& out) {
  const int world = coordinator.world_size();
  RETURN_IF_ERROR(ValidateGroupSetup(o, world));
  if (o.hidden == 0) return absl::OkStatus();
  v1::ConfigureLayersRequest configure;
  configure.mutable_layout()->set_tp_size(world);
  configure.mutable_layout()->set_attn_dp_size(world);
  configure.mutable_layout()->set_moe_dense_tp_size(1);
  configure.set_a2a_enabled(true);
  v1::ModelDescription* md = configure.mutable_model();
  md->set_name("up");
  md->set_hidden_size(o.hidden);
  md->set_num_layers(o.layers);
  md->set_num_experts(o.num_experts);
  md->set_top_k(o.top_k);
  md->set_moe_intermediate_size(o.intermediate > 0 ? o.intermediate : o.hidden);
  for (int l = 0; l < o.layers; ++l) md->add_sparse_layers(true);
  RETURN_IF_ERROR(coordinator.ConfigureLayers(configure).status());
  v1::AllocateWorkspaceRequest allocate;
  allocate.set_hidden_size(o.hidden);
  allocate.set_top_k(o.top_k);
  allocate.set_num_experts(o.num_experts);
  allocate.set_capacity_tokens(o.capacity_tokens);
  allocate.set_dispatch_dtype(o.dispatch_dtype == "fp8_e4m3" ? v1::DISPATCH_DTYPE_FP8_E4M3
                                                             : v1::DISPATCH_DTYPE_BF16);
  allocate.set_invalid_expert_id(o.invalid_expert_id == "num_experts"
                                     ? v1::INVALID_EXPERT_ID_NUM_EXPERTS
                                     : v1::INVALID_EXPERT_ID_MINUS_ONE);
  for (int64_t b : o.cuda_graph_buckets) allocate.add_cuda_graph_buckets(b);
  RETURN_IF_ERROR(coordinator.AllocateWorkspace(allocate).status());
  if (o.experts != "none") {
    for (int l = 0; l < o.layers; ++l) {
      v1::LoadExpertsRequest load;
      load.set_layer(l);
      load.set_kind(o.experts == "identity" ? v1::EXPERT_KIND_IDENTITY : v1::EXPERT_KIND_SWIGLU);
      load.set_seed(o.seed);
      if (o.experts == "swiglu") load.set_intermediate_size(o.intermediate);
      RETURN_IF_ERROR(coordinator.LoadExperts(load).status());
    }
  }
  out << "moe-ep: configured " << o.layers << " MoE layer(s): H " << o.hidden << ", "
      << o.num_experts << " experts, top-" << o.top_k << ", capacity " << o.capacity_tokens
      << " tokens per rank"
      << (o.cuda_graph_buckets.empty()
              ? std::string()
              : absl::StrCat(", buckets ", absl::StrJoin(o.cuda_graph_buckets, ",")))
      << ", experts " << o.experts << ", dispatch " << o.dispatch_dtype << ", invalid id "
      << o.invalid_expert_id << "\n";
  return absl::OkStatus();
}

}  // namespace moe_ep::client
