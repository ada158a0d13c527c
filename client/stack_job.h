#pragma once

// `moe-ep stack`: a stack of K decoder layers run across the workers under DP
// attention + EP with the ForwardLayers RPC (proto/moe_ep/v1/worker.proto),
// every DP group's output verified against core::ReferenceLayerStack computed
// in this process (issue 4). A separate subcommand rather than a mode of
// `moe-ep run`: `run` drives one MoE layer at a time through
// Forward with tp = attn_dp = world and real-sized experts, while this job
// drives whole stacks (attention stand-in, dense and sparse MLPs, every
// scatter-mode step) with its own layout flags and small stand-in weights.
//
// Sequence: start tp Gloo workers (or attach --targets, tp of them, and
// hold their lease while the job runs: acquired, renewed every TTL/3 and
// released by client/lease_renewer.h, refused without changing anything when
// another owner holds it; issue 12); form the group; ConfigureLayers with the layout (tp, attn_dp,
// moe_dense_tp), the all-to-all switch and the model's first K layers (its sparse pattern); then
// per step s (epoch s + 1): per-DP-group token counts (PlanStackTokenCounts: different per group, a
// zero-token group on even steps when attn_dp >= 2), the DP group's tokens (GenerateHidden(seed, s,
// group), bf16 values sent as a bf16 tensor) to each of its attention-TP ranks, one ForwardLayers;
// each rank's output is compared with the reference rows of its DP group.
//
// Sizes: the model gives the sparse pattern, experts, top-k and RMS eps;
// hidden, expert and dense intermediate sizes are the model's unless
// overridden. The default model, the "tiny-moe" preset (H 128, 4 layers with
// layer 0 dense, 8 experts, top-2, expert I 256, dense I 512), runs in well
// under a second per step on a CPU; a real model is made CPU-friendly by
// shrinking its sizes, e.g. --model DeepSeek-V2-Lite.json --layers 3
// --hidden 64 --moe-intermediate 32 --dense-intermediate 128 (its real
// pattern: layer 0 dense; 64 experts, top-6).
//
// Tolerance (core/layer_stack.h): element passes when |out - ref| <= tol *
// (1 + |ref|), tol = 2^-7 when a sparse layer runs (bf16 at the MoE boundary),
// 1e-4 for dense-only stacks (fp32 reassociation only).

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/stack_memory_budget.h"
#include "client/worker_selection.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {

struct StackJobOptions {
  std::string model = "tiny-moe";  // config path or preset
  // Workers: tp local Gloo workers unless workers.targets is set (then tp
  // targets, with workers.lease); workers.num_workers and workers.backend
  // are ignored.
  WorkerSelection workers;
  int tp_size = 2;
  int attn_dp_size = 1;
  int moe_dense_tp_size = 0;  // 0 = unset (= tp), 1, or attn_tp
  bool a2a_enabled = true;
  int num_layers = 4;              // K: the model's first K layers
  int64_t hidden = 0;              // 0 = the model's
  int64_t moe_intermediate = 0;    // 0 = the model's
  int64_t dense_intermediate = 0;  // 0 = the model's dense MLP size
  int64_t tokens_per_group = 12;   // mean tokens per DP group and step
  int steps = 2;
  uint64_t seed = 1;
  bool allow_reduce_scatter = false;
  // All-to-all capacity N, tokens per rank; 0 = the largest DP group's count
  // + attn_tp (what every step's SCATTERED rows fit in).
  int64_t capacity_tokens = 0;
  // As every --rpc-timeout (client/cli_validators.h kDefaultRpcTimeoutSeconds).
  absl::Duration rpc_timeout = absl::Seconds(600);
};

// One (step, DP group) of the run.
struct StackGroupResult {
  int step = 0;
  int dp_group = 0;
  int64_t tokens = 0;
  std::string padding_mode;  // of the step
  double max_rel_err = 0.0;  // max over its ranks' elements of |out-ref| / (1+|ref|)
  double tolerance = 0.0;    // the tol above
  bool ranks_agree = true;   // every attention-TP rank returned the same bits
  bool pass = true;          // max_rel_err <= tolerance, finite, ranks agree
  double forward_ms = 0.0;   // the step's ForwardLayers fan-out
};

struct StackJobResult {
  std::string model_name;
  int tp_size = 0;
  int attn_dp_size = 0;
  int moe_dense_tp_size = 0;
  int64_t capacity_tokens = 0;             // N the workers were given
  std::vector<bool> sparse_layers;         // [K]
  std::vector<std::string> after_mlp_ops;  // [K], rank 0 of the last step
  std::vector<StackGroupResult> groups;
  StackMemoryEstimate memory;          // the preflight's estimate
  int64_t memory_available_bytes = 0;  // MemAvailable at start; 0 when unknown
  bool AllPass() const;
};

// Token counts of the DP groups in step `step` for a mean of
// `tokens_per_group`: seeded counts in [T/2, 3T/2], pairwise different
// (a drawn count already taken moves up by one until free); on even steps
// with attn_dp_size >= 2, DP group (step / 2) % attn_dp_size has 0 tokens.
// Deterministic in its arguments.
// Example: attn_dp 2, 2 steps: step 0 one group empty, step 1 both non-empty
// and different.
std::vector<int64_t> PlanStackTokenCounts(int64_t tokens_per_group, int attn_dp_size, int64_t step,
                                          uint64_t seed);

// Errors (kInvalidArgument naming the flag): tp < 1, attn_dp < 1 or not
// dividing tp, moe_dense_tp not in {0, 1, tp, tp/attn_dp}, layers < 1, sizes
// < 0, tokens < 1, steps < 1, capacity < 0.
absl::Status ValidateStackJobOptions(const StackJobOptions& options);

// Runs the job, printing progress lines to `out` as it goes (flushed: the
// memory preflight, the group, the plan, the first step's reference layer by
// layer, one line per step).
// Before any worker starts, a memory preflight (client/stack_memory_budget.h)
// checks what the local workers and this process will hold against
// MemAvailable; local workers get an equal share as --memory-cap-bytes.
// Errors: ValidateStackJobOptions and ResolveModel errors; kResourceExhausted
// when the stack does not fit on this machine (CheckStackMemory's message:
// needed vs available and the options); kInvalidArgument
// when --layers exceeds the model's layers, the model has no dense MLP size
// while a dense layer runs and --dense-intermediate is 0, or --targets does
// not list tp workers; then worker and coordinator errors (aggregated per
// rank). A group that disagrees with the reference is not an error: see
// StackJobResult::AllPass().
absl::StatusOr<StackJobResult> RunStackJob(const StackJobOptions& options, std::ostream& out);

// The summary table: one row per (step, DP group) with tokens, padding, max
// relative error, tolerance, pass and time, then a verdict line.
std::string RenderStackSummary(const StackJobResult& result);

// The summary as JSON (issue 9 item 6): {"model", "tp", "attn_dp",
// "moe_dense_tp", "capacity_tokens", "pass", "sparse_layers": [bool],
// "after_mlp_ops": [name], "groups": [{"step", "dp_group", "tokens",
// "padding_mode", "max_rel_err", "tolerance", "ranks_agree", "pass",
// "forward_ms"}], "memory": {"preflight_needed_bytes",
// "preflight_worker_bytes", "preflight_coordinator_bytes",
// "available_bytes" (0 when unknown)}}. A non-finite error is null.
nlohmann::json StackSummaryJson(const StackJobResult& result);

}  // namespace moe_ep::client
