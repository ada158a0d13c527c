#include "client/run_job.h"

#include <unistd.h>

#include <algorithm>
#include <csignal>
#include <functional>
#include <optional>
#include <random>
#include <set>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/coordinator.h"
#include "client/expert_rebalance.h"
#include "client/group_session.h"
#include "client/memory_budget.h"
#include "client/model_source.h"
#include "client/placement_request.h"
#include "client/plan_command.h"
#include "client/run_masks.h"
#include "client/streamed_reference.h"
#include "client/targets.h"
#include "client/tensor_message.h"
#include "client/text_table.h"
#include "core/dispatch_rounding.h"
#include "core/expert_source.h"
#include "core/experts.h"
#include "core/host_memory.h"
#include "core/quantized_weights.h"
#include "core/routing_source.h"
#include "core/shared_expert.h"
#include "core/status_macros.h"

namespace moe_ep::client {
namespace {

// splitmix64: decorrelates the seeds of (seed, step, rank) streams.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

double Seconds(absl::Duration d) { return absl::ToDoubleSeconds(d); }

// What one (step, rank) fed into one layer and got back.
struct RankStep {
  int64_t num_tokens = 0;
  std::vector<core::bf16_t> input;   // [T, H]
  std::vector<int32_t> ids;          // [T, K]
  std::vector<float> weights;        // [T, K]
  std::vector<core::bf16_t> output;  // [T, H]
};

// After step --rebalance-after: every run layer's counts so far (read and
// reset), an EPLB table for the slot budget, installed, the layer's experts
// loaded again for the new slots.
absl::StatusOr<std::vector<LayerRebalance>> RebalanceRunLayers(
    Coordinator& coordinator, const std::vector<int>& layers, int num_experts, int world,
    int redundant, const std::function<v1::LoadExpertsRequest(int)>& load_request,
    std::ostream& out) {
  ASSIGN_OR_RETURN(core::PlacementTable contiguous,
                   core::PlacementTable::Contiguous(num_experts, world));
  std::vector<LayerRebalance> done;
  for (int layer : layers) {
    v1::GetExpertLoadRequest read;
    read.set_layer(layer);
    read.set_reset(true);
    ASSIGN_OR_RETURN(std::vector<v1::GetExpertLoadResponse> load, coordinator.GetExpertLoad(read));
    ASSIGN_OR_RETURN(std::vector<double> tokens, SumExpertLoad(load, num_experts));
    ASSIGN_OR_RETURN(core::PlacementTable table, RebalanceForBudget(tokens, world, redundant));
    LayerRebalance l;
    l.layer = layer;
    ASSIGN_OR_RETURN(l.before, BalanceOf(contiguous, tokens));
    ASSIGN_OR_RETURN(l.predicted, BalanceOf(table, tokens));
    l.slots_per_rank = table.NumSlots(0);
    l.redundant_slots_per_rank = redundant;
    l.fingerprint = table.Fingerprint();
    for (int r = 0; r < world; ++r) l.slot_experts.push_back(table.SlotExperts(r));
    const absl::Time start = absl::Now();
    RETURN_IF_ERROR(
        coordinator.InstallPlacement(MakeInstallPlacementRequest(layer, table)).status());
    RETURN_IF_ERROR(coordinator.LoadExperts(load_request(layer)).status());
    out << absl::StrFormat(
        "rebalance: layer %d, EPLB table %016x (%d slots on %d ranks) installed and experts "
        "reloaded in %.2f s; max/mean tokens per rank %.4f -> %.4f predicted\n",
        layer, l.fingerprint, table.num_slots(), world, Seconds(absl::Now() - start),
        l.before.ratio(), l.predicted.ratio());
    done.push_back(l);
  }
  out.flush();
  return done;
}

// The counts of the steps after the rebalance, under each layer's new table.
absl::Status ReadLoadAfterRebalance(Coordinator& coordinator, int num_experts,
                                    std::vector<LayerRebalance>* layers) {
  for (LayerRebalance& l : *layers) {
    v1::GetExpertLoadRequest read;
    read.set_layer(l.layer);
    read.set_reset(true);
    ASSIGN_OR_RETURN(std::vector<v1::GetExpertLoadResponse> load, coordinator.GetExpertLoad(read));
    ASSIGN_OR_RETURN(std::vector<double> tokens, SumExpertLoad(load, num_experts));
    ASSIGN_OR_RETURN(core::PlacementTable table,
                     core::PlacementTable::FromSlotExperts(num_experts, l.slot_experts));
    ASSIGN_OR_RETURN(l.after, BalanceOf(table, tokens));
  }
  return absl::OkStatus();
}

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

absl::Status ValidateRunJobOptions(const RunJobOptions& o) {
  if (o.num_layers < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--layers: expected >= 1, got ", o.num_layers));
  }
  if (o.tokens_per_rank < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tokens: expected >= 1 (mean tokens per rank), got ", o.tokens_per_rank));
  }
  if (o.steps < 1) {
    return absl::InvalidArgumentError(absl::StrCat("--steps: expected >= 1, got ", o.steps));
  }
  if (o.capacity_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--capacity: expected >= 0 (0 = automatic), got ", o.capacity_tokens));
  }
  if (o.experts != "swiglu" && o.experts != "identity" && o.experts != "checkpoint") {
    return absl::InvalidArgumentError(
        absl::StrCat("--experts: expected swiglu, identity or checkpoint, got '", o.experts, "'"));
  }
  if (o.redundant_slots_per_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("--redundant-slots: expected >= 0, got ", o.redundant_slots_per_rank));
  }
  if (o.rebalance_after_steps < 0 || o.rebalance_after_steps >= o.steps) {
    return absl::InvalidArgumentError(
        absl::StrCat("--rebalance-after: expected in [0, --steps - 1 = ", o.steps - 1,
                     "] (0 = never), got ", o.rebalance_after_steps));
  }
  if (o.attach && o.workers.targets.empty()) {
    return absl::InvalidArgumentError(
        "--attach: needs --targets (the running workers of a formed group, in rank order)");
  }
  if (o.attach && (o.rebalance_after_steps > 0 || o.redundant_slots_per_rank > 0)) {
    return absl::InvalidArgumentError(
        "--attach: drives steps only; --rebalance-after and --redundant-slots change the "
        "group's placement and workspace (the owner's calls)");
  }
  if (o.rebalance_after_steps > 0 && o.redundant_slots_per_rank == 0) {
    return absl::InvalidArgumentError(
        "--rebalance-after: needs --redundant-slots >= 1 (EPLB replicates the hottest experts "
        "into the redundant slots)");
  }
  if ((o.kill_rank >= 0) != (o.kill_at_step > 0) || o.kill_rank < -1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kill-rank and --kill-at-step: give both (a rank >= 0 and a step >= 1) or neither, got "
        "rank ",
        o.kill_rank, " and step ", o.kill_at_step));
  }
  if (o.kill_at_step > o.steps) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kill-at-step: expected in [1, --steps = ", o.steps, "], got ", o.kill_at_step));
  }
  if (o.restart_at_step != 0 &&
      (o.kill_at_step == 0 || o.restart_at_step <= o.kill_at_step || o.restart_at_step > o.steps)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--restart-at-step: expected in (--kill-at-step, --steps] = (", o.kill_at_step,
                     ", ", o.steps, "], got ", o.restart_at_step));
  }
  if (o.kill_rank >= 0 && (!o.workers.targets.empty() || o.attach || o.rebalance_after_steps > 0)) {
    return absl::InvalidArgumentError(
        "--kill-rank: kills one of the local workers this run starts; not with --targets, "
        "--attach or --rebalance-after");
  }
  if (!(o.tolerance.rel >= 0) || !(o.tolerance.atol >= 0)) {
    return absl::InvalidArgumentError(absl::StrCat("tolerance: expected rel, atol >= 0, got ",
                                                   o.tolerance.rel, ", ", o.tolerance.atol));
  }
  if (o.dispatch_dtype != core::DispatchDType::kBF16 &&
      o.dispatch_dtype != core::DispatchDType::kFP8E4M3) {
    return absl::InvalidArgumentError(
        absl::StrCat("--dispatch-dtype: expected bf16 or fp8_e4m3, got ",
                     core::DispatchDTypeName(o.dispatch_dtype)));
  }
  return absl::OkStatus();
}

std::vector<int64_t> PlanTokenCounts(int64_t tokens_per_rank, int world, int64_t step,
                                     uint64_t seed) {
  std::vector<int64_t> counts(std::max(world, 0), tokens_per_rank);
  if (world < 2) return counts;
  std::mt19937_64 rng(Mix(seed ^ Mix(static_cast<uint64_t>(step) + 0x5eedull)));
  std::uniform_int_distribution<int64_t> dist(tokens_per_rank / 2,
                                              tokens_per_rank + tokens_per_rank / 2);
  const int zero_rank = static_cast<int>((world - 1 + step) % world);
  for (int r = 0; r < world; ++r) counts[r] = r == zero_rank ? 0 : dist(rng);
  return counts;
}

std::vector<core::bf16_t> GenerateHidden(uint64_t seed, int64_t step, int rank, int64_t num_tokens,
                                         int64_t hidden) {
  std::mt19937_64 rng(Mix(Mix(seed) ^ Mix((static_cast<uint64_t>(step) << 20) ^
                                          static_cast<uint64_t>(rank) ^ 0x41dd3ull)));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<core::bf16_t> out(static_cast<size_t>(num_tokens * hidden));
  for (auto& v : out) v = core::FloatToBf16(dist(rng));
  return out;
}

int64_t ExpertBytesPerLayer(const core::ModelDescription& model,
                            core::quant::ExpertWeightFormat format) {
  return int64_t{model.num_experts} *
         core::quant::ExpertWeightBytes(format, model.hidden_size, model.moe_intermediate_size);
}

bool RunJobResult::AllPass() const {
  return std::all_of(layers.begin(), layers.end(),
                     [](const LayerRunSummary& l) { return l.comparison.pass; });
}

absl::StatusOr<RunJobResult> RunJob(const RunJobOptions& options, std::ostream& out) {
  // Everything that can be checked without workers first.
  RETURN_IF_ERROR(ValidateRunJobOptions(options));
  ASSIGN_OR_RETURN(core::ModelDescription model, ResolveModel(options.model));
  const std::vector<int> sparse = model.SparseLayerIndices();
  if (options.num_layers > static_cast<int>(sparse.size())) {
    return absl::InvalidArgumentError(absl::StrCat("--layers: ", model.name, " has ", sparse.size(),
                                                   " MoE layers, asked for ", options.num_layers));
  }
  const std::vector<int> run_layers(sparse.begin(), sparse.begin() + options.num_layers);
  core::RoutingSourceOptions routing_options;
  routing_options.kind = options.routing;
  routing_options.num_experts = model.num_experts;
  routing_options.top_k = model.top_k;
  routing_options.seed = options.seed;
  ASSIGN_OR_RETURN(core::RoutingSource routing, core::RoutingSource::Create(routing_options));
  const bool identity = options.experts == "identity";
  // --experts checkpoint: the format of the model's quantization_config
  // (issue 35; fp8 and mxfp4 on the gloo plane); swiglu: bf16.
  const core::quant::ExpertWeightFormat format = options.experts == "checkpoint"
                                                     ? model.quantization.expert_format
                                                     : core::quant::ExpertWeightFormat::kBf16;
  // Llama-4: the router weight scales the expert's input (issue 35 item 5).
  const bool scale_input =
      model.router_weight_use == core::RouterWeightUse::kScalesInput && !identity;
  const int64_t H = model.hidden_size;
  const int K = model.top_k;

  out << "moe-ep run: " << model.name << " (hidden " << H << ", " << model.num_experts
      << " experts, top-" << K << ", expert intermediate " << model.moe_intermediate_size << ", "
      << model.num_layers << " layers, " << sparse.size() << " MoE); running MoE layers "
      << absl::StrJoin(run_layers, ",") << " with " << options.experts << " experts, routing "
      << options.routing << ", " << options.steps << " step(s), seed " << options.seed << "\n";
  out << DescribeSharedExperts(model) << "\n" << DescribeQuantization(model) << "\n";
  if (!identity) {
    out << "routed experts run as " << core::quant::ExpertWeightFormatName(format)
        << (options.experts == "checkpoint" ? " (the checkpoint's format)" : "") << "\n";
  }
  const core::SharedExpertConfig& shared = model.shared_expert;
  if (scale_input) {
    out << "note: " << model.model_type
        << " scales an expert's input by its router score: the workers and the reference "
           "compute e(w * x) (the gloo plane; the GPU planes refuse it for now)\n";
  }

  // The group's size, known before any worker starts.
  const bool local = options.workers.targets.empty();
  if (local && options.workers.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers: expected >= 1, got ", options.workers.num_workers));
  }
  // With GPUs and --backend auto/nccl, one worker per GPU (PlanWorkers).
  ASSIGN_OR_RETURN(LocalWorkerPlan worker_plan, PlanWorkers(options.workers));
  const int world = worker_plan.num_workers;
  if (model.num_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat("--workers: ", model.name, " has ",
                                                   model.num_experts, " experts, fewer than the ",
                                                   world, " ranks"));
  }
  // Token counts of every step, known up front (capacity N must bound them).
  std::vector<std::vector<int64_t>> counts(options.steps);
  int64_t max_count = 0, rows_per_layer = 0, max_step_rows = 0;
  for (int s = 0; s < options.steps; ++s) {
    counts[s] = routing.prescribes_token_counts() ? routing.TokensPerRank(s, world)
                : options.even_tokens
                    ? std::vector<int64_t>(world, options.tokens_per_rank)
                    : PlanTokenCounts(options.tokens_per_rank, world, s, options.seed);
    int64_t step_rows = 0;
    for (int64_t c : counts[s]) {
      max_count = std::max(max_count, c);
      step_rows += c;
    }
    rows_per_layer += step_rows;
    max_step_rows = std::max(max_step_rows, step_rows);
  }
  const bool kills = options.kill_rank >= 0;
  if (kills && (world < 2 || options.kill_rank >= world)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kill-rank: expected a rank in [0, ", world, ") of at least 2 workers, got ",
        options.kill_rank,
        world < 2 && worker_plan.one_per_gpu
            ? " (with a GPU, backend auto/nccl runs one local worker per GPU: this machine has "
              "one; use --backend gloo)"
            : ""));
  }
  // The killed rank's tokens are gone while it is masked.
  const auto masked_step = [&](int s) {
    return kills && s + 1 >= options.kill_at_step &&
           (options.restart_at_step == 0 || s + 1 < options.restart_at_step);
  };
  for (int s = 0; s < options.steps; ++s) {
    if (masked_step(s)) counts[s][options.kill_rank] = 0;
  }
  const int64_t capacity =
      options.capacity_tokens > 0 ? options.capacity_tokens : std::max<int64_t>(max_count, 1);

  // Memory preflight: fail here, before anything is allocated, when the run
  // cannot fit on this machine.
  RunMemoryInput memory_input;
  memory_input.num_experts = model.num_experts;
  memory_input.hidden = H;
  memory_input.intermediate = model.moe_intermediate_size;
  memory_input.top_k = K;
  memory_input.world = world;
  memory_input.num_local_workers = local ? world : 0;
  memory_input.num_layers = options.num_layers;
  memory_input.identity = identity;
  memory_input.redundant_slots_per_rank = options.redundant_slots_per_rank;
  memory_input.capacity_tokens = capacity;
  memory_input.rows_per_layer = rows_per_layer;
  memory_input.max_step_rows = max_step_rows;
  memory_input.weight_format = format;
  ASSIGN_OR_RETURN(RunMemoryEstimate memory, EstimateRunMemory(memory_input));
  WorkerSelection selection = options.workers;
  const absl::StatusOr<int64_t> available = core::AvailableMemoryBytes();
  if (available.ok()) {
    RETURN_IF_ERROR(CheckRunMemory(memory_input, *available));
    selection.worker_memory_cap_bytes =
        LocalWorkerMemoryCapBytes(memory, memory_input.num_local_workers, *available);
    out << "memory: needs about " << FormatBytes(static_cast<double>(memory.needed_bytes))
        << " here (";
    if (local) {
      out << world << " local worker(s) x " << FormatBytes(static_cast<double>(memory.worker_bytes))
          << ", capped at " << FormatBytes(static_cast<double>(selection.worker_memory_cap_bytes))
          << " each; ";
    }
    out << "this process " << FormatBytes(static_cast<double>(memory.coordinator_bytes));
    if (!identity) {
      out << " with a reference chunk of " << memory.reference_chunk_experts << " expert(s)";
    }
    out << ") of " << FormatBytes(static_cast<double>(*available)) << " available\n";
  } else {
    out << "memory: preflight skipped (" << available.status().message()
        << "); local workers run uncapped\n";
  }

  out.flush();
  ASSIGN_OR_RETURN(AttachedWorkers workers, AttachWorkers(selection));
  if (static_cast<int>(workers.targets.size()) != world) {
    return absl::InternalError(
        absl::StrCat("AttachWorkers: expected ", world, " workers, got ", workers.targets.size()));
  }

  CoordinatorOptions copts;
  copts.rpc_timeout = options.rpc_timeout;
  // A kill needs the survivors to mask it (every rank's address at Join).
  copts.rank_masks = kills;
  if (kills) copts.group_timeout = absl::Seconds(10);
  RankSetup setup;  // what a restarted rank is sent (RejoinRank)
  GroupSession group;
  std::vector<v1::GetStatusResponse> attached;  // --attach: each rank's GetStatus
  if (options.attach) {
    // The group the workers already form (issue 12 item 6): steps only.
    ASSIGN_OR_RETURN(attached, AttachFormedGroup(workers, copts, max_count, &group.coordinator));
    out << "group: attached to the " << world << " workers' group of generation "
        << attached[0].generation() << " (backend " << attached[0].backend() << ", workspace "
        << attached[0].capacity_tokens()
        << " tokens/rank; not configured, allocated or loaded here): "
        << absl::StrJoin(workers.targets, " ") << "\n";
    out.flush();
  } else {
    ASSIGN_OR_RETURN(group, FormWorkerGroup(workers, copts));
    out << "group: " << world << " workers ("
        << (workers.cluster ? "embedded local cluster" : "--targets") << ", backend "
        << group.joined[0].backend() << ", generation " << group.coordinator->generation()
        << "): " << absl::StrJoin(workers.targets, " ") << "\n";

    // Every backend's plane masks (Gloo, NCCL, one-sided: DESIGN §15); the
    // kill and the restart need workers this run started.
    if (kills && workers.cluster == nullptr) {
      return absl::InvalidArgumentError(
          absl::StrCat("--kill-rank: kills a local worker this run starts; the group of backend ",
                       group.joined[0].backend(), " was not started here"));
    }
    RETURN_IF_ERROR(ConfigureRunGroup(*group.coordinator, model, world, capacity,
                                      options.redundant_slots_per_rank, options.dispatch_dtype, out,
                                      &setup));
  }
  Coordinator* const coordinator = group.coordinator.get();
  RunJobResult result;
  result.model_name = model.name;
  result.shared_expert = shared;
  result.routed_scaling_factor = model.routed_scaling_factor;
  result.world = world;
  result.steps = options.steps;
  result.expert_bytes_per_rank.assign(world, 0);
  result.layer_expert_bytes = ExpertBytesPerLayer(model, format);
  result.num_sparse_layers = static_cast<int>(sparse.size());
  result.tolerance = options.tolerance;
  result.identity_experts = identity;
  result.dispatch_dtype = options.dispatch_dtype;
  result.memory = memory;
  result.memory_available_bytes = available.ok() ? *available : 0;
  const auto load_request = [&](int layer) {
    v1::LoadExpertsRequest load;
    load.set_layer(layer);
    load.set_kind(
        identity                                                  ? v1::EXPERT_KIND_IDENTITY
        : format == core::quant::ExpertWeightFormat::kFp8Block128 ? v1::EXPERT_KIND_FP8_BLOCK_SWIGLU
        : format == core::quant::ExpertWeightFormat::kMxfp4       ? v1::EXPERT_KIND_MXFP4_GPT_OSS
                                                                  : v1::EXPERT_KIND_SWIGLU);
    load.set_swiglu_limit(static_cast<float>(model.swiglu_limit));
    load.set_router_weight_scales_input(scale_input);
    load.set_seed(options.seed);
    load.set_intermediate_size(model.moe_intermediate_size);
    if (shared.present()) {
      load.mutable_shared_expert()->set_intermediate_size(shared.intermediate_size);
      load.mutable_shared_expert()->set_sigmoid_gate(shared.sigmoid_gate);
    }
    return load;
  };
  // The table a kill run serves by: replicas of the next ranks' experts in
  // the redundant slots (client/run_masks.h), else the contiguous one.
  std::optional<core::PlacementTable> mask_table;
  if (kills) {
    ASSIGN_OR_RETURN(mask_table, options.redundant_slots_per_rank > 0
                                     ? RingReplicaTable(model.num_experts, world,
                                                        options.redundant_slots_per_rank)
                                     : core::PlacementTable::Contiguous(model.num_experts, world));
  }
  for (int layer : run_layers) {
    LayerRunSummary summary;
    summary.layer = layer;
    result.layers.push_back(summary);
    if (options.attach) continue;  // loaded by the group's owner (bytes: below)
    if (kills && options.redundant_slots_per_rank > 0) {
      setup.placements.push_back(MakeInstallPlacementRequest(layer, *mask_table));
      RETURN_IF_ERROR(coordinator->InstallPlacement(setup.placements.back()).status());
      if (layer == run_layers[0]) {
        out << "placement: each worker's " << options.redundant_slots_per_rank
            << " redundant slot(s) replicate the next ranks' experts ("
            << mask_table->CanonicalText() << ")\n";
      }
    }
    setup.loads.push_back(load_request(layer));
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(std::vector<v1::LoadExpertsResponse> loaded,
                     coordinator->LoadExperts(load_request(layer)));
    std::vector<std::string> ranges;
    for (int r = 0; r < world; ++r) {
      result.expert_bytes_per_rank[r] += loaded[r].expert_bytes() + loaded[r].shared_expert_bytes();
      ranges.push_back(absl::StrCat(loaded[r].first_expert(), "..",
                                    loaded[r].first_expert() + loaded[r].num_local_experts() - 1));
    }
    out << absl::StrFormat(
        "experts: layer %d loaded in %.1f s, per worker [%s] (%s each on rank 0)\n", layer,
        Seconds(absl::Now() - start), absl::StrJoin(ranges, ", "),
        FormatBytes(loaded[0].expert_bytes()));
    out.flush();  // progress as it goes: a real model's layer takes seconds
  }

  for (size_t r = 0; r < attached.size(); ++r) {
    result.expert_bytes_per_rank[r] = attached[r].expert_bytes();  // every loaded layer
  }

  // record[layer index][step][rank]
  const int L = options.num_layers;
  std::vector<std::vector<std::vector<RankStep>>> record(
      L, std::vector<std::vector<RankStep>>(options.steps, std::vector<RankStep>(world)));
  std::vector<bool> live(world, true);
  std::set<int> reported_lost;
  for (int s = 0; s < options.steps; ++s) {
    absl::Time restarted;
    if (kills && s + 1 == options.restart_at_step) {
      // The killed worker again, on its address; re-admitted at this step
      // boundary with the group's set-up (client/coordinator.h RejoinRank).
      restarted = absl::Now();
      RETURN_IF_ERROR(workers.cluster->Restart(options.kill_rank));
      ASSIGN_OR_RETURN(v1::RejoinResponse rejoined,
                       coordinator->RejoinRank(options.kill_rank, setup));
      live[options.kill_rank] = true;
      coordinator->SetStepRanks(live);
      result.masks.rejoin_ms = absl::ToDoubleMilliseconds(absl::Now() - restarted);
      out << absl::StrFormat(
          "rank %d: restarted and re-admitted before step %d in %.0f ms (mask round %d, masked "
          "now [%s])\n",
          options.kill_rank, s + 1, result.masks.rejoin_ms, rejoined.mask_round(),
          absl::StrJoin(rejoined.masked_ranks(), ","));
    }
    absl::Time killed;
    if (kills && s + 1 == options.kill_at_step) {
      killed = absl::Now();
      RETURN_IF_ERROR(workers.cluster->Kill(options.kill_rank, SIGKILL));
      live[options.kill_rank] = false;
      coordinator->SetStepRanks(live);
      result.masks.kill_rank = options.kill_rank;
      result.masks.kill_at_step = options.kill_at_step;
      result.masks.restart_at_step = options.restart_at_step;
      result.masks.lost_experts = LostExperts(*mask_table, live);
      out << "rank " << options.kill_rank << ": killed (SIGKILL) before step " << s + 1
          << "; experts with no live replica: [" << absl::StrJoin(result.masks.lost_experts, ",")
          << "]\n";
    }
    int64_t R = 0;
    std::vector<std::string> layer_times;
    const auto run_step = [&]() -> absl::Status {
      const int64_t epoch = s + 1;
      ASSIGN_OR_RETURN(TokenCountSync sync, coordinator->SyncTokenCounts(epoch, counts[s]));
      if (sync.token_counts != counts[s]) {
        return absl::InternalError(
            absl::StrCat("SyncTokenCounts epoch ", epoch, ": workers report counts [",
                         absl::StrJoin(sync.token_counts, ","), "], the coordinator sent [",
                         absl::StrJoin(counts[s], ","), "]"));
      }
      R = sync.runtime_max_tokens_per_rank;
      RETURN_IF_ERROR(coordinator->CommitGeometry(epoch, R, counts[s]));
      std::vector<std::vector<core::bf16_t>> x(world);
      for (int r = 0; r < world; ++r) x[r] = GenerateHidden(options.seed, s, r, counts[s][r], H);
      layer_times.clear();
      for (int li = 0; li < L; ++li) {
        const int layer = run_layers[li];
        std::vector<v1::ForwardRequest> requests(world);
        for (int r = 0; r < world; ++r) {
          RankStep& rs = record[li][s][r];
          rs.num_tokens = counts[s][r];
          rs.input = x[r];
          rs.ids.resize(rs.num_tokens * K);
          rs.weights.resize(rs.num_tokens * K);
          RETURN_IF_ERROR(routing.Generate(layer, s, r, world, rs.num_tokens,
                                           absl::MakeSpan(rs.ids), absl::MakeSpan(rs.weights)));
          // The caller folds the routed scaling into the weights (DESIGN §7).
          if (model.routed_scaling_factor != 1.0) {
            for (float& w : rs.weights) w *= static_cast<float>(model.routed_scaling_factor);
          }
          requests[r].set_layer(layer);
          requests[r].set_epoch(epoch);
          *requests[r].mutable_hidden_states() = MakeBf16Tensor(rs.input, rs.num_tokens, H);
          *requests[r].mutable_topk_ids() = MakeInt32Tensor(rs.ids, rs.num_tokens, K);
          *requests[r].mutable_topk_weights() = MakeFp32Tensor(rs.weights, rs.num_tokens, K);
        }
        const absl::Time start = absl::Now();
        ASSIGN_OR_RETURN(std::vector<v1::ForwardResponse> responses,
                         coordinator->Forward(requests));
        const double elapsed = Seconds(absl::Now() - start);
        LayerRunSummary& summary = result.layers[li];
        summary.forward_s += elapsed;
        summary.max_r = std::max(summary.max_r, R);
        int64_t step_dispatch = 0, step_shared = 0, step_overlap = 0;
        for (const v1::ForwardResponse& response : responses) {
          step_dispatch = std::max(step_dispatch, response.timings().dispatch_us());
          step_shared = std::max(step_shared, response.timings().shared_expert_us());
          step_overlap = std::max(step_overlap, response.timings().shared_overlap_us());
        }
        summary.dispatch_us += step_dispatch;
        summary.shared_us += step_shared;
        summary.shared_overlap_us += step_overlap;
        for (int r = 0; r < world; ++r) {
          RankStep& rs = record[li][s][r];
          if (!live[r]) continue;  // masked: no tokens, no reply
          for (int32_t e : responses[r].lost_experts()) reported_lost.insert(e);
          ASSIGN_OR_RETURN(rs.output,
                           ReadBf16Tensor(responses[r].output(),
                                          absl::StrCat("rank ", r, " layer ", layer, " output"),
                                          rs.num_tokens, H));
          summary.tokens += rs.num_tokens;
          summary.bytes_sent += responses[r].bytes_sent();
          // The residual stream: the next layer sees x + moe(x).
          for (size_t i = 0; i < x[r].size(); ++i) {
            x[r][i] =
                core::FloatToBf16(core::Bf16ToFloat(x[r][i]) + core::Bf16ToFloat(rs.output[i]));
          }
        }
        layer_times.push_back(absl::StrFormat("layer %d %.2f s", layer, elapsed));
      }
      return absl::OkStatus();
    };
    absl::Status stepped = run_step();
    if (kills && s + 1 == options.kill_at_step) {
      // The survivors' first calls fail while they mask the killed rank;
      // the step is sent again to them (bounded).
      int attempts = 1;
      while (!stepped.ok() && attempts < 8) {
        ++attempts;
        stepped = run_step();
      }
      result.masks.attempts = attempts;
      result.masks.kill_to_first_step_ms = absl::ToDoubleMilliseconds(absl::Now() - killed);
      if (stepped.ok()) {
        out << absl::StrFormat(
            "rank %d: masked by the survivors; step %d completed on them %.0f ms after the kill "
            "(%d attempt(s))\n",
            options.kill_rank, s + 1, result.masks.kill_to_first_step_ms, attempts);
      }
    }
    RETURN_IF_ERROR(stepped);
    if (kills && s + 1 == options.restart_at_step) {
      result.masks.restart_to_first_step_ms = absl::ToDoubleMilliseconds(absl::Now() - restarted);
    }
    if (masked_step(s)) {
      // The reference drops the lost experts' choices as the workers did.
      for (int li = 0; li < L; ++li) {
        for (int r = 0; r < world; ++r) {
          DropLostChoices(result.masks.lost_experts, absl::MakeSpan(record[li][s][r].ids));
        }
      }
    }
    out << "step " << s + 1 << "/" << options.steps << ": tokens per rank ["
        << absl::StrJoin(counts[s], ", ") << "], R " << R << "; "
        << absl::StrJoin(layer_times, ", ") << "\n";
    out.flush();
    if (s + 1 == options.rebalance_after_steps) {
      ASSIGN_OR_RETURN(result.rebalance,
                       RebalanceRunLayers(*coordinator, run_layers, model.num_experts, world,
                                          options.redundant_slots_per_rank, load_request, out));
    }
  }
  result.masks.reported_lost.assign(reported_lost.begin(), reported_lost.end());
  if (!result.rebalance.empty()) {
    RETURN_IF_ERROR(ReadLoadAfterRebalance(*coordinator, model.num_experts, &result.rebalance));
    out << RenderLoadTable(result.rebalance);
    out.flush();
  }

  // Verification, one chunk of one layer's experts in memory at a time.
  for (int li = 0; li < L; ++li) {
    const int layer = run_layers[li];
    const absl::Time start = absl::Now();
    const ExpertChunkFactory make_chunk = [&](int first,
                                              int count) -> absl::StatusOr<core::ExpertSet> {
      if (identity) return core::ExpertSet::Identity(first, count, H);
      core::ExpertSource source = core::ExpertSource::Seeded(
          options.seed, layer, model.num_experts, first, count, H, model.moe_intermediate_size);
      source.weight_format = format;
      if (model.swiglu_limit > 0) {
        source.gpt_oss_activation.limit = static_cast<float>(model.swiglu_limit);
      }
      if (scale_input) source.router_weight_use = core::RouterWeightUse::kScalesInput;
      return core::MakeHostExperts(source);
    };
    // All (step, rank) rows of the layer in one call: one GEMM per expert.
    int64_t total = 0;
    for (int s = 0; s < options.steps; ++s) {
      for (int r = 0; r < world; ++r) total += record[li][s][r].num_tokens;
    }
    std::vector<core::bf16_t> xs;
    std::vector<int32_t> ids;
    std::vector<float> ws;
    xs.reserve(total * H);
    ids.reserve(total * K);
    ws.reserve(total * K);
    for (int s = 0; s < options.steps; ++s) {
      for (int r = 0; r < world; ++r) {
        const RankStep& rs = record[li][s][r];
        xs.insert(xs.end(), rs.input.begin(), rs.input.end());
        ids.insert(ids.end(), rs.ids.begin(), rs.ids.end());
        ws.insert(ws.end(), rs.weights.begin(), rs.weights.end());
      }
    }
    std::vector<float> ref(total * H);
    // The routed experts read the rows as dispatched (fp8_e4m3: the e4m3
    // rounding of every data plane); the shared expert the input itself.
    ASSIGN_OR_RETURN(std::vector<core::bf16_t> dispatched,
                     core::DispatchedHidden(options.dispatch_dtype, xs, total, H));
    ASSIGN_OR_RETURN(
        StreamedReferenceStats chunks,
        StreamedMoeReference(make_chunk, model.num_experts, memory.reference_chunk_experts, H,
                             dispatched, ids, ws, total, K, absl::MakeSpan(ref)));
    if (shared.present()) {
      // The shared expert of every row, added to the routed reference in fp32.
      ASSIGN_OR_RETURN(
          core::SharedExpert shared_expert,
          identity ? core::SharedExpert::Identity(options.seed, layer, H, shared.sigmoid_gate)
                   : core::SharedExpert::Generate(options.seed, layer, H, shared.intermediate_size,
                                                  shared.sigmoid_gate));
      std::vector<float> shared_ref(total * H);
      RETURN_IF_ERROR(shared_expert.ComputeFloat(xs, total, absl::MakeSpan(shared_ref)));
      for (size_t i = 0; i < ref.size(); ++i) ref[i] += shared_ref[i];
    }
    result.reference_chunks_made += chunks.chunks_made;
    result.reference_chunks_skipped += chunks.chunks_skipped;
    LayerRunSummary& summary = result.layers[li];
    int64_t offset = 0;
    for (int s = 0; s < options.steps; ++s) {
      for (int r = 0; r < world; ++r) {
        const RankStep& rs = record[li][s][r];
        ASSIGN_OR_RETURN(Comparison c, CompareToReference(rs.output,
                                                          absl::MakeConstSpan(ref).subspan(
                                                              offset * H, rs.num_tokens * H),
                                                          options.tolerance));
        if (!c.pass) {
          out << absl::StrFormat(
              "  layer %d step %d rank %d: max abs err %.3g at token %d, element %d (bound %.3g)\n",
              layer, s + 1, r, c.max_abs_err, c.worst_index / H, c.worst_index % H, c.bound);
        }
        MergeComparison(c, options.tolerance, &summary.comparison);
        offset += rs.num_tokens;
      }
    }
    out << absl::StrFormat(
        "verify: layer %d against the single-process reference (%d experts in %d chunk(s) of "
        "<= %d, %d skipped as unselected%s; %d rows) in %.1f s: max abs err %.3g, bound %.3g: "
        "%s\n",
        layer, model.num_experts, chunks.chunks_made, memory.reference_chunk_experts,
        chunks.chunks_skipped, shared.present() ? ", + shared expert" : "", total,
        Seconds(absl::Now() - start), summary.comparison.max_abs_err, summary.comparison.bound,
        summary.comparison.pass ? "PASS" : "FAIL");
    out.flush();
  }
  return result;
}

std::string RenderRunSummary(const RunJobResult& result) {
  TextTable table({"layer", "tokens", "R", "bytes sent", "time", "max abs err", "bound", "result"});
  int64_t tokens = 0, bytes = 0, max_r = 0;
  double seconds = 0, max_err = 0;
  for (const LayerRunSummary& l : result.layers) {
    table.AddRow(
        {absl::StrCat(l.layer), absl::StrCat(l.tokens), absl::StrCat(l.max_r),
         FormatBytes(static_cast<double>(l.bytes_sent)), absl::StrFormat("%.3f s", l.forward_s),
         absl::StrFormat("%.3g", l.comparison.max_abs_err),
         absl::StrFormat("%.3g", l.comparison.bound), l.comparison.pass ? "PASS" : "FAIL"});
    tokens += l.tokens;
    bytes += l.bytes_sent;
    max_r = std::max(max_r, l.max_r);
    seconds += l.forward_s;
    max_err = std::max(max_err, l.comparison.max_abs_err);
  }
  table.AddRow({"total", absl::StrCat(tokens), absl::StrCat(max_r),
                FormatBytes(static_cast<double>(bytes)), absl::StrFormat("%.3f s", seconds),
                absl::StrFormat("%.3g", max_err), "", result.AllPass() ? "PASS" : "FAIL"});
  std::string text = table.Render();
  if (result.shared_expert.present()) {
    int64_t dispatch = 0, shared = 0, overlap = 0;
    for (const LayerRunSummary& l : result.layers) {
      dispatch += l.dispatch_us;
      shared += l.shared_us;
      overlap += l.shared_overlap_us;
    }
    absl::StrAppendFormat(&text,
                          "shared expert (intermediate %d, gate %s) in every layer: %d us of "
                          "compute, %d us of it overlapped with %d us of dispatch (worker "
                          "timings, summed over layers and steps)\n",
                          result.shared_expert.intermediate_size,
                          result.shared_expert.sigmoid_gate ? "sigmoid" : "none", shared, overlap,
                          dispatch);
  }
  if (result.masks.kill_rank >= 0) {
    const MaskRunSummary& m = result.masks;
    absl::StrAppendFormat(
        &text,
        "rank mask: rank %d killed before step %d, first masked step %.0f ms after the kill (%d "
        "attempt(s)); lost experts [%s], reported [%s]",
        m.kill_rank, m.kill_at_step, m.kill_to_first_step_ms, m.attempts,
        absl::StrJoin(m.lost_experts, ","), absl::StrJoin(m.reported_lost, ","));
    if (m.restart_at_step > 0) {
      absl::StrAppendFormat(&text,
                            "; restarted before step %d: re-admitted in %.0f ms, first full step "
                            "%.0f ms after the restart",
                            m.restart_at_step, m.rejoin_ms, m.restart_to_first_step_ms);
    }
    text += "\n";
  }
  absl::StrAppendFormat(&text, "throughput: %.0f tokens/s through %d MoE layer(s) on %d ranks\n",
                        seconds > 0 ? tokens / seconds : 0.0, result.layers.size(), result.world);

  int64_t max_rank_bytes = 0;
  for (int64_t b : result.expert_bytes_per_rank) max_rank_bytes = std::max(max_rank_bytes, b);
  const double all_layers =
      static_cast<double>(result.layer_expert_bytes) * result.num_sparse_layers;
  const double pages = static_cast<double>(sysconf(_SC_PHYS_PAGES));
  const double page_size = static_cast<double>(sysconf(_SC_PAGESIZE));
  TextTable memory({"memory footprint (routed experts, bf16)", "bytes"});
  memory.AddRow({absl::StrCat("held by each worker (", result.layers.size(), " layer(s), max)"),
                 FormatBytes(static_cast<double>(max_rank_bytes))});
  memory.AddRow({result.identity_experts
                     ? std::string("one layer, all experts (identity run: none held)")
                     : std::string("one layer, all experts"),
                 FormatBytes(static_cast<double>(result.layer_expert_bytes))});
  if (!result.identity_experts && result.memory.reference_chunk_experts > 0) {
    memory.AddRow({absl::StrCat("the reference's chunk (", result.memory.reference_chunk_experts,
                                " experts; the most it holds)"),
                   FormatBytes(static_cast<double>(result.memory.reference_chunk_bytes))});
  }
  memory.AddRow({absl::StrCat("all ", result.num_sparse_layers, " MoE layers, per worker at EP ",
                              result.world),
                 FormatBytes(all_layers / std::max(result.world, 1))});
  memory.AddRow({absl::StrCat("all ", result.num_sparse_layers, " MoE layers, whole model"),
                 FormatBytes(all_layers)});
  if (result.memory.needed_bytes > 0) {
    memory.AddRow({"preflight estimate, this machine (workers + this process)",
                   FormatBytes(static_cast<double>(result.memory.needed_bytes))});
  }
  if (result.memory_available_bytes > 0) {
    memory.AddRow({"available at start (MemAvailable)",
                   FormatBytes(static_cast<double>(result.memory_available_bytes))});
  }
  if (pages > 0 && page_size > 0) {
    memory.AddRow({"this machine's memory", FormatBytes(pages * page_size)});
  }
  text += memory.Render();
  if (result.identity_experts) {
    text +=
        "identity experts hold no weights; the sizes above are what the model's SwiGLU "
        "experts would need\n";
  }
  if (result.dispatch_dtype == core::DispatchDType::kFP8E4M3) {
    text +=
        "dispatch fp8_e4m3: each value travels as e4m3 with one fp32 scale per 128 (3 mantissa "
        "bits: within 2^-4 of its magnitude + 2^-10 of its block's scale); the reference's "
        "routed experts read the same rounded rows, so the bf16 bound below applies\n";
  }
  absl::StrAppendFormat(
      &text,
      "tolerance: |out - ref| <= %.4g * max|ref| + %.3g per layer and rank "
      "(bf16 partial sums and output round by <= 2^-9 relative; see client/tolerance.h)\n",
      result.tolerance.rel, result.tolerance.atol);
  return text;
}

namespace {

// {} without a kill; else the rank-mask run's figures (RunJobOptions::kill_rank).
nlohmann::json MasksJson(const MaskRunSummary& m) {
  if (m.kill_rank < 0) return nlohmann::json::object();
  return {{"kill_rank", m.kill_rank},
          {"kill_at_step", m.kill_at_step},
          {"restart_at_step", m.restart_at_step},
          {"kill_to_first_step_ms", m.kill_to_first_step_ms},
          {"attempts", m.attempts},
          {"lost_experts", m.lost_experts},
          {"reported_lost_experts", m.reported_lost},
          {"rejoin_ms", m.rejoin_ms},
          {"restart_to_first_step_ms", m.restart_to_first_step_ms}};
}

nlohmann::json RebalanceJson(const std::vector<LayerRebalance>& layers) {
  nlohmann::json out = nlohmann::json::array();
  for (const LayerRebalance& l : layers) {
    out.push_back({{"layer", l.layer},
                   {"before_max_over_mean", l.before.ratio()},
                   {"predicted_max_over_mean", l.predicted.ratio()},
                   {"after_max_over_mean", l.after.ratio()},
                   {"slots_per_rank", l.slots_per_rank},
                   {"redundant_slots_per_rank", l.redundant_slots_per_rank}});
  }
  return out;
}

}  // namespace

nlohmann::json RunSummaryJson(const RunJobResult& result) {
  nlohmann::json layers = nlohmann::json::array();
  int64_t tokens = 0, bytes = 0;
  double seconds = 0, max_err = 0;
  for (const LayerRunSummary& l : result.layers) {
    layers.push_back({{"layer", l.layer},
                      {"tokens", l.tokens},
                      {"max_r", l.max_r},
                      {"bytes_sent", l.bytes_sent},
                      {"forward_s", l.forward_s},
                      {"max_abs_err", l.comparison.max_abs_err},
                      {"max_abs_ref", l.comparison.max_abs_ref},
                      {"bound", l.comparison.bound},
                      {"elements", l.comparison.num_elements},
                      {"pass", l.comparison.pass},
                      {"dispatch_us", l.dispatch_us},
                      {"shared_us", l.shared_us},
                      {"shared_overlap_us", l.shared_overlap_us}});
    tokens += l.tokens;
    bytes += l.bytes_sent;
    seconds += l.forward_s;
    max_err = std::max(max_err, l.comparison.max_abs_err);
  }
  core::ModelDescription shared_model;
  shared_model.shared_expert = result.shared_expert;
  return {{"model", result.model_name},
          {"shared_expert", SharedExpertJson(shared_model)},
          {"routed_scaling_factor", result.routed_scaling_factor},
          {"world", result.world},
          {"steps", result.steps},
          {"pass", result.AllPass()},
          {"identity_experts", result.identity_experts},
          {"dispatch_dtype", core::DispatchDTypeName(result.dispatch_dtype)},
          {"tolerance", {{"rel", result.tolerance.rel}, {"atol", result.tolerance.atol}}},
          {"layers", std::move(layers)},
          {"total",
           {{"tokens", tokens},
            {"bytes_sent", bytes},
            {"forward_s", seconds},
            {"tokens_per_s", seconds > 0 ? tokens / seconds : 0.0},
            {"max_abs_err", max_err}}},
          {"memory",
           {{"expert_bytes_per_rank", result.expert_bytes_per_rank},
            {"layer_expert_bytes", result.layer_expert_bytes},
            {"num_sparse_layers", result.num_sparse_layers},
            {"preflight_needed_bytes", result.memory.needed_bytes},
            {"preflight_worker_bytes", result.memory.worker_bytes},
            {"preflight_coordinator_bytes", result.memory.coordinator_bytes},
            {"available_bytes", result.memory_available_bytes}}},
          {"reference_chunks",
           {{"made", result.reference_chunks_made}, {"skipped", result.reference_chunks_skipped}}},
          {"rebalance", RebalanceJson(result.rebalance)},
          {"masks", MasksJson(result.masks)}};
}

}  // namespace moe_ep::client
