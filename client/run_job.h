#pragma once

// `moe-ep run`, the main job (issue 2): a real MoE model's layers go through
// expert-parallel dispatch, expert compute and combine across the workers and
// every layer's output is checked against the single-process reference.
//
// Rebalancing (DESIGN §15; issue 17 item 4): with --rebalance-after S, after
// step S every run layer's load statistics (GetExpertLoad, summed over ranks)
// give an EPLB table with --redundant-slots slots a rank beyond ceil(E / W);
// it is installed (InstallPlacement), the layer's experts are loaded again
// for the new slots, and the remaining steps run under it; the load table
// (max/mean tokens per rank before, predicted and after) is printed at the
// end. The reference is dense, so verification is unchanged.
//
// Sequence: form the group; ConfigureLayers (tp = attn_dp = world, so every
// rank is its own DP group and the MoE layers run SCATTERED through the
// all-to-all; moe_dense_tp 1); AllocateWorkspace (capacity = the largest
// per-rank count of the run unless given); LoadExperts for the first L sparse
// layers (each with its own seeded weights; every worker builds only its own
// experts). Then per step s (epoch s + 1): per-rank token counts (uneven, one
// rank with zero tokens, or the trace's DP split), SyncTokenCounts -> R,
// (the routing's top-k weights times the model's routed_scaling_factor:
// moe-ep's convention is that the caller folds it in, DESIGN §7),
// CommitGeometry, and one Forward per layer; layer l + 1's input is the
// residual stream bf16(x_l + y_l), layer 0's is seeded N(0, 1) hidden
// states. Finally each layer is verified: its experts are generated in this
// process from the same seed a chunk at a time (client/streamed_reference.h:
// the result of core::DenseMoeReference with all experts, bit for bit, but
// one chunk in memory and chunks no token selects never made) plus the
// layer's shared expert (core::SharedExpert, the same seed), and the
// reference of every (step, rank) input is compared with the workers' output
// under client/tolerance.h.
//
// Before any worker starts, a memory preflight (client/memory_budget.h)
// checks what the local workers and this process will hold against
// MemAvailable; a run that does not fit fails at once, naming the options
// that do (--experts identity, fewer --layers, --targets). Local workers get
// an equal share of the memory as --memory-cap-bytes, so a worker refuses
// with RESOURCE_EXHAUSTED instead of being OOM-killed.

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "client/expert_rebalance.h"
#include "client/memory_budget.h"
#include "client/tolerance.h"
#include "client/worker_selection.h"
#include "core/bf16.h"
#include "core/model_config.h"
#include "core/workspace.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {

struct RunJobOptions {
  std::string model = "qwen3-30b-a3b";  // config path or preset
  WorkerSelection workers;
  int num_layers = 3;             // L: the first L sparse layers run
  int64_t tokens_per_rank = 256;  // mean tokens per rank and step (trace: prescribed)
  // Every rank gets exactly tokens_per_rank tokens (no zero-token rank), e.g.
  // for "4096 tokens per rank" runs; ignored for trace routing.
  bool even_tokens = false;
  int steps = 2;
  std::string routing = "skewed";  // uniform | skewed[:S] | trace:FILE | load:FILE
  uint64_t seed = 1;
  // swiglu (bf16) | identity | checkpoint (the model's quantization_config
  // format: fp8 experts on every plane, mxfp4 on gloo; bf16 without one).
  std::string experts = "swiglu";
  int64_t capacity_tokens = 0;  // N; 0 = the largest per-rank count of the run
  Tolerance tolerance;
  absl::Duration rpc_timeout = absl::Seconds(600);
  // DESIGN §15: expert slots a worker may hold beyond ceil(E / workers)
  // (AllocateWorkspace.redundant_slots_per_rank), and the step after which
  // every run layer is rebalanced from the workers' load statistics with
  // core::RebalanceHierarchical (0 = never; else in [1, steps - 1]).
  int redundant_slots_per_rank = 0;
  int rebalance_after_steps = 0;
  // The dispatch payload (AllocateWorkspace.dispatch_dtype; issue 15 item 4):
  // bf16, or fp8_e4m3 (e4m3, one fp32 scale per 128 values). With fp8 the
  // reference's routed experts read core::DispatchedHidden of each input,
  // the same e4m3 rounding every data plane applies (core/fp8_e4m3.h), so
  // the bf16 tolerance below still bounds the difference; the shared expert
  // reads the unrounded input on both sides (it runs on the source rank).
  core::DispatchDType dispatch_dtype = core::DispatchDType::kBF16;
  // --attach (issue 12 item 6): drive the steps on the group the --targets
  // workers already form (e.g. `moe-ep coordinator`'s) instead of forming
  // one: no Lease, Join, ConfigureLayers, AllocateWorkspace or LoadExperts
  // (the step calls are not leased). The group must be ALLOCATED in the main
  // job's layout with this run's model, layers, experts and seed loaded and
  // a workspace of at least the run's largest count
  // (client/group_session.h AttachFormedGroup); every step is verified as in
  // a formed run, so experts that differ show as a failing layer.
  bool attach = false;
  // Rank masks (DESIGN §15; issue 17 item 4), workers this run started (any
  // backend): just before step kill_at_step (1-based) worker kill_rank is
  // killed with SIGKILL; the survivors mask it and the step is sent again to
  // them (its tokens are gone: 0 tokens from that step on). With redundant slots each
  // run layer first gets RingReplicaTable (client/run_masks.h), so some of
  // its experts live on; the others are reported lost and contribute zero,
  // and the reference drops them alike. With restart_at_step (> kill), the
  // worker is restarted before that step and re-admitted
  // (Coordinator::RejoinRank); the later steps run on every rank.
  int kill_rank = -1;       // -1: no kill
  int kill_at_step = 0;     // 1-based; 0 = never
  int restart_at_step = 0;  // 1-based; 0 = the rank stays masked
};

// What the rank-mask demonstration measured (RunJobOptions::kill_rank).
struct MaskRunSummary {
  int kill_rank = -1;  // -1: none ran
  int kill_at_step = 0;
  int restart_at_step = 0;
  double kill_to_first_step_ms = 0;     // SIGKILL -> the step completed on the survivors
  int attempts = 0;                     // sends of that step
  std::vector<int> lost_experts;        // no live replica (from the table), per run layer alike
  std::vector<int> reported_lost;       // what the workers reported (ForwardResponse)
  double rejoin_ms = 0;                 // restart + RejoinRank
  double restart_to_first_step_ms = 0;  // restart -> the next step completed on every rank
};

// Errors: kInvalidArgument naming the flag: num_layers < 1, tokens < 1,
// steps < 1, capacity < 0, experts not swiglu/identity, tolerance negative,
// a dispatch dtype other than bf16 / fp8_e4m3 (or fp8 with a hidden size
// that is not a multiple of 128: RunJob, once the model is resolved),
// redundant slots < 0, a rebalance step outside [0, steps - 1], a
// rebalance without redundant slots, --attach without --targets or with
// --rebalance-after / --redundant-slots; --kill-rank without --kill-at-step
// (or the reverse), a kill step outside [1, steps], a restart step not in
// (kill step, steps], a kill with --targets, --attach or --rebalance-after.
// RunJob: a kill rank outside [0, workers) or a backend other than gloo.
absl::Status ValidateRunJobOptions(const RunJobOptions& options);

// Token counts of step `step` on `world` ranks for a mean of
// `tokens_per_rank`: with world >= 2, rank (world - 1 + step) % world has 0
// tokens and every other rank a seeded count in [T/2, 3T/2] (T rounded down
// for the lower end); with world 1 the one rank has T. Deterministic in
// (tokens_per_rank, world, step, seed).
std::vector<int64_t> PlanTokenCounts(int64_t tokens_per_rank, int world, int64_t step,
                                     uint64_t seed);

// Seeded hidden states [T, H] (bf16 of N(0, 1)) of (seed, step, rank).
std::vector<core::bf16_t> GenerateHidden(uint64_t seed, int64_t step, int rank, int64_t num_tokens,
                                         int64_t hidden);

// Bytes of one sparse layer's routed experts in `format`: num_experts *
// core::quant::ExpertWeightBytes (bf16: 3 * I * H * 2; fp8: 3 * I * H +
// the 128 x 128 block scales; issue 35).
int64_t ExpertBytesPerLayer(
    const core::ModelDescription& model,
    core::quant::ExpertWeightFormat format = core::quant::ExpertWeightFormat::kBf16);

struct LayerRunSummary {
  int layer = 0;           // model layer index
  int64_t tokens = 0;      // summed over steps and ranks
  int64_t max_r = 0;       // largest R of its steps
  int64_t bytes_sent = 0;  // dispatch + combine bytes to other ranks, all ranks and steps
  double forward_s = 0.0;  // wall time of its Forward fan-outs
  Comparison comparison;   // against the reference, all steps and ranks
  // Worker-reported phase times (ForwardTimings), summed over steps, the
  // largest rank of each step: dispatch, the shared expert, and the part of
  // the shared expert that overlapped the dispatch (GPU only).
  int64_t dispatch_us = 0;
  int64_t shared_us = 0;
  int64_t shared_overlap_us = 0;
};

struct RunJobResult {
  std::string model_name;
  // The model's shared expert (run on every layer when present) and the
  // routed scaling folded into the top-k weights sent (issue 18).
  core::SharedExpertConfig shared_expert;
  double routed_scaling_factor = 1.0;
  int world = 0;
  int steps = 0;
  std::vector<LayerRunSummary> layers;
  std::vector<int64_t> expert_bytes_per_rank;  // experts loaded on each worker, all run layers
  int64_t layer_expert_bytes = 0;              // ExpertBytesPerLayer
  int num_sparse_layers = 0;
  bool identity_experts = false;  // --experts identity: no weights held
  // The routed experts' weight format (core::quant::ExpertWeightFormatName:
  // "bf16", "fp8-block128", "mxfp4"), named by the memory table.
  std::string expert_format = "bf16";
  core::DispatchDType dispatch_dtype = core::DispatchDType::kBF16;
  Tolerance tolerance;
  RunMemoryEstimate memory;            // the preflight's estimate
  int64_t memory_available_bytes = 0;  // MemAvailable at start; 0 when unknown
  // Per run layer when --rebalance-after ran: the load table (DESIGN §15).
  std::vector<LayerRebalance> rebalance;
  MaskRunSummary masks;              // kill_rank >= 0: the rank-mask run
  int reference_chunks_made = 0;     // verification chunks, all layers
  int reference_chunks_skipped = 0;  // chunks no token selected

  bool AllPass() const;
};

// Runs the job, printing progress lines to `out` (with options.attach, on
// the workers' formed group: AttachFormedGroup's errors).
// Errors, before any worker starts: ValidateRunJobOptions, ResolveModel,
// RoutingSource::Create and ParseTargets errors; kInvalidArgument for
// --workers < 1 or fewer experts than ranks; kResourceExhausted when the
// memory preflight finds the run too large for this machine (CheckRunMemory's
// message: needed vs available and the options). Then worker and coordinator
// errors (aggregated per rank). A layer that disagrees with the reference is
// not an error: see RunJobResult::AllPass().
absl::StatusOr<RunJobResult> RunJob(const RunJobOptions& options, std::ostream& out);

// The summary table (per layer: tokens, R, bytes sent, time, max abs error,
// bound, pass; a total row with tokens/s) and the memory footprint.
std::string RenderRunSummary(const RunJobResult& result);

// The summary as JSON, for scripts and dashboards (issue 9 item 6):
// {"model", "world", "steps", "pass", "identity_experts", "dispatch_dtype",
//  "shared_expert" (client/plan_command.h SharedExpertJson),
//  "routed_scaling_factor",
//  "tolerance": {"rel", "atol"},
//  "layers": [{"layer", "tokens", "max_r", "bytes_sent", "forward_s",
//              "max_abs_err", "max_abs_ref", "bound", "elements", "pass",
//              "dispatch_us", "shared_us", "shared_overlap_us"}],
//  "total": {"tokens", "bytes_sent", "forward_s", "tokens_per_s",
//            "max_abs_err"},
//  "memory": {"expert_bytes_per_rank": [...], "layer_expert_bytes",
//             "num_sparse_layers", "preflight_needed_bytes",
//             "preflight_worker_bytes", "preflight_coordinator_bytes",
//             "available_bytes" (0 when unknown)},
//  "reference_chunks": {"made", "skipped"},
//  "rebalance": [{"layer", "before_max_over_mean", "predicted_max_over_mean",
//                 "after_max_over_mean", "slots_per_rank",
//                 "redundant_slots_per_rank"}] (empty without --rebalance-after)}.
// Sums are over the layers (as the table's total row); tokens_per_s is 0
// when no time passed; a non-finite error is null.
nlohmann::json RunSummaryJson(const RunJobResult& result);

}  // namespace moe_ep::client
