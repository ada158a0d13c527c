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
  ASSIGN_OR_RETURN(core::ModelDescription model, ResolveModel(options.model));
  if (options.num_layers > model.num_layers) {
    return Bad("--layers", absl::StrCat("<= ", model.num_layers, " (", model.name, "'s layers)"),
               options.num_layers);
  }
  const int tp = options.tp_size;
  const int attn_dp = options.attn_dp_size;
  const int attn_tp = tp / attn_dp;

  // The stack, as the workers will resolve it (sizes sent explicitly).
  core::LayerStackConfig config;
  config.layout = core::ParallelLayout{tp, attn_dp, options.moe_dense_tp_size};
  config.sparse_layers.assign(model.sparse_layers.begin(),
                              model.sparse_layers.begin() + options.num_layers);
  config.a2a_enabled = options.a2a_enabled;
  config.hidden = options.hidden > 0 ? options.hidden : model.hidden_size;
  config.moe_intermediate =
      options.moe_intermediate > 0 ? options.moe_intermediate : model.moe_intermediate_size;
  const bool any_dense = std::find(config.sparse_layers.begin(), config.sparse_layers.end(),
                                   false) != config.sparse_layers.end();
  const bool any_sparse = std::find(config.sparse_layers.begin(), config.sparse_layers.end(),
                                    true) != config.sparse_layers.end();
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

  // Token counts per (step, DP group); capacity bounds every rank's SCATTERED rows.
  std::vector<std::vector<int64_t>> counts(options.steps);
  int64_t max_count = 0;
  for (int s = 0; s < options.steps; ++s) {
    counts[s] = PlanStackTokenCounts(options.tokens_per_group, attn_dp, s, options.seed);
    for (int64_t c : counts[s]) max_count = std::max(max_count, c);
  }
  config.capacity_tokens =
      options.capacity_tokens > 0 ? options.capacity_tokens : max_count + attn_tp;
  {
    absl::Status valid = core::ValidateLayerStackConfig(config);
    if (!valid.ok()) return absl::InvalidArgumentError(absl::StrCat("stack: ", valid.message()));
  }
  ASSIGN_OR_RETURN(std::vector<core::LayerPlan> plans,
                   core::PlanLayers(config.layout, config.sparse_layers, config.a2a_enabled));
  const double tolerance = any_sparse ? kSparseTol : kDenseTol;

  WorkerSelection selection = options.workers;
  selection.backend = "gloo";  // the layer stack runs on the Gloo backend
  selection.num_workers = tp;
  const bool local = selection.targets.empty();
  if (!local) {
    ASSIGN_OR_RETURN(std::vector<std::string> targets, ParseTargets(selection.targets));
    if (static_cast<int>(targets.size()) != tp) {
      return Bad("--targets", absl::StrCat(tp, " workers (--tp)"),
                 static_cast<int64_t>(targets.size()));
    }
  }

  // Memory preflight: fail here, before any worker starts, when the stack
  // cannot fit on this machine (issue 9).
  StackMemoryInput memory_input;
  memory_input.config = config;
  memory_input.num_local_workers = local ? tp : 0;
  for (int s = 0; s < options.steps; ++s) {
    int64_t step_rows = 0;
    for (int64_t c : counts[s]) step_rows += c;
    memory_input.step_rows = std::max(memory_input.step_rows, step_rows);
  }
  memory_input.gathered_rows = attn_dp * max_count;
  ASSIGN_OR_RETURN(StackMemoryEstimate memory, EstimateStackMemory(memory_input));
  const absl::StatusOr<int64_t> available = core::AvailableMemoryBytes();
  if (available.ok()) {
    RETURN_IF_ERROR(CheckStackMemory(memory_input, *available));
    selection.worker_memory_cap_bytes =
        StackWorkerMemoryCapBytes(memory, memory_input.num_local_workers, *available);
    out << "memory: needs about " << FormatBytes(static_cast<double>(memory.needed_bytes))
        << " here (";
    if (local) {
      out << tp << " local worker(s) x " << FormatBytes(static_cast<double>(memory.worker_bytes))
          << ", capped at " << FormatBytes(static_cast<double>(selection.worker_memory_cap_bytes))
          << " each; ";
    }
    out << "this process " << FormatBytes(static_cast<double>(memory.coordinator_bytes))
        << " with the reference's largest layer) of "
        << FormatBytes(static_cast<double>(*available)) << " available\n";
  } else {
    out << "memory: preflight skipped (" << available.status().message()
        << "); local workers run uncapped\n";
  }
  out << (local ? absl::StrCat("workers: starting ", tp, " local Gloo workers")
                : absl::StrCat("workers: attaching ", tp, " --targets workers"))
      << " and forming the group\n";
  out.flush();

  ASSIGN_OR_RETURN(AttachedWorkers workers, AttachWorkers(selection));
  CoordinatorOptions copts;
  copts.rpc_timeout = options.rpc_timeout;
  // workers.backend is "gloo" (selection.backend above).
  ASSIGN_OR_RETURN(GroupSession group, FormWorkerGroup(workers, copts));
  Coordinator* const coordinator = group.coordinator.get();
  out << "group: " << tp << " workers ("
      << (workers.cluster ? "embedded local cluster" : "--targets") << ", backend gloo, generation "
      << coordinator->generation() << "): " << absl::StrJoin(workers.targets, " ") << "\n";
  out.flush();

  v1::ConfigureLayersRequest configure;
  configure.mutable_layout()->set_tp_size(tp);
  configure.mutable_layout()->set_attn_dp_size(attn_dp);
  configure.mutable_layout()->set_moe_dense_tp_size(options.moe_dense_tp_size);
  configure.set_a2a_enabled(options.a2a_enabled);
  v1::ModelDescription* md = configure.mutable_model();
  md->set_name(absl::StrCat(model.name, " (stand-in stack)"));
  md->set_hidden_size(config.hidden);
  md->set_num_layers(options.num_layers);
  md->set_num_experts(config.num_experts);
  md->set_top_k(config.top_k);
  md->set_moe_intermediate_size(config.moe_intermediate);
  for (bool s : config.sparse_layers) md->add_sparse_layers(s);
  ASSIGN_OR_RETURN(std::vector<v1::ConfigureLayersResponse> configured,
                   coordinator->ConfigureLayers(configure));
  out << "configured: " << model.name << ", first " << options.num_layers << " layers, tp " << tp
      << ", attn_dp " << attn_dp << ", moe_dense_tp "
      << (options.moe_dense_tp_size == 0 ? std::string("unset")
                                         : absl::StrCat(options.moe_dense_tp_size))
      << ", a2a " << (options.a2a_enabled ? "on" : "off") << "; H " << config.hidden
      << ", expert I " << config.moe_intermediate << ", dense I " << config.dense_intermediate
      << ", " << config.num_experts << " experts, top-" << config.top_k << ", capacity "
      << config.capacity_tokens << "; plan fingerprint " << configured[0].fingerprint() << "\n"
      << core::FormatPlanTable(plans);
  out.flush();

  v1::LayerStackSpec spec;
  spec.set_hidden_size(config.hidden);
  spec.set_dense_intermediate_size(config.dense_intermediate);
  spec.set_moe_intermediate_size(config.moe_intermediate);
  spec.set_num_experts(config.num_experts);
  spec.set_top_k(config.top_k);
  spec.set_seed(config.seed);
  spec.set_rms_eps(config.rms_eps);
  spec.set_allow_reduce_scatter(config.allow_reduce_scatter);
  spec.set_capacity_tokens(config.capacity_tokens);

  StackJobResult result;
  result.model_name = model.name;
  result.tp_size = tp;
  result.attn_dp_size = attn_dp;
  result.moe_dense_tp_size = options.moe_dense_tp_size;
  result.capacity_tokens = config.capacity_tokens;
  result.sparse_layers = config.sparse_layers;
  result.memory = memory;
  result.memory_available_bytes = available.ok() ? *available : 0;
  const int64_t h = config.hidden;
  for (int s = 0; s < options.steps; ++s) {
    std::vector<std::vector<float>> dp_tokens(attn_dp);
    std::vector<v1::Tensor> group_tensors(attn_dp);
    for (int g = 0; g < attn_dp; ++g) {
      const std::vector<core::bf16_t> x = GenerateHidden(options.seed, s, g, counts[s][g], h);
      dp_tokens[g].resize(x.size());
      for (size_t i = 0; i < x.size(); ++i) dp_tokens[g][i] = core::Bf16ToFloat(x[i]);
      group_tensors[g] = Bf16Tensor(x, counts[s][g], h);
    }
    std::vector<v1::ForwardLayersRequest> requests(tp);
    for (int r = 0; r < tp; ++r) {
      requests[r].set_epoch(s + 1);
      *requests[r].mutable_stack() = spec;
      *requests[r].mutable_tokens() = group_tensors[r / attn_tp];
    }
    if (s == 0) {
      out << "step 0: ForwardLayers; the workers build the stack first (about "
          << FormatBytes(static_cast<double>(memory.worker_stack_bytes))
          << " of weights and workspace on rank 0)\n";
      out.flush();
    }
    const absl::Time start = absl::Now();
    ASSIGN_OR_RETURN(std::vector<v1::ForwardLayersResponse> responses,
                     coordinator->ForwardLayers(requests));
    const double forward_ms = absl::ToDoubleMilliseconds(absl::Now() - start);
    // The reference, layer by layer as it goes on the first step (a real
    // model's sparse layer builds every expert here).
    const absl::Time ref_start = absl::Now();
    absl::Time layer_start = ref_start;
    const std::function<void(int)> on_layer = [&](int layer) {
      const absl::Time now = absl::Now();
      out << absl::StrFormat("  reference (this process): layer %d (%s) in %.1f s\n", layer,
                             config.sparse_layers[layer] ? "sparse" : "dense",
                             absl::ToDoubleSeconds(now - layer_start));
      out.flush();
      layer_start = now;
    };
    ASSIGN_OR_RETURN(std::vector<float> ref,
                     core::ReferenceLayerStack(config, dp_tokens, s == 0 ? on_layer : nullptr));
    const double reference_s = absl::ToDoubleSeconds(absl::Now() - ref_start);

    int64_t offset = 0;
    for (int g = 0; g < attn_dp; ++g) {
      StackGroupResult row;
      row.step = s;
      row.dp_group = g;
      row.tokens = counts[s][g];
      row.padding_mode = responses[0].padding_mode();
      row.tolerance = tolerance;
      row.forward_ms = forward_ms;
      std::vector<float> first;
      for (int j = 0; j < attn_tp; ++j) {
        const int r = g * attn_tp + j;
        ASSIGN_OR_RETURN(std::vector<float> got,
                         Fp32Values(responses[r].output(), counts[s][g], h, r));
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
      row.pass = row.ranks_agree && row.max_rel_err <= tolerance;
      offset += counts[s][g] * h;
      result.groups.push_back(row);
    }
    out << "step " << s << ": DP token counts [" << absl::StrJoin(counts[s], ", ") << "], "
        << responses[0].padding_mode() << ", " << responses[0].global_rows() << " global rows, "
        << absl::StrFormat("%.1f ms", forward_ms)
        << (responses[0].rebuilt() ? absl::StrFormat(" (stack built in %.1f ms)",
                                                     responses[0].timings().build_us() / 1000.0)
                                   : "")
        << absl::StrFormat(", reference %.1f s", reference_s) << "\n";
    out.flush();
    result.after_mlp_ops.assign(responses[0].after_mlp_ops().begin(),
                                responses[0].after_mlp_ops().end());
  }
  return result;
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
