// The run job's report (client/run_job.h): the summary table and the JSON.

#include <unistd.h>

#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/plan_command.h"
#include "client/run_job.h"
#include "client/text_table.h"
#include "core/model_config.h"

namespace moe_ep::client {

namespace {

// The per-layer table and its total row; *tokens and *seconds (zero on
// entry) get the totals for the throughput line.
std::string LayerTable(const RunJobResult& result, int64_t* tokens, double* seconds) {
  TextTable table({"layer", "tokens", "R", "bytes sent", "time", "max abs err", "bound", "result"});
  int64_t bytes = 0, max_r = 0;
  double max_err = 0;
  for (const LayerRunSummary& l : result.layers) {
    table.AddRow(
        {absl::StrCat(l.layer), absl::StrCat(l.tokens), absl::StrCat(l.max_r),
         FormatBytes(static_cast<double>(l.bytes_sent)), absl::StrFormat("%.3f s", l.forward_s),
         absl::StrFormat("%.3g", l.comparison.max_abs_err),
         absl::StrFormat("%.3g", l.comparison.bound), l.comparison.pass ? "PASS" : "FAIL"});
    *tokens += l.tokens;
    bytes += l.bytes_sent;
    max_r = std::max(max_r, l.max_r);
    *seconds += l.forward_s;
    max_err = std::max(max_err, l.comparison.max_abs_err);
  }
  table.AddRow({"total", absl::StrCat(*tokens), absl::StrCat(max_r),
                FormatBytes(static_cast<double>(bytes)), absl::StrFormat("%.3f s", *seconds),
                absl::StrFormat("%.3g", max_err), "", result.AllPass() ? "PASS" : "FAIL"});
  return table.Render();
}

// With a shared expert: its compute and overlap line; else "".
std::string SharedExpertLine(const RunJobResult& result) {
  std::string text;
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
  return text;
}

// With a kill: the rank-mask line (and the restart's); else "".
std::string MaskLine(const RunJobResult& result) {
  std::string text;
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
  return text;
}

// The memory footprint table (routed experts; the preflight's figures).
std::string MemoryTable(const RunJobResult& result) {
  int64_t max_rank_bytes = 0;
  for (int64_t b : result.expert_bytes_per_rank) max_rank_bytes = std::max(max_rank_bytes, b);
  const double all_layers =
      static_cast<double>(result.layer_expert_bytes) * result.num_sparse_layers;
  const double pages = static_cast<double>(sysconf(_SC_PHYS_PAGES));
  const double page_size = static_cast<double>(sysconf(_SC_PAGESIZE));
  TextTable memory(
      {absl::StrCat("memory footprint (routed experts, ", result.expert_format, ")"), "bytes"});
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
  return memory.Render();
}

// The notes under the tables: identity experts, fp8 dispatch, tolerance.
std::string RunNotes(const RunJobResult& result) {
  std::string text;
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

}  // namespace

std::string RenderRunSummary(const RunJobResult& result) {
  int64_t tokens = 0;
  double seconds = 0;
  std::string text = LayerTable(result, &tokens, &seconds);
  text += SharedExpertLine(result);
  text += MaskLine(result);
  absl::StrAppendFormat(&text, "throughput: %.0f tokens/s through %d MoE layer(s) on %d ranks\n",
                        seconds > 0 ? tokens / seconds : 0.0, result.layers.size(), result.world);
  text += MemoryTable(result);
  text += RunNotes(result);
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
