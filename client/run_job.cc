#include "client/run_job.h"

#include <algorithm>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "client/memory_budget.h"
#include "client/model_source.h"
#include "client/plan_command.h"
#include "client/run_job_steps.h"
#include "client/text_table.h"
#include "core/host_memory.h"
#include "core/quantized_weights.h"
#include "core/routing_source.h"
#include "core/shared_expert.h"
#include "core/status_macros.h"

// RunJob and the steps before any worker starts; the others are in
// run_job_group.cc, run_job_steps.cc and run_job_verify.cc, the summary in
// run_job_report.cc (client/run_job_steps.h lists them).

namespace moe_ep::client {
namespace {

// splitmix64: decorrelates the seeds of (seed, step, rank) streams.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
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

namespace run_job_internal {

absl::Status ResolveRunModel(const RunJobOptions& options, RunJobState& job, std::ostream& out) {
  ASSIGN_OR_RETURN(job.model, ResolveModel(options.model));
  const core::ModelDescription& model = job.model;
  job.sparse = model.SparseLayerIndices();
  const std::vector<int>& sparse = job.sparse;
  if (options.num_layers > static_cast<int>(sparse.size())) {
    return absl::InvalidArgumentError(absl::StrCat("--layers: ", model.name, " has ", sparse.size(),
                                                   " MoE layers, asked for ", options.num_layers));
  }
  job.run_layers.assign(sparse.begin(), sparse.begin() + options.num_layers);
  core::RoutingSourceOptions routing_options;
  routing_options.kind = options.routing;
  routing_options.num_experts = model.num_experts;
  routing_options.top_k = model.top_k;
  routing_options.seed = options.seed;
  ASSIGN_OR_RETURN(job.routing, core::RoutingSource::Create(routing_options));
  job.identity = options.experts == "identity";
  // --experts checkpoint: the format of the model's quantization_config
  // (issue 35; fp8 and mxfp4 on every plane); swiglu: bf16.
  job.format = options.experts == "checkpoint" ? model.quantization.expert_format
                                               : core::quant::ExpertWeightFormat::kBf16;
  // Llama-4: the router weight scales the expert's input (issue 35 item 5).
  job.scale_input = model.router_weight_use == core::RouterWeightUse::kScalesInput && !job.identity;

  out << "moe-ep run: " << model.name << " (hidden " << model.hidden_size << ", "
      << model.num_experts << " experts, top-" << model.top_k << ", expert intermediate "
      << model.moe_intermediate_size << ", " << model.num_layers << " layers, " << sparse.size()
      << " MoE); running MoE layers " << absl::StrJoin(job.run_layers, ",") << " with "
      << options.experts << " experts, routing " << options.routing << ", " << options.steps
      << " step(s), seed " << options.seed << "\n";
  out << DescribeSharedExperts(model) << "\n" << DescribeQuantization(model) << "\n";
  if (!job.identity) {
    out << "routed experts run as " << core::quant::ExpertWeightFormatName(job.format)
        << (options.experts == "checkpoint" ? " (the checkpoint's format)" : "") << "\n";
  }
  if (job.scale_input) {
    out << "note: " << model.model_type
        << " scales an expert's input by its router score: the workers and the reference "
           "compute e(w * x) on every plane\n";
  }
  return absl::OkStatus();
}

bool MaskedStep(const RunJobOptions& options, int s) {
  return options.kill_rank >= 0 && s + 1 >= options.kill_at_step &&
         (options.restart_at_step == 0 || s + 1 < options.restart_at_step);
}

absl::Status PlanRunSteps(const RunJobOptions& options, RunJobState& job) {
  // The group's size, known before any worker starts.
  if (options.workers.targets.empty() && options.workers.num_workers < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--workers: expected >= 1, got ", options.workers.num_workers));
  }
  // With GPUs and --backend auto/nccl, one worker per GPU (PlanWorkers).
  ASSIGN_OR_RETURN(job.worker_plan, PlanWorkers(options.workers));
  const int world = job.worker_plan.num_workers;
  job.world = world;
  if (job.model.num_experts < world) {
    return absl::InvalidArgumentError(absl::StrCat("--workers: ", job.model.name, " has ",
                                                   job.model.num_experts,
                                                   " experts, fewer than the ", world, " ranks"));
  }
  // Token counts of every step, known up front (capacity N must bound them).
  job.counts.assign(options.steps, {});
  for (int s = 0; s < options.steps; ++s) {
    job.counts[s] = job.routing.prescribes_token_counts() ? job.routing.TokensPerRank(s, world)
                    : options.even_tokens
                        ? std::vector<int64_t>(world, options.tokens_per_rank)
                        : PlanTokenCounts(options.tokens_per_rank, world, s, options.seed);
    int64_t step_rows = 0;
    for (int64_t c : job.counts[s]) {
      job.max_count = std::max(job.max_count, c);
      step_rows += c;
    }
    job.rows_per_layer += step_rows;
    job.max_step_rows = std::max(job.max_step_rows, step_rows);
  }
  job.kills = options.kill_rank >= 0;
  if (job.kills && (world < 2 || options.kill_rank >= world)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kill-rank: expected a rank in [0, ", world, ") of at least 2 workers, got ",
        options.kill_rank,
        world < 2 && job.worker_plan.one_per_gpu
            ? " (with a GPU, backend auto/nccl runs one local worker per GPU: this machine has "
              "one; use --backend gloo)"
            : ""));
  }
  // The killed rank's tokens are gone while it is masked.
  for (int s = 0; s < options.steps; ++s) {
    if (MaskedStep(options, s)) job.counts[s][options.kill_rank] = 0;
  }
  job.capacity =
      options.capacity_tokens > 0 ? options.capacity_tokens : std::max<int64_t>(job.max_count, 1);
  return absl::OkStatus();
}

absl::Status PreflightRunMemory(const RunJobOptions& options, RunJobState& job, std::ostream& out) {
  // Fail here, before anything is allocated, when the run cannot fit on
  // this machine.
  const bool local = options.workers.targets.empty();
  RunMemoryInput memory_input;
  memory_input.num_experts = job.model.num_experts;
  memory_input.hidden = job.model.hidden_size;
  memory_input.intermediate = job.model.moe_intermediate_size;
  memory_input.top_k = job.model.top_k;
  memory_input.world = job.world;
  memory_input.num_local_workers = local ? job.world : 0;
  memory_input.num_layers = options.num_layers;
  memory_input.identity = job.identity;
  memory_input.redundant_slots_per_rank = options.redundant_slots_per_rank;
  memory_input.capacity_tokens = job.capacity;
  memory_input.rows_per_layer = job.rows_per_layer;
  memory_input.max_step_rows = job.max_step_rows;
  memory_input.weight_format = job.format;
  ASSIGN_OR_RETURN(job.memory, EstimateRunMemory(memory_input));
  const RunMemoryEstimate& memory = job.memory;
  job.selection = options.workers;
  job.available = core::AvailableMemoryBytes();
  if (!job.available.ok()) {
    out << "memory: preflight skipped (" << job.available.status().message()
        << "); local workers run uncapped\n";
    return absl::OkStatus();
  }
  const int64_t available = *job.available;
  RETURN_IF_ERROR(CheckRunMemory(memory_input, available));
  job.selection.worker_memory_cap_bytes =
      LocalWorkerMemoryCapBytes(memory, memory_input.num_local_workers, available);
  out << "memory: needs about " << FormatBytes(static_cast<double>(memory.needed_bytes))
      << " here (";
  if (local) {
    out << job.world << " local worker(s) x "
        << FormatBytes(static_cast<double>(memory.worker_bytes)) << ", capped at "
        << FormatBytes(static_cast<double>(job.selection.worker_memory_cap_bytes)) << " each; ";
  }
  out << "this process " << FormatBytes(static_cast<double>(memory.coordinator_bytes));
  if (!job.identity) {
    out << " with a reference chunk of " << memory.reference_chunk_experts << " expert(s)";
  }
  out << ") of " << FormatBytes(static_cast<double>(available)) << " available\n";
  return absl::OkStatus();
}

}  // namespace run_job_internal

absl::StatusOr<RunJobResult> RunJob(const RunJobOptions& options, std::ostream& out) {
  namespace steps = run_job_internal;
  // Everything that can be checked without workers first.
  RETURN_IF_ERROR(ValidateRunJobOptions(options));
  steps::RunJobState job;
  RETURN_IF_ERROR(steps::ResolveRunModel(options, job, out));
  RETURN_IF_ERROR(steps::PlanRunSteps(options, job));
  RETURN_IF_ERROR(steps::PreflightRunMemory(options, job, out));
  RETURN_IF_ERROR(steps::FormRunGroup(options, job, out));
  steps::StartRunResult(options, job);
  RETURN_IF_ERROR(steps::LoadRunExperts(options, job, out));
  RETURN_IF_ERROR(steps::RunSteps(options, job, out));
  RETURN_IF_ERROR(steps::VerifyRunLayers(options, job, out));
  return std::move(job.result);
}

}  // namespace moe_ep::client
