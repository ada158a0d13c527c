#include "server/request_options.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/ep_contract.h"
#include "core/expert_placement.h"
#include "core/expert_source.h"
#include "core/routing.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "server/backend_selection.h"
#include "server/path_policy.h"
#include "server/store_limits.h"

namespace moe_ep::server {
namespace {

using core::BallotField;
using core::Fingerprint64;

absl::Status Positive(absl::string_view field, int64_t value, int64_t max) {
  if (value < 1 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected in [1, ", max, "], got ", value));
  }
  return absl::OkStatus();
}

absl::Status NonNegative(absl::string_view field, int64_t value) {
  if (value < 0) {
    return absl::InvalidArgumentError(absl::StrCat(field, ": expected >= 0, got ", value));
  }
  return absl::OkStatus();
}

// The MoE sizes of AllocateWorkspace and Benchmark: the contract's one rule,
// its bounds this worker's (the flags' limits where they are tighter), so a
// message quotes the limit that holds.
absl::Status CheckMoeSizes(const RequestLimits& limits, int64_t hidden_size, int num_experts,
                           int top_k) {
  return core::ValidateMoeSizes(hidden_size, num_experts, top_k,
                                std::min<int64_t>(kMaxHidden, limits.max_hidden),
                                std::min<int64_t>(kMaxExperts, limits.max_experts));
}

// Contiguous placement gives every rank at least one expert: num_experts >= world.
absl::Status CheckEveryRankOwnsAnExpert(int num_experts, int world) {
  if (num_experts < world) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_experts: expected >= ", world,
                     " (the world size: every rank owns an expert), got ", num_experts));
  }
  return absl::OkStatus();
}

// A request size against the ConfigureLayers model's: equal, or the model
// left it 0 (unset).
absl::Status MatchesConfiguredModel(absl::string_view field, int64_t configured,
                                    int64_t requested) {
  if (configured > 0 && requested != configured) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected ", configured, " (the configured model), got ", requested));
  }
  return absl::OkStatus();
}

absl::StatusOr<core::DispatchDType> ToCore(v1::DispatchDType dtype) {
  switch (dtype) {
    case v1::DISPATCH_DTYPE_UNSPECIFIED:
    case v1::DISPATCH_DTYPE_BF16:
      return core::DispatchDType::kBF16;
    case v1::DISPATCH_DTYPE_NVFP4:
      return core::DispatchDType::kNVFP4;
    case v1::DISPATCH_DTYPE_MXFP8:
      return core::DispatchDType::kMXFP8;
    case v1::DISPATCH_DTYPE_FP8_E4M3:
      return core::DispatchDType::kFP8E4M3;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "dispatch_dtype: expected DISPATCH_DTYPE_BF16, _NVFP4, _MXFP8 or _FP8_E4M3, got ",
          dtype));
  }
}

absl::StatusOr<int32_t> InvalidExpertId(const v1::AllocateWorkspaceRequest& request) {
  switch (request.invalid_expert_id()) {
    case v1::INVALID_EXPERT_ID_UNSPECIFIED:
    case v1::INVALID_EXPERT_ID_MINUS_ONE:
      return -1;
    case v1::INVALID_EXPERT_ID_NUM_EXPERTS:
      return request.num_experts();
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("invalid_expert_id: expected INVALID_EXPERT_ID_MINUS_ONE or "
                       "INVALID_EXPERT_ID_NUM_EXPERTS, got ",
                       request.invalid_expert_id()));
  }
}

BallotField Text(absl::string_view name, absl::string_view value) {
  return BallotField{std::string(name), static_cast<int64_t>(Fingerprint64(value)), true};
}

}  // namespace

absl::StatusOr<JoinArgs> JoinArgsFromRequest(const RequestLimits& limits,
                                             const v1::JoinRequest& request,
                                             const JoinDefaults& defaults) {
  RETURN_IF_ERROR(CheckJoin(limits, request));
  if (request.world_size() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("world_size: expected >= 1, got ", request.world_size()));
  }
  if (request.rank() < 0 || request.rank() >= request.world_size()) {
    return absl::InvalidArgumentError(absl::StrCat("rank: expected in [0, ", request.world_size(),
                                                   ") (world_size ", request.world_size(),
                                                   "), got ", request.rank()));
  }
  if (request.generation() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("generation: expected >= 1, got ", request.generation()));
  }
  RETURN_IF_ERROR(NonNegative("timeout_ms", request.timeout_ms()));
  if (request.world_size() > 1 && request.rendezvous_address().empty()) {
    return absl::InvalidArgumentError(
        "rendezvous_address: required (host:port of rank 0's worker) when world_size > 1");
  }
  if (request.rendezvous_addresses_size() != 0) {
    if (request.rendezvous_addresses_size() != request.world_size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "rendezvous_addresses: expected one per rank (world_size ", request.world_size(),
          ") or none, got ", request.rendezvous_addresses_size()));
    }
    for (int r = 0; r < request.rendezvous_addresses_size(); ++r) {
      const std::string& address = request.rendezvous_addresses(r);
      if (address.empty() || address.size() > 1024) {
        return absl::InvalidArgumentError(absl::StrCat(
            "rendezvous_addresses[", r, "]: expected host:port (1 to 1024 bytes), got ",
            address.size(), " bytes"));
      }
    }
    if (request.rendezvous_addresses(0) != request.rendezvous_address()) {
      return absl::InvalidArgumentError(
          absl::StrCat("rendezvous_addresses[0]: expected rank 0's rendezvous_address \"",
                       request.rendezvous_address().substr(0, 64), "\", got \"",
                       request.rendezvous_addresses(0).substr(0, 64), "\""));
    }
  }
  if (!IsSendableSecret(request.rendezvous_secret())) {
    return absl::InvalidArgumentError(
        absl::StrCat("rendezvous_secret: expected at most ", kMaxSecretBytes,
                     " bytes of printable ASCII (0x20-0x7E: it is sent as gRPC metadata), got ",
                     request.rendezvous_secret().size(), " bytes"));
  }
  if (request.rejoin() && (request.world_size() < 2 || request.rendezvous_addresses_size() == 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "rejoin: needs world_size > 1 and rendezvous_addresses (one per rank), got world_size ",
        request.world_size(), " and ", request.rendezvous_addresses_size(), " addresses"));
  }
  JoinArgs args;
  ASSIGN_OR_RETURN(args.backend, ResolveBackend(request.backend(), defaults.backend));
  RETURN_IF_ERROR(CheckDevice(defaults.device, defaults.visible_gpus, args.backend));
  ASSIGN_OR_RETURN(const std::string gpu_plane,
                   ResolveGpuDataPlane(request.gpu_data_plane(), defaults.gpu_data_plane));
  // Every data plane re-admits a restarted rank (DESIGN §15): Gloo and the
  // one-sided plane by a fresh group, the NCCL plane by ncclCommInitRank.
  if (args.backend == "nccl") args.gpu_data_plane = gpu_plane;
  args.world_size = request.world_size();
  args.rank = request.rank();
  args.rendezvous_address = request.rendezvous_address();
  args.generation = request.generation();
  args.timeout =
      request.timeout_ms() > 0 ? absl::Milliseconds(request.timeout_ms()) : defaults.timeout;
  args.data_plane_host =
      request.data_plane_host().empty() ? defaults.data_plane_host : request.data_plane_host();
  args.rendezvous_secret = request.rendezvous_secret();
  args.rendezvous_addresses.assign(request.rendezvous_addresses().begin(),
                                   request.rendezvous_addresses().end());
  args.rejoin = request.rejoin();
  return args;
}

absl::StatusOr<LayerConfig> LayerConfigFromRequest(const RequestLimits& limits,
                                                   const v1::ConfigureLayersRequest& request,
                                                   int world_size) {
  RETURN_IF_ERROR(CheckConfigureLayers(limits, request));
  const v1::ModelDescription& model = request.model();
  if (model.num_layers() < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.num_layers: expected >= 1, got ", model.num_layers()));
  }
  if (model.sparse_layers_size() != model.num_layers()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model.sparse_layers: expected ", model.num_layers(),
                     " entries (model.num_layers), got ", model.sparse_layers_size()));
  }
  RETURN_IF_ERROR(NonNegative("model.hidden_size", model.hidden_size()));
  RETURN_IF_ERROR(NonNegative("model.num_experts", model.num_experts()));
  RETURN_IF_ERROR(NonNegative("model.top_k", model.top_k()));
  RETURN_IF_ERROR(NonNegative("model.moe_intermediate_size", model.moe_intermediate_size()));
  if (model.top_k() > 0 && model.num_experts() > 0 && model.top_k() > model.num_experts()) {
    return absl::InvalidArgumentError(absl::StrCat("model.top_k: expected <= model.num_experts (",
                                                   model.num_experts(), "), got ", model.top_k()));
  }
  LayerConfig config;
  config.layout.tp_size = request.layout().tp_size();
  config.layout.attn_dp_size = request.layout().attn_dp_size();
  config.layout.moe_dense_tp_size = request.layout().moe_dense_tp_size();
  absl::Status valid = core::ValidateLayout(config.layout);
  if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("layout: ", valid.message()));
  config.sparse.assign(model.sparse_layers().begin(), model.sparse_layers().end());
  config.a2a_enabled = request.a2a_enabled();
  ASSIGN_OR_RETURN(config.plan, core::PlanLayers(config.layout, config.sparse, config.a2a_enabled));
  if (config.layout.tp_size != world_size) {
    return absl::InvalidArgumentError(absl::StrCat(
        "layout.tp_size: expected ", world_size, " (the world size), got ", config.layout.tp_size));
  }
  return config;
}

std::vector<BallotField> LayerConfigFields(const v1::ConfigureLayersRequest& request) {
  const v1::ModelDescription& model = request.model();
  std::string sparse;
  for (bool s : model.sparse_layers()) sparse.push_back(s ? 'S' : 'D');
  return {{"layout.tp_size", request.layout().tp_size()},
          {"layout.attn_dp_size", request.layout().attn_dp_size()},
          {"layout.moe_dense_tp_size", request.layout().moe_dense_tp_size()},
          {"a2a_enabled", request.a2a_enabled() ? 1 : 0},
          {"model.num_layers", model.num_layers()},
          Text("model.sparse_layers", sparse),
          Text("model.name", model.name()),
          {"model.hidden_size", model.hidden_size()},
          {"model.num_experts", model.num_experts()},
          {"model.top_k", model.top_k()},
          {"model.moe_intermediate_size", model.moe_intermediate_size()}};
}

uint64_t LayerConfigFingerprint(const v1::ConfigureLayersRequest& request,
                                const LayerConfig& config) {
  const v1::ModelDescription& model = request.model();
  return Fingerprint64(
      absl::StrCat("plan=", core::PlanFingerprint(config.layout, config.sparse, config.a2a_enabled),
                   ";model=", model.name(), ",", model.hidden_size(), ",", model.num_layers(), ",",
                   model.num_experts(), ",", model.top_k(), ",", model.moe_intermediate_size()));
}

absl::StatusOr<core::EpDispatcherOptions> AllocationFromRequest(
    const RequestLimits& limits, const v1::AllocateWorkspaceRequest& request, int world_size,
    const v1::ModelDescription& model) {
  RETURN_IF_ERROR(CheckAllocateWorkspace(limits, request));
  RETURN_IF_ERROR(
      CheckMoeSizes(limits, request.hidden_size(), request.num_experts(), request.top_k()));
  RETURN_IF_ERROR(NonNegative("capacity_tokens", request.capacity_tokens()));
  RETURN_IF_ERROR(NonNegative("chunked_prefill_size", request.chunked_prefill_size()));
  const int64_t capacity = request.capacity_tokens() > 0
                               ? request.capacity_tokens()
                               : core::DefaultCapacityTokens(request.chunked_prefill_size());
  RETURN_IF_ERROR(
      Positive("capacity_tokens", capacity, std::min<int64_t>(kMaxTokens, limits.max_tokens)));
  ASSIGN_OR_RETURN(core::DispatchDType dtype, ToCore(request.dispatch_dtype()));
  ASSIGN_OR_RETURN(int32_t invalid_id, InvalidExpertId(request));
  std::vector<int64_t> buckets(request.cuda_graph_buckets().begin(),
                               request.cuda_graph_buckets().end());
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i] < 1 || (i > 0 && buckets[i] <= buckets[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat("cuda_graph_buckets: expected positive and strictly ascending, got [",
                       absl::StrJoin(buckets, ", "), "]"));
    }
  }
  if (request.redundant_slots_per_rank() < 0 ||
      request.redundant_slots_per_rank() > request.num_experts()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "redundant_slots_per_rank: expected in [0, num_experts = ", request.num_experts(),
        "], got ", request.redundant_slots_per_rank()));
  }
  RETURN_IF_ERROR(CheckEveryRankOwnsAnExpert(request.num_experts(), world_size));
  RETURN_IF_ERROR(
      MatchesConfiguredModel("hidden_size", model.hidden_size(), request.hidden_size()));
  RETURN_IF_ERROR(
      MatchesConfiguredModel("num_experts", model.num_experts(), request.num_experts()));
  RETURN_IF_ERROR(MatchesConfiguredModel("top_k", model.top_k(), request.top_k()));
  core::EpDispatcherOptions options;
  options.workspace.ep_size = world_size;
  options.workspace.capacity_tokens = capacity;
  options.workspace.hidden = request.hidden_size();
  options.workspace.top_k = request.top_k();
  options.workspace.dtype = dtype;
  options.num_experts = request.num_experts();
  options.invalid_expert_id = invalid_id;
  options.cuda_graph_buckets = buckets;
  options.redundant_slots_per_rank = request.redundant_slots_per_rank();
  return options;
}

std::vector<BallotField> AllocationFields(const core::EpDispatcherOptions& options) {
  return {{"hidden_size", options.workspace.hidden},
          {"top_k", options.workspace.top_k},
          {"num_experts", options.num_experts},
          {"capacity_tokens", options.workspace.capacity_tokens},
          {"dispatch_dtype", static_cast<int64_t>(options.workspace.dtype)},
          {"invalid_expert_id", options.invalid_expert_id},
          Text("cuda_graph_buckets", absl::StrJoin(options.cuda_graph_buckets, ":")),
          {"redundant_slots_per_rank", options.redundant_slots_per_rank}};
}

uint64_t AllocationFingerprint(const core::EpDispatcherOptions& options) {
  return Fingerprint64(absl::StrCat("H=", options.workspace.hidden, ",K=", options.workspace.top_k,
                                    ",experts=", options.num_experts,
                                    ",N=", options.workspace.capacity_tokens,
                                    ",dtype=", core::DispatchDTypeName(options.workspace.dtype),
                                    ",invalid=", options.invalid_expert_id,
                                    ",buckets=", absl::StrJoin(options.cuda_graph_buckets, ":"),
                                    ",redundant=", options.redundant_slots_per_rank));
}

absl::StatusOr<ExpertLoad> ExpertLoadFromRequest(const RequestLimits& limits,
                                                 const v1::LoadExpertsRequest& request,
                                                 const ExpertLoadContext& context) {
  RETURN_IF_ERROR(CheckLoadExperts(limits, request));
  RETURN_IF_ERROR(NonNegative("layer", request.layer()));
  if (request.kind() != v1::EXPERT_KIND_SWIGLU && request.kind() != v1::EXPERT_KIND_IDENTITY &&
      request.kind() != v1::EXPERT_KIND_FP8_BLOCK_SWIGLU &&
      request.kind() != v1::EXPERT_KIND_MXFP4_GPT_OSS) {
    return absl::InvalidArgumentError(
        absl::StrCat("kind: expected EXPERT_KIND_SWIGLU, EXPERT_KIND_IDENTITY, "
                     "EXPERT_KIND_FP8_BLOCK_SWIGLU or EXPERT_KIND_MXFP4_GPT_OSS, got ",
                     request.kind()));
  }
  RETURN_IF_ERROR(NonNegative("intermediate_size", request.intermediate_size()));
  if (!(request.swiglu_limit() >= 0.0f) || std::isinf(request.swiglu_limit())) {
    return absl::InvalidArgumentError(absl::StrCat(
        "swiglu_limit: expected a finite value >= 0 (0 = 7.0), got ", request.swiglu_limit()));
  }
  if (!request.safetensors_path().empty() && request.kind() == v1::EXPERT_KIND_IDENTITY) {
    return absl::InvalidArgumentError(
        "safetensors_path: checkpoints hold SwiGLU experts; set kind EXPERT_KIND_SWIGLU (or "
        "its fp8 / mxfp4 kind)");
  }
  if (!request.safetensors_path().empty() && request.name_pattern().empty() &&
      request.kind() != v1::EXPERT_KIND_MXFP4_GPT_OSS) {
    return absl::InvalidArgumentError(
        "name_pattern: required with safetensors_path, e.g. "
        "\"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight\"");
  }
  ExpertLoad load;
  load.layer = request.layer();
  load.identity = request.kind() == v1::EXPERT_KIND_IDENTITY;
  load.weight_format = request.kind() == v1::EXPERT_KIND_FP8_BLOCK_SWIGLU
                           ? core::quant::ExpertWeightFormat::kFp8Block128
                       : request.kind() == v1::EXPERT_KIND_MXFP4_GPT_OSS
                           ? core::quant::ExpertWeightFormat::kMxfp4
                           : core::quant::ExpertWeightFormat::kBf16;
  if (request.swiglu_limit() > 0.0f) load.swiglu_limit = request.swiglu_limit();
  load.router_weight_scales_input = request.router_weight_scales_input();
  if (!request.safetensors_path().empty()) {
    // Canonical, under --checkpoint-dir (server/path_policy.h).
    ASSIGN_OR_RETURN(load.checkpoint,
                     ResolveCheckpointPath(context.checkpoint_dirs, request.safetensors_path(),
                                           limits.max_file_bytes));
  }
  const std::vector<core::LayerPlan>& plan = *context.plan;
  if (request.layer() >= static_cast<int>(plan.size())) {
    return absl::InvalidArgumentError(absl::StrCat("layer: expected in [0, ", plan.size(),
                                                   ") (the configured layers), got ",
                                                   request.layer()));
  }
  if (!plan[request.layer()].sparse) {
    return absl::InvalidArgumentError(
        absl::StrCat("layer: ", request.layer(),
                     " is a dense layer in the configured plan; only MoE layers "
                     "have experts"));
  }
  const core::EpDispatcherOptions& options = *context.allocation;
  const int64_t hidden = options.workspace.hidden;
  int64_t intermediate = request.intermediate_size();
  if (!load.identity && intermediate == 0) {
    intermediate = context.model->moe_intermediate_size();
    if (intermediate == 0) {
      return absl::InvalidArgumentError(
          "intermediate_size: required for EXPERT_KIND_SWIGLU (the configured model has no "
          "moe_intermediate_size)");
    }
  }
  RETURN_IF_ERROR(Positive("intermediate_size", load.identity ? 1 : intermediate, kMaxHidden * 16));
  load.intermediate = load.identity ? 0 : intermediate;
  if (context.placement != nullptr) {
    load.slot_experts = context.placement->SlotExperts(context.rank);
    load.expert_ids = core::DistinctSlotExperts(*context.placement, context.rank);
  } else {
    ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                     core::ExpertPlacement::Contiguous(options.num_experts, context.world_size));
    for (int i = 0; i < placement.NumLocalExperts(context.rank); ++i) {
      load.expert_ids.push_back(placement.FirstExpert(context.rank) + i);
    }
    load.slot_experts = load.expert_ids;
  }
  load.first_expert = load.expert_ids.front();
  load.num_local_experts = static_cast<int>(load.expert_ids.size());
  if (load.weight_format == core::quant::ExpertWeightFormat::kMxfp4 &&
      (hidden % core::quant::kMxfp4Block != 0 || intermediate % core::quant::kMxfp4Block != 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "kind: EXPERT_KIND_MXFP4_GPT_OSS needs hidden and intermediate_size multiples of 32 "
        "(the mxfp4 block), got ",
        hidden, " and ", intermediate));
  }
  // Weight bytes the new set will hold, in their format.
  load.weight_bytes =
      load.identity ? 0
                    : int64_t{load.num_local_experts} *
                          core::quant::ExpertWeightBytes(load.weight_format, hidden, intermediate);
  return load;
}

std::vector<BallotField> ExpertLoadFields(const v1::LoadExpertsRequest& request,
                                          const ExpertLoad& load) {
  return {{"layer", load.layer},
          {"kind", request.kind()},
          {"intermediate_size", load.intermediate},
          {"seed", static_cast<int64_t>(request.seed())},
          Text("safetensors_path", request.safetensors_path()),
          Text("name_pattern", request.name_pattern()),
          {"swiglu_limit (x 1e6)", static_cast<int64_t>(std::llround(load.swiglu_limit * 1e6))},
          {"router_weight_scales_input", load.router_weight_scales_input ? 1 : 0}};
}

absl::Status CheckSyncTokenCounts(const v1::SyncTokenCountsRequest& request) {
  RETURN_IF_ERROR(NonNegative("epoch", request.epoch()));
  return NonNegative("local_tokens", request.local_tokens());
}

absl::Status CheckCommitGeometry(const v1::CommitGeometryRequest& request) {
  RETURN_IF_ERROR(NonNegative("epoch", request.epoch()));
  RETURN_IF_ERROR(
      NonNegative("runtime_max_tokens_per_rank", request.runtime_max_tokens_per_rank()));
  return NonNegative("local_tokens", request.local_tokens());
}

absl::StatusOr<ForwardInputs> ForwardFromRequest(const RequestLimits& limits,
                                                 const v1::ForwardRequest& request,
                                                 const core::EpDispatcherOptions& allocation) {
  RETURN_IF_ERROR(CheckForward(limits, request));
  RETURN_IF_ERROR(NonNegative("layer", request.layer()));
  RETURN_IF_ERROR(NonNegative("epoch", request.epoch()));
  ForwardInputs in;
  in.layer = request.layer();
  in.epoch = request.epoch();
  const v1::Tensor& hidden = request.hidden_states();
  const v1::Tensor& ids = request.topk_ids();
  const v1::Tensor& weights = request.topk_weights();
  ASSIGN_OR_RETURN(in.tensors.hidden,
                   ValidateTensorOf(hidden, "hidden_states", 2, {v1::DTYPE_BF16, v1::DTYPE_FP32},
                                    "bf16 or fp32"));
  in.tensors.hidden_fp32 = hidden.dtype() == v1::DTYPE_FP32;
  ASSIGN_OR_RETURN(in.tensors.topk_ids,
                   ValidateTensorOf(ids, "topk_ids", 2, {v1::DTYPE_INT32}, "int32"));
  ASSIGN_OR_RETURN(in.tensors.topk_weights,
                   ValidateTensorOf(weights, "topk_weights", 2, {v1::DTYPE_FP32}, "fp32"));
  in.tokens = hidden.shape(0);
  if (ids.shape(0) != in.tokens) {
    return absl::InvalidArgumentError(absl::StrCat("topk_ids.shape[0]: expected ", in.tokens,
                                                   " (hidden_states rows), got ", ids.shape(0)));
  }
  if (weights.shape(0) != ids.shape(0) || weights.shape(1) != ids.shape(1)) {
    return absl::InvalidArgumentError(
        absl::StrCat("topk_weights.shape: expected [", absl::StrJoin(ids.shape(), ", "),
                     "] (topk_ids' shape), got [", absl::StrJoin(weights.shape(), ", "), "]"));
  }
  if (hidden.shape(1) != allocation.workspace.hidden) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_states.shape[1]: expected ", allocation.workspace.hidden,
                     " (the allocated hidden_size), got ", hidden.shape(1)));
  }
  if (ids.shape(1) != allocation.workspace.top_k) {
    return absl::InvalidArgumentError(absl::StrCat("topk_ids.shape[1]: expected ",
                                                   allocation.workspace.top_k,
                                                   " (the allocated top_k), got ", ids.shape(1)));
  }
  // DESIGN §7 on every plane: only the configured invalid id is padding
  // (issue 30). A copy, as the message's bytes need not be 4-byte aligned.
  std::vector<int32_t> id_values(in.tensors.topk_ids.size() / sizeof(int32_t));
  std::memcpy(id_values.data(), in.tensors.topk_ids.data(), id_values.size() * sizeof(int32_t));
  RETURN_IF_ERROR(core::ValidateExpertIds(id_values, allocation.workspace.top_k,
                                          allocation.num_experts, allocation.invalid_expert_id));
  return in;
}

std::vector<BallotField> ForwardFields(const ForwardInputs& inputs) {
  return {{"layer", inputs.layer}, {"epoch", inputs.epoch}};
}

absl::StatusOr<BenchmarkSpec> BenchmarkFromRequest(const RequestLimits& limits,
                                                   const v1::BenchmarkRequest& request,
                                                   int world_size) {
  RETURN_IF_ERROR(CheckBenchmark(limits, request));
  RETURN_IF_ERROR(Positive("tokens_per_rank", request.tokens_per_rank(),
                           std::min<int64_t>(kMaxTokens, limits.max_tokens)));
  RETURN_IF_ERROR(
      CheckMoeSizes(limits, request.hidden_size(), request.num_experts(), request.top_k()));
  RETURN_IF_ERROR(Positive("iterations", request.iterations(),
                           std::min<int64_t>(kMaxBenchmarkIterations, limits.max_iterations)));
  RETURN_IF_ERROR(NonNegative("warmup", request.warmup()));
  if (request.warmup() > kMaxBenchmarkIterations) {
    return absl::InvalidArgumentError(
        absl::StrCat("warmup: expected <= ", kMaxBenchmarkIterations, ", got ", request.warmup()));
  }
  BenchmarkSpec spec;
  ASSIGN_OR_RETURN(spec.routing, ParseBenchmarkRouting(request.routing()));
  RETURN_IF_ERROR(CheckEveryRankOwnsAnExpert(request.num_experts(), world_size));
  spec.options.workspace.ep_size = world_size;
  spec.options.workspace.capacity_tokens = request.tokens_per_rank();
  spec.options.workspace.hidden = request.hidden_size();
  spec.options.workspace.top_k = request.top_k();
  spec.options.workspace.dtype = core::DispatchDType::kBF16;
  spec.options.num_experts = request.num_experts();
  spec.warmup = request.warmup();
  spec.iterations = request.iterations();
  spec.seed = request.seed();
  const std::string& plane = request.data_plane();
  if (!plane.empty() && plane != "gloo" && plane != "one-sided" && plane != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("data_plane: expected \"\" (the group's), \"gloo\", \"one-sided\" or "
                     "\"nccl\", got \"",
                     plane.substr(0, 64), "\""));
  }
  spec.data_plane = plane;
  return spec;
}

std::vector<BallotField> BenchmarkFields(const BenchmarkSpec& spec) {
  return {{"tokens_per_rank", spec.options.workspace.capacity_tokens},
          {"hidden_size", spec.options.workspace.hidden},
          {"num_experts", spec.options.num_experts},
          {"top_k", spec.options.workspace.top_k},
          {"iterations", spec.iterations},
          {"warmup", spec.warmup},
          {"routing", static_cast<int64_t>(spec.routing)},
          {"data_plane (0 = the group's, 1 = gloo, 2 = one-sided, 3 = nccl)",
           spec.data_plane == "gloo"        ? 1
           : spec.data_plane == "one-sided" ? 2
           : spec.data_plane == "nccl"      ? 3
                                            : 0}};
}

namespace {

core::ExpertSource RangeExpertSource(const ExpertLoad& load, const v1::LoadExpertsRequest& request,
                                     const core::EpDispatcherOptions& options) {
  const int64_t hidden = options.workspace.hidden;
  if (load.identity) {
    return core::ExpertSource::Identity(load.layer, options.num_experts, load.first_expert,
                                        load.num_local_experts, hidden);
  }
  if (!load.checkpoint.empty()) {
    return core::ExpertSource::Safetensors(load.checkpoint, request.name_pattern(), load.layer,
                                           options.num_experts, load.first_expert,
                                           load.num_local_experts, hidden, load.intermediate);
  }
  return core::ExpertSource::Seeded(request.seed(), load.layer, options.num_experts,
                                    load.first_expert, load.num_local_experts, hidden,
                                    load.intermediate);
}

}  // namespace

core::ExpertSource MakeExpertSource(const ExpertLoad& load, const v1::LoadExpertsRequest& request,
                                    const core::EpDispatcherOptions& options) {
  core::ExpertSource source = RangeExpertSource(load, request, options);
  source.weight_format = load.weight_format;
  source.gpt_oss_activation.limit = load.swiglu_limit;
  source.router_weight_use = load.router_weight_scales_input ? core::RouterWeightUse::kScalesInput
                                                             : core::RouterWeightUse::kScalesOutput;
  const std::vector<int>& ids = load.expert_ids;
  const bool is_range = ids.empty() || ids.back() - ids.front() + 1 == static_cast<int>(ids.size());
  return is_range ? source : source.WithExperts(ids);
}

absl::StatusOr<core::PlacementTable> PlacementFromRequest(
    const RequestLimits& limits, const v1::InstallPlacementRequest& request,
    const std::vector<core::LayerPlan>& plan, const core::EpDispatcherOptions& allocation,
    int world_size) {
  RETURN_IF_ERROR(NonNegative("layer", request.layer()));
  if (request.layer() >= static_cast<int>(plan.size()) || !plan[request.layer()].sparse) {
    return absl::InvalidArgumentError(absl::StrCat("layer: expected a configured MoE layer in [0, ",
                                                   plan.size(), "), got ", request.layer()));
  }
  if (request.ranks_size() != world_size) {
    return absl::InvalidArgumentError(absl::StrCat("ranks: expected one entry per rank (",
                                                   world_size, "), got ", request.ranks_size()));
  }
  std::vector<std::vector<int>> slots(world_size);
  for (int r = 0; r < world_size; ++r) {
    const auto& given = request.ranks(r).slot_experts();
    if (given.size() > limits.max_experts) {
      return absl::InvalidArgumentError(
          absl::StrCat("ranks[", r, "].slot_experts: at most --max-experts = ", limits.max_experts,
                       " slots a rank, got ", given.size()));
    }
    slots[r].assign(given.begin(), given.end());
  }
  ASSIGN_OR_RETURN(core::PlacementTable table,
                   core::PlacementTable::FromSlotExperts(allocation.num_experts, std::move(slots)));
  if (request.fingerprint() != 0 && request.fingerprint() != table.Fingerprint()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fingerprint: the table's is ", absl::Hex(table.Fingerprint(), absl::kZeroPad16),
        ", the request says ", absl::Hex(request.fingerprint(), absl::kZeroPad16)));
  }
  RETURN_IF_ERROR(core::ValidatePlacement(table, allocation));
  return table;
}

std::vector<BallotField> PlacementFields(int layer, const core::PlacementTable& table) {
  BallotField fingerprint{"placement_fingerprint", static_cast<int64_t>(table.Fingerprint()), true};
  return {{"layer", layer}, fingerprint};
}

}  // namespace moe_ep::server
