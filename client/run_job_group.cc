// Steps 4 to 6 of `moe-ep run` (client/run_job_steps.h): the group, the
// result's fixed fields and the experts.

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/coordinator.h"
#include "client/group_session.h"
#include "client/placement_request.h"
#include "client/run_job_steps.h"
#include "client/run_masks.h"
#include "client/text_table.h"
#include "core/status_macros.h"

namespace moe_ep::client::run_job_internal {
namespace {

// ConfigureLayers (tp = attn_dp = world, moe_dense_tp 1, a2a on) and
// AllocateWorkspace (capacity N, bf16 or fp8_e4m3 dispatch) of the main
// job's layout.
absl::Status ConfigureRunGroup(Coordinator& coordinator, const core::ModelDescription& model,
                               int world, int64_t capacity, int redundant_slots_per_rank,
                               core::DispatchDType dispatch_dtype, std::ostream& out,
                               RankSetup* setup) {
  const int64_t H = model.hidden_size;
  const int K = model.top_k;
  v1::ConfigureLayersRequest configure;
  configure.mutable_layout()->set_tp_size(world);
  configure.mutable_layout()->set_attn_dp_size(world);
  configure.mutable_layout()->set_moe_dense_tp_size(1);
  configure.set_a2a_enabled(true);
  v1::ModelDescription* md = configure.mutable_model();
  md->set_name(model.name);
  md->set_hidden_size(H);
  md->set_num_layers(model.num_layers);
  md->set_num_experts(model.num_experts);
  md->set_top_k(K);
  md->set_moe_intermediate_size(model.moe_intermediate_size);
  for (bool b : model.sparse_layers) md->add_sparse_layers(b);
  ASSIGN_OR_RETURN(std::vector<v1::ConfigureLayersResponse> configured,
                   coordinator.ConfigureLayers(configure));
  out << "configured: tp " << world << ", attn_dp " << world
      << ", moe_dense_tp 1, a2a on; plan fingerprint " << configured[0].fingerprint() << "\n";

  v1::AllocateWorkspaceRequest allocate;
  allocate.set_hidden_size(H);
  allocate.set_top_k(K);
  allocate.set_num_experts(model.num_experts);
  allocate.set_capacity_tokens(capacity);
  allocate.set_dispatch_dtype(dispatch_dtype == core::DispatchDType::kFP8E4M3
                                  ? v1::DISPATCH_DTYPE_FP8_E4M3
                                  : v1::DISPATCH_DTYPE_BF16);
  allocate.set_invalid_expert_id(v1::INVALID_EXPERT_ID_MINUS_ONE);
  allocate.set_redundant_slots_per_rank(redundant_slots_per_rank);
  ASSIGN_OR_RETURN(std::vector<v1::AllocateWorkspaceResponse> allocated,
                   coordinator.AllocateWorkspace(allocate));
  out << "workspace: capacity " << allocated[0].capacity_tokens() << " tokens/rank, "
      << allocated[0].dispatch_bytes_per_token() << " B/token dispatch, "
      << FormatBytes(allocated[0].allocated_bytes()) << " allocated per worker (FlashInfer-"
      << "compatible: " << FormatBytes(allocated[0].flashinfer_workspace_bytes()) << ")\n";
  out.flush();
  setup->configure = configure;
  setup->allocate = allocate;
  return absl::OkStatus();
}

}  // namespace

absl::Status FormRunGroup(const RunJobOptions& options, RunJobState& job, std::ostream& out) {
  const int world = job.world;
  out.flush();
  ASSIGN_OR_RETURN(job.workers, AttachWorkers(job.selection));
  const AttachedWorkers& workers = job.workers;
  if (static_cast<int>(workers.targets.size()) != world) {
    return absl::InternalError(
        absl::StrCat("AttachWorkers: expected ", world, " workers, got ", workers.targets.size()));
  }

  CoordinatorOptions copts;
  copts.rpc_timeout = options.rpc_timeout;
  // A kill needs the survivors to mask it (every rank's address at Join).
  copts.rank_masks = job.kills;
  if (job.kills) copts.group_timeout = absl::Seconds(10);
  GroupSession& group = job.group;
  if (options.attach) {
    // The group the workers already form (issue 12 item 6): steps only.
    ASSIGN_OR_RETURN(job.attached,
                     AttachFormedGroup(workers, copts, job.max_count, &group.coordinator));
    const std::vector<v1::GetStatusResponse>& attached = job.attached;
    out << "group: attached to the " << world << " workers' group of generation "
        << attached[0].generation() << " (backend " << attached[0].backend() << ", workspace "
        << attached[0].capacity_tokens()
        << " tokens/rank; not configured, allocated or loaded here): "
        << absl::StrJoin(workers.targets, " ") << "\n";
    out.flush();
    return absl::OkStatus();
  }
  ASSIGN_OR_RETURN(group, FormWorkerGroup(workers, copts));
  out << "group: " << world << " workers ("
      << (workers.cluster ? "embedded local cluster" : "--targets") << ", backend "
      << group.joined[0].backend() << ", generation " << group.coordinator->generation()
      << "): " << absl::StrJoin(workers.targets, " ") << "\n";

  // Every backend's plane masks (Gloo, NCCL, one-sided: DESIGN §15); the
  // kill and the restart need workers this run started.
  if (job.kills && workers.cluster == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kill-rank: kills a local worker this run starts; the group of backend ",
                     group.joined[0].backend(), " was not started here"));
  }
  return ConfigureRunGroup(*group.coordinator, job.model, world, job.capacity,
                           options.redundant_slots_per_rank, options.dispatch_dtype, out,
                           &job.setup);
}

void StartRunResult(const RunJobOptions& options, RunJobState& job) {
  RunJobResult& result = job.result;
  result.model_name = job.model.name;
  result.shared_expert = job.model.shared_expert;
  result.routed_scaling_factor = job.model.routed_scaling_factor;
  result.world = job.world;
  result.steps = options.steps;
  result.expert_bytes_per_rank.assign(job.world, 0);
  result.layer_expert_bytes = ExpertBytesPerLayer(job.model, job.format);
  result.num_sparse_layers = static_cast<int>(job.sparse.size());
  result.tolerance = options.tolerance;
  result.identity_experts = job.identity;
  result.expert_format = core::quant::ExpertWeightFormatName(job.format);
  result.dispatch_dtype = options.dispatch_dtype;
  result.memory = job.memory;
  result.memory_available_bytes = job.available.ok() ? *job.available : 0;
  for (int layer : job.run_layers) {
    LayerRunSummary summary;
    summary.layer = layer;
    result.layers.push_back(summary);
  }
}

v1::LoadExpertsRequest RunLoadRequest(const RunJobOptions& options, const RunJobState& job,
                                      int layer) {
  const core::quant::ExpertWeightFormat format = job.format;
  const core::SharedExpertConfig& shared = job.model.shared_expert;
  v1::LoadExpertsRequest load;
  load.set_layer(layer);
  load.set_kind(job.identity ? v1::EXPERT_KIND_IDENTITY
                : format == core::quant::ExpertWeightFormat::kFp8Block128
                    ? v1::EXPERT_KIND_FP8_BLOCK_SWIGLU
                : format == core::quant::ExpertWeightFormat::kMxfp4 ? v1::EXPERT_KIND_MXFP4_GPT_OSS
                                                                    : v1::EXPERT_KIND_SWIGLU);
  load.set_swiglu_limit(static_cast<float>(job.model.swiglu_limit));
  load.set_router_weight_scales_input(job.scale_input);
  load.set_seed(options.seed);
  load.set_intermediate_size(job.model.moe_intermediate_size);
  if (shared.present()) {
    load.mutable_shared_expert()->set_intermediate_size(shared.intermediate_size);
    load.mutable_shared_expert()->set_sigmoid_gate(shared.sigmoid_gate);
  }
  return load;
}

absl::Status LoadRunExperts(const RunJobOptions& options, RunJobState& job, std::ostream& out) {
  const int world = job.world;
  // The table a kill run serves by: replicas of the next ranks' experts in
  // the redundant slots (client/run_masks.h), else the contiguous one.
  if (job.kills) {
    ASSIGN_OR_RETURN(
        job.mask_table,
        options.redundant_slots_per_rank > 0
            ? RingReplicaTable(job.model.num_experts, world, options.redundant_slots_per_rank)
            : core::PlacementTable::Contiguous(job.model.num_experts, world));
  }
  RunJobResult& result = job.result;
  for (int layer : job.run_layers) {
    if (options.attach) continue;  // loaded by the group's owner (bytes: below)
    if (job.kills && options.redundant_slots_per_rank > 0) {
      job.setup.placements.push_back(MakeInstallPlacementRequest(layer, *job.mask_table));
      RETURN_IF_ERROR(job.coordinator().InstallPlacement(job.setup.placements.back()).status());
      if (layer == job.run_layers[0]) {
        out << "placement: each worker's " << options.redundant_slots_per_rank
            << " redundant slot(s) replicate the next ranks' experts ("
            << job.mask_table->CanonicalText() << ")\n";
      }
    }
    job.setup.loads.push_back(RunLoadRequest(options, job, layer));
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(std::vector<v1::LoadExpertsResponse> loaded,
                     job.coordinator().LoadExperts(RunLoadRequest(options, job, layer)));
    std::vector<std::string> ranges;
    for (int r = 0; r < world; ++r) {
      result.expert_bytes_per_rank[r] += loaded[r].expert_bytes() + loaded[r].shared_expert_bytes();
      ranges.push_back(absl::StrCat(loaded[r].first_expert(), "..",
                                    loaded[r].first_expert() + loaded[r].num_local_experts() - 1));
    }
    out << absl::StrFormat(
        "experts: layer %d loaded in %.1f s, per worker [%s] (%s each on rank 0)\n", layer,
        absl::ToDoubleSeconds(absl::Now() - start), absl::StrJoin(ranges, ", "),
        FormatBytes(loaded[0].expert_bytes()));
    out.flush();  // progress as it goes: a real model's layer takes seconds
  }

  for (size_t r = 0; r < job.attached.size(); ++r) {
    result.expert_bytes_per_rank[r] = job.attached[r].expert_bytes();  // every loaded layer
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::client::run_job_internal
