#include "client/stack_job.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/coordinator.h"
#include "client/group_session.h"
#include "client/memory_budget.h"
#include "client/model_source.h"
#include "client/run_job.h"
#include "client/stack_memory_budget.h"
#include "client/targets.h"
#include "client/text_table.h"
#include "core/bf16.h"
#include "core/host_memory.h"
#include "core/layer_plan.h"
#include "core/layer_stack.h"
#include "core/status_macros.h"

namespace moe_ep::client {
namespace {

constexpr double kSparseTol = 1.0 / 128.0;
constexpr double kDenseTol = 1e-4;

absl::Status Bad(absl::string_view flag, absl::string_view expected, int64_t got) {
  return absl::InvalidArgumentError(absl::StrCat(flag, ": expected ", expected, ", got ", got));
}

v1::Tensor Bf16Tensor(const std::vector<core::bf16_t>& values, int64_t rows, int64_t cols) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.add_shape(rows);
  t.add_shape(cols);
  t.set_data(std::string(reinterpret_cast<const char*>(values.data()), values.size() * 2));
  return t;
}

absl::StatusOr<std::vector<float>> Fp32Values(const v1::Tensor& t, int64_t rows, int64_t cols,
                                              int rank) {
  if (t.dtype() != v1::DTYPE_FP32 || t.shape_size() != 2 || t.shape(0) != rows ||
      t.shape(1) != cols || static_cast<int64_t>(t.data().size()) != rows * cols * 4) {
    return absl::InternalError(absl::StrCat("rank ", rank, ": output is not fp32 [", rows, ", ",
                                            cols, "] (", t.data().size(), " bytes)"));
  }
  std::vector<float> out(static_cast<size_t>(rows * cols));
  std::memcpy(out.data(), t.data().data(), out.size() * 4);
  return out;
}

// Everything the steps of RunStackJob share, filled step by step. Members
// are destroyed in reverse order: the group before the workers.
struct StackJobState {
  // ResolveStack.
  core::ModelDescription model;
  core::LayerStackConfig config;  // as the workers will resolve it (sizes sent explicitly)
  std::vector<core::LayerPlan> plans;
  std::vector<std::vector<int64_t>> counts;  // [step][DP group] tokens
  int64_t max_count = 0;                     // the largest DP group of the run
  double tolerance = 0;                      // of every group's max relative error
  // PreflightStackMemory.
  WorkerSelection selection;  // gloo, --tp workers, memory cap set
  bool local = true;          // no --targets: local workers
  StackMemoryEstimate memory;
  absl::StatusOr<int64_t> available;  // MemAvailable, or why it is unknown
  // FormStackGroup.
  AttachedWorkers workers;
  GroupSession group;
  v1::LayerStackSpec spec;  // every ForwardLayersRequest's stack
  StackJobResult result;

  int attn_tp() const { return config.layout.tp_size / config.layout.attn_dp_size; }
};

// The layer stack of the model's first --layers layers under the options'
// layout and sizes (capacity, layout validation and plans: ResolveStack).
absl::StatusOr<core::LayerStackConfig> StackConfigOf(const StackJobOptions& options,
                                                     const core::ModelDescription& model) {
  const int tp = options.tp_size;
  core::LayerStackConfig config;
  config.layout = core::ParallelLayout{tp, options.attn_dp_size, options.moe_dense_tp_size};
  config.sparse_layers.assign(model.sparse_layers.begin(),
                              model.sparse_layers.begin() + options.num_layers);
  config.a2a_enabled = options.a2a_enabled;
  config.hidden = options.hidden > 0 ? options.hidden : model.hidden_size;
  config.moe_intermediate =
      options.moe_intermediate > 0 ? options.moe_intermediate : model.moe_intermediate_size;
  const bool any_dense = std::find(config.sparse_layers.begin(), config.sparse_layers.end(),
                                   false) != config.sparse_layers.end();
  config.dense_intermediate =
      options.dense_intermediate > 0 ? options.dense_intermediate : model.intermediate_size;
  if (config.dense_intermediate == 0) {
    if (any_dense) {
      return absl::InvalidArgumentError(
          absl::StrCat("--dense-intermediate: required, ", model.name, " has no dense MLP size"));
    }
    config.dense_intermediate = tp;  // unused: no dense layer runs
  }
  config.num_experts = model.num_experts;
  config.top_k = model.top_k;
  config.seed = options.seed;
  config.rms_eps = model.rms_norm_eps > 0 ? static_cast<float>(model.rms_norm_eps) : 1e-6f;
  config.allow_reduce_scatter = options.allow_reduce_scatter;
  return config;
}

// No workers yet: the model, the stack, every step's DP token counts, the
// capacity that bounds every rank's SCATTERED rows, the plans.
absl::Status ResolveStack(const StackJobOptions& options, StackJobState& job) {
  ASSIGN_OR_RETURN(job.model, ResolveModel(options.model));
  if (options.num_layers > job.model.num_layers) {
    return Bad("--layers",
               absl::StrCat("<= ", job.model.num_layers, " (", job.model.name, "'s layers)"),
               options.num_layers);
  }
  ASSIGN_OR_RETURN(job.config, StackConfigOf(options, job.model));
  core::LayerStackConfig& config = job.config;
  const int attn_dp = options.attn_dp_size;
  job.counts.assign(options.steps, {});
  for (int s = 0; s < options.steps; ++s) {
    job.counts[s] = PlanStackTokenCounts(options.tokens_per_group, attn_dp, s, options.seed);
    for (int64_t c : job.counts[s]) job.max_count = std::max(job.max_count, c);
  }
  config.capacity_tokens =
      options.capacity_tokens > 0 ? options.capacity_tokens : job.max_count + job.attn_tp();
  {
    absl::Status valid = core::ValidateLayerStackConfig(config);
    if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("stack: ", valid.message()));
  }
  ASSIGN_OR_RETURN(job.plans,
                   core::PlanLayers(config.layout, config.sparse_layers, config.a2a_enabled));
  const bool any_sparse = std::find(config.sparse_layers.begin(), config.sparse_layers.end(),
                                    true) != config.sparse_layers.end();
  job.tolerance = any_sparse ? kSparseTol : kDenseTol;
  return absl::OkStatus();
}

// Still no workers: --targets must name --tp workers; the memory preflight
// fails here when the stack cannot fit on this machine (issue 9) and caps
// each local worker's memory.
absl::Status PreflightStackMemory(const StackJobOptions& options, StackJobState& job,
                                  std::ostream& out) {
  const int tp = options.tp_size;
  job.selection = options.workers;
  job.selection.backend = "gloo";  // the layer stack runs on the Gloo backend
  job.selection.num_workers = tp;
  job.local = job.selection.targets.empty();
  if (!job.local) {
    ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(job.selection.targets));
    if (static_cast<int>(targets.size()) != tp) {
      return Bad("--targets", absl::StrCat(tp, " workers (--tp)"),
                 static_cast<int64_t>(targets.size()));
    }
  }
  StackMemoryInput memory_input;
  memory_input.config = job.config;
  memory_input.num_local_workers = job.local ? tp : 0;
  for (int s = 0; s < options.steps; ++s) {
    int64_t step_rows = 0;
    for (int64_t c : job.counts[s]) step_rows += c;
    memory_input.step_rows = std::max(memory_input.step_rows, step_rows);
  }
  memory_input.gathered_rows = options.attn_dp_size * job.max_count;
  ASSIGN_OR_RETURN(job.memory, EstimateStackMemory(memory_input));
  const StackMemoryEstimate& memory = job.memory;
  job.available = core::AvailableMemoryBytes();
  if (job.available.ok()) {
    const int64_t available = *job.available;
    RETURN_IF_ERROR(CheckStackMemory(memory_input, available));
    job.selection.worker_memory_cap_bytes =
        StackWorkerMemoryCapBytes(memory, memory_input.num_local_workers, available);
    out << "memory: needs about " << FormatBytes(static_cast<double>(memory.needed_bytes))
        << " here (";
    if (job.local) {
      out << tp << " local worker(s) x " << FormatBytes(static_cast<double>(memory.worker_bytes))
          << ", capped at "
          << FormatBytes(static_cast<double>(job.selection.worker_memory_cap_bytes)) << " each; ";
    }
    out << "this process " << FormatBytes(static_cast<double>(memory.coordinator_bytes))
        << " with the reference's largest layer) of " << FormatBytes(static_cast<double>(available))
        << " available\n";
  } else {
    out << "memory: preflight skipped (" << job.available.status().message()
        << "); local workers run uncapped\n";
  }
  return absl::OkStatus();
}

// Starts or attaches the workers, forms the group and configures the
// stack's layers (ConfigureLayers); sets the stack spec every step sends.
absl::Status FormStackGroup(const StackJobOptions& options, StackJobState& job, std::ostream& out) {
  const int tp = options.tp_size;
  const core::LayerStackConfig& config = job.config;
  out << (job.local ? absl::StrCat("workers: starting ", tp, " local Gloo workers")
                    : absl::StrCat("workers: attaching ", tp, " --targets workers"))
      << " and forming the group\n";
  out.flush();
  ASSIGN_OR_RETURN(job.workers, AttachWorkers(job.selection));
  CoordinatorOptions copts;
  copts.rpc_timeout = options.rpc_timeout;
  // workers.backend is "gloo" (selection.backend above).
  ASSIGN_OR_RETURN(job.group, FormWorkerGroup(job.workers, copts));
  Coordinator* const coordinator = job.group.coordinator.get();
  out << "group: " << tp << " workers ("
      << (job.workers.cluster ? "embedded local cluster" : "--targets")
      << ", backend gloo, generation " << coordinator->generation()
      << "): " << absl::StrJoin(job.workers.targets, " ") << "\n";
  out.flush();

  v1::ConfigureLayersRequest configure;
  configure.mutable_layout()->set_tp_size(tp);
  configure.mutable_layout()->set_attn_dp_size(options.attn_dp_size);
  configure.mutable_layout()->set_moe_dense_tp_size(options.moe_dense_tp_size);
  configure.set_a2a_enabled(options.a2a_enabled);
  v1::ModelDescription* md = configure.mutable_model();
  md->set_name(absl::StrCat(job.model.name, " (stand-in stack)"));
  md->set_hidden_size(config.hidden);
  md->set_num_layers(options.num_layers);
  md->set_num_experts(config.num_experts);
  md->set_top_k(config.top_k);
  md->set_moe_intermediate_size(config.moe_intermediate);
  for (bool s : config.sparse_layers) md->add_sparse_layers(s);
  ASSIGN_OR_RETURN(std::vector<v1::ConfigureLayersResponse> configured,
                   coordinator->ConfigureLayers(configure));
  out << "configured: " << job.model.name << ", first " << options.num_layers << " layers, tp "
      << tp << ", attn_dp " << options.attn_dp_size << ", moe_dense_tp "
      << (options.moe_dense_tp_size == 0 ? std::string("unset")
                                         : absl::StrCat(options.moe_dense_tp_size))
      << ", a2a " << (options.a2a_enabled ? "on" : "off") << "; H " << config.hidden
      << ", expert I " << config.moe_intermediate << ", dense I " << config.dense_intermediate
      << ", " << config.num_experts << " experts, top-" << config.top_k << ", capacity "
      << config.capacity_tokens << "; plan fingerprint " << configured[0].fingerprint() << "\n"
      << core::FormatPlanTable(job.plans);
  out.flush();
  return absl::OkStatus();
}

// The stack every ForwardLayersRequest carries, and the result's fields
// known before any step.
void StartStackSteps(const StackJobOptions& options, StackJobState& job) {
  const core::LayerStackConfig& config = job.config;
  v1::LayerStackSpec& spec = job.spec;
  spec.set_hidden_size(config.hidden);
  spec.set_dense_intermediate_size(config.dense_intermediate);
  spec.set_moe_intermediate_size(config.moe_intermediate);
  spec.set_num_experts(config.num_experts);
  spec.set_top_k(config.top_k);
  spec.set_seed(config.seed);
  spec.set_rms_eps(config.rms_eps);
  spec.set_allow_reduce_scatter(config.allow_reduce_scatter);
  spec.set_capacity_tokens(config.capacity_tokens);

  StackJobResult& result = job.result;
  result.model_name = job.model.name;
  result.tp_size = options.tp_size;
  result.attn_dp_size = options.attn_dp_size;
  result.moe_dense_tp_size = options.moe_dense_tp_size;
  result.capacity_tokens = config.capacity_tokens;
  result.sparse_layers = config.sparse_layers;
  result.memory = job.memory;
  result.memory_available_bytes = job.available.ok() ? *job.available : 0;
}

// The reference of step s's DP groups' tokens (fp32, group after group),
// with a line per layer as it goes on the first step (a real model's
// sparse layer builds every expert here).
absl::StatusOr<std::vector<float>> StackReference(const StackJobState& job, int s,
                                                  const std::vector<std::vector<float>>& dp_tokens,
                                                  std::ostream& out) {
  absl::Time layer_start = absl::Now();
  const std::function<void(int)> on_layer = [&](int layer) {
    const absl::Time now = absl::Now();
    out << absl::StrFormat("  reference (this process): layer %d (%s) in %.1f s\n", layer,
                           job.config.sparse_layers[layer] ? "sparse" : "dense",
                           absl::ToDoubleSeconds(now - layer_start));
    out.flush();
    layer_start = now;
  };
  return core::ReferenceLayerStack(job.config, dp_tokens, s == 0 ? on_layer : nullptr);
}

// Step s's DP groups: each rank's output against the reference `ref`, and
// the ranks of a group against each other; one StackGroupResult a group.
absl::Status CompareStackGroups(StackJobState& job, int s,
                                const std::vector<v1::ForwardLayersResponse>& responses,
                                const std::vector<float>& ref, double forward_ms) {
  const int attn_tp = job.attn_tp();
  const int64_t h = job.config.hidden;
  int64_t offset = 0;
  for (int g = 0; g < job.config.layout.attn_dp_size; ++g) {
    StackGroupResult row;
    row.step = s;
    row.dp_group = g;
    row.tokens = job.counts[s][g];
    row.padding_mode = responses[0].padding_mode();
    row.tolerance = job.tolerance;
    row.forward_ms = forward_ms;
    std::vector<float> first;
    for (int j = 0; j < attn_tp; ++j) {
      const int r = g * attn_tp + j;
      ASSIGN_OR_RETURN(std::vector<float> got,
                       Fp32Values(responses[r].output(), job.counts[s][g], h, r));
      for (size_t i = 0; i < got.size(); ++i) {
        const double want = ref[offset + i];
        const double err = std::abs(static_cast<double>(got[i]) - want) / (1 + std::abs(want));
        row.max_rel_err = std::isfinite(err) ? std::max(row.max_rel_err, err) : INFINITY;
      }
      if (j == 0) {
        first = std::move(got);
      } else if (got != first) {
        row.ranks_agree = false;
      }
    }
    row.pass = row.ranks_agree && row.max_rel_err <= job.tolerance;
    offset += job.counts[s][g] * h;
    job.result.groups.push_back(row);
  }
  return absl::OkStatus();
}

// Step s (epoch s + 1): seeded tokens per DP group to each of its ranks,
// one ForwardLayers, the reference, the comparison and the step's line.
absl::Status RunStackStep(const StackJobOptions& options, StackJobState& job, int s,
                          std::ostream& out) {
  const int attn_dp = options.attn_dp_size;
  const int64_t h = job.config.hidden;
  const std::vector<int64_t>& counts = job.counts[s];
  std::vector<std::vector<float>> dp_tokens(attn_dp);
  std::vector<v1::Tensor> group_tensors(attn_dp);
  for (int g = 0; g < attn_dp; ++g) {
    const std::vector<core::bf16_t> x = GenerateHidden(options.seed, s, g, counts[g], h);
    dp_tokens[g].resize(x.size());
    for (size_t i = 0; i < x.size(); ++i) dp_tokens[g][i] = core::Bf16ToFloat(x[i]);
    group_tensors[g] = Bf16Tensor(x, counts[g], h);
  }
  std::vector<v1::ForwardLayersRequest> requests(options.tp_size);
  for (int r = 0; r < options.tp_size; ++r) {
    requests[r].set_epoch(s + 1);
    *requests[r].mutable_stack() = job.spec;
    *requests[r].mutable_tokens() = group_tensors[r / job.attn_tp()];
  }
  if (s == 0) {
    out << "step 0: ForwardLayers; the workers build the stack first (about "
        << FormatBytes(static_cast<double>(job.memory.worker_stack_bytes))
        << " of weights and workspace on rank 0)\n";
    out.flush();
  }
  const absl::Time start = absl::Now();
  ASSIGN_OR_RETURN(std::vector<v1::ForwardLayersResponse> responses,
                   job.group.coordinator->ForwardLayers(requests));
  const double forward_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
  const absl::Time ref_start = absl::Now();
  ASSIGN_OR_RETURN(std::vector<float> ref, StackReference(job, s, dp_tokens, out));
  const double reference_s = absl::ToDoubleSeconds(absl::Now() - ref_start);
  RETURN_IF_ERROR(CompareStackGroups(job, s, responses, ref, forward_ms));
  out << "step " << s << ": DP token counts [" << absl::StrJoin(counts, ", ") << "], "
      << responses[0].padding_mode() << ", " << responses[0].global_rows() << " global rows, "
      << absl::StrFormat("%.1f ms", forward_ms)
      << (responses[0].rebuilt() ? absl::StrFormat(" (stack built in %.1f ms)",
                                                   responses[0].timings().build_us() / 1000.0)
                                 : "")
      << absl::StrFormat(", reference %.1f s", reference_s) << "\n";
  out.flush();
  job.result.after_mlp_ops.assign(responses[0].after_mlp_ops().begin(),
                                  responses[0].after_mlp_ops().end());
  return absl::OkStatus();
}

}  // namespace

std::vector<int64_t> PlanStackTokenCounts(int64_t tokens_per_group, int attn_dp_size, int64_t step,
                                          uint64_t seed) {
  std::vector<int64_t> counts(std::max(attn_dp_size, 0), 0);
  std::mt19937_64 rng(seed * 0x9E3779B97F4A7C15ull + static_cast<uint64_t>(step) * 0x5851F42Dull +
                      0x57ac4ull);
  std::uniform_int_distribution<int64_t> dist(tokens_per_group / 2,
                                              tokens_per_group + tokens_per_group / 2);
  const int zero_group =
      attn_dp_size >= 2 && step % 2 == 0 ? static_cast<int>((step / 2) % attn_dp_size) : -1;
  std::set<int64_t> used;
  for (int g = 0; g < attn_dp_size; ++g) {
    if (g == zero_group) continue;
    int64_t c = std::max<int64_t>(dist(rng), 1);
    while (used.count(c) > 0) ++c;
    used.insert(c);
    counts[g] = c;
  }
  return counts;
}

bool StackJobResult::AllPass() const {
  return std::all_of(groups.begin(), groups.end(), [](const auto& g) { return g.pass; });
}

absl::Status ValidateStackJobOptions(const StackJobOptions& o) {
  if (o.tp_size < 1) return Bad("--tp", ">= 1", o.tp_size);
  if (o.attn_dp_size < 1 || o.tp_size % o.attn_dp_size != 0) {
    return Bad("--attn-dp", absl::StrCat("a divisor of --tp (", o.tp_size, ")"), o.attn_dp_size);
  }
  const int attn_tp = o.tp_size / o.attn_dp_size;
  if (o.moe_dense_tp_size != 0 && o.moe_dense_tp_size != 1 && o.moe_dense_tp_size != o.tp_size &&
      o.moe_dense_tp_size != attn_tp) {
    return Bad("--moe-dense-tp", absl::StrCat("1, ", attn_tp, " (attn_tp) or ", o.tp_size, " (tp)"),
               o.moe_dense_tp_size);
  }
  if (o.num_layers < 1) return Bad("--layers", ">= 1", o.num_layers);
  if (o.hidden < 0) return Bad("--hidden", ">= 0", o.hidden);
  if (o.moe_intermediate < 0) return Bad("--moe-intermediate", ">= 0", o.moe_intermediate);
  if (o.dense_intermediate < 0) return Bad("--dense-intermediate", ">= 0", o.dense_intermediate);
  if (o.tokens_per_group < 1) return Bad("--tokens", ">= 1", o.tokens_per_group);
  if (o.steps < 1) return Bad("--steps", ">= 1", o.steps);
  if (o.capacity_tokens < 0) return Bad("--capacity", ">= 0 (0 = automatic)", o.capacity_tokens);
  return absl::OkStatus();
}

absl::StatusOr<StackJobResult> RunStackJob(const StackJobOptions& options, std::ostream& out) {
  RETURN_IF_ERROR(ValidateStackJobOptions(options));
  StackJobState job;
  RETURN_IF_ERROR(ResolveStack(options, job));
  RETURN_IF_ERROR(PreflightStackMemory(options, job, out));
  RETURN_IF_ERROR(FormStackGroup(options, job, out));
  StartStackSteps(options, job);
  for (int s = 0; s < options.steps; ++s) RETURN_IF_ERROR(RunStackStep(options, job, s, out));
  return std::move(job.result);
}

std::string RenderStackSummary(const StackJobResult& result) {
  TextTable table({"step", "dp group", "tokens", "padding", "max rel err", "tolerance",
                   "ranks agree", "pass", "forward ms"});
  for (const StackGroupResult& g : result.groups) {
    table.AddRow({absl::StrCat(g.step), absl::StrCat(g.dp_group), absl::StrCat(g.tokens),
                  g.padding_mode, absl::StrFormat("%.3g", g.max_rel_err),
                  absl::StrFormat("%.3g", g.tolerance), g.ranks_agree ? "yes" : "NO",
                  g.pass ? "yes" : "NO", absl::StrFormat("%.1f", g.forward_ms)});
  }
  int sparse = 0;
  for (bool s : result.sparse_layers) sparse += s ? 1 : 0;
  return absl::StrCat(
      table.Render(), result.model_name, ": ", result.sparse_layers.size(), " layers (", sparse,
      " sparse), tp ", result.tp_size, ", attn_dp ", result.attn_dp_size,
      "; after-MLP steps run: ", absl::StrJoin(result.after_mlp_ops, ", "), "\n",
      result.AllPass() ? "PASS: every DP group matches the single-process reference\n"
                       : "FAIL: at least one DP group differs from the single-process reference\n");
}

nlohmann::json StackSummaryJson(const StackJobResult& result) {
  nlohmann::json groups = nlohmann::json::array();
  for (const StackGroupResult& g : result.groups) {
    groups.push_back({{"step", g.step},
                      {"dp_group", g.dp_group},
                      {"tokens", g.tokens},
                      {"padding_mode", g.padding_mode},
                      {"max_rel_err", g.max_rel_err},
                      {"tolerance", g.tolerance},
                      {"ranks_agree", g.ranks_agree},
                      {"pass", g.pass},
                      {"forward_ms", g.forward_ms}});
  }
  return {{"model", result.model_name},
          {"tp", result.tp_size},
          {"attn_dp", result.attn_dp_size},
          {"moe_dense_tp", result.moe_dense_tp_size},
          {"capacity_tokens", result.capacity_tokens},
          {"pass", result.AllPass()},
          {"sparse_layers", result.sparse_layers},
          {"after_mlp_ops", result.after_mlp_ops},
          {"groups", std::move(groups)},
          {"memory",
           {{"preflight_needed_bytes", result.memory.needed_bytes},
            {"preflight_worker_bytes", result.memory.worker_bytes},
            {"preflight_coordinator_bytes", result.memory.coordinator_bytes},
            {"available_bytes", result.memory_available_bytes}}}};
}

}  // namespace moe_ep::client
