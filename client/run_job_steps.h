#pragma once

// The steps of `moe-ep run` (client/run_job.h RunJob; issue 34 item 3): the
// job's state and one function per step, in the order RunJob calls them.
// Internal to the run job's files (run_job*.cc); the public interface is
// client/run_job.h. Each step reads what the earlier ones filled in
// RunJobState, prints its progress lines to `out` and returns the first
// error. Not thread-safe: one job, one thread.

#include <cstdint>
#include <optional>
#include <ostream>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "client/coordinator.h"
#include "client/group_session.h"
#include "client/memory_budget.h"
#include "client/run_job.h"
#include "client/worker_selection.h"
#include "core/bf16.h"
#include "core/model_config.h"
#include "core/placement_table.h"
#include "core/quantized_weights.h"
#include "core/routing_source.h"
#include "moe_ep/v1/worker.pb.h"

namespace moe_ep::client::run_job_internal {

// What one (step, rank) fed into one layer and got back.
struct RankStep {
  int64_t num_tokens = 0;
  std::vector<core::bf16_t> input;   // [T, H]
  std::vector<int32_t> ids;          // [T, K]
  std::vector<float> weights;        // [T, K]
  std::vector<core::bf16_t> output;  // [T, H]
};

// Everything the steps share, filled step by step. Members are destroyed
// in reverse order: the group (its lease and channels) before the workers
// (the embedded local cluster).
struct RunJobState {
  // ResolveRunModel.
  core::ModelDescription model;
  std::vector<int> sparse;      // the model's MoE layer indices
  std::vector<int> run_layers;  // the first RunJobOptions::num_layers of them
  core::RoutingSource routing;
  bool identity = false;  // --experts identity
  // --experts checkpoint: the model's quantization_config format; else bf16.
  core::quant::ExpertWeightFormat format = core::quant::ExpertWeightFormat::kBf16;
  bool scale_input = false;  // the router weight scales the expert's input (Llama-4)

  // PlanRunSteps.
  LocalWorkerPlan worker_plan;
  int world = 0;
  std::vector<std::vector<int64_t>> counts;  // [step][rank] tokens, masked ranks 0
  int64_t max_count = 0;                     // the largest per-rank count
  int64_t rows_per_layer = 0;                // all steps' tokens of one layer
  int64_t max_step_rows = 0;                 // the most tokens of one step
  bool kills = false;                        // RunJobOptions::kill_rank >= 0
  int64_t capacity = 0;                      // the workspace's N

  // PreflightRunMemory.
  RunMemoryEstimate memory;
  WorkerSelection selection;          // the options' workers, memory cap set
  absl::StatusOr<int64_t> available;  // MemAvailable, or why it is unknown

  // FormRunGroup.
  AttachedWorkers workers;
  RankSetup setup;  // what a restarted rank is sent (RejoinRank)
  GroupSession group;
  std::vector<v1::GetStatusResponse> attached;  // --attach: each rank's GetStatus

  // LoadRunExperts: the table a kill run serves by (RingReplicaTable with
  // redundant slots, else the contiguous one); empty without a kill.
  std::optional<core::PlacementTable> mask_table;

  // RunSteps: record[layer index][step][rank].
  std::vector<std::vector<std::vector<RankStep>>> record;

  RunJobResult result;

  Coordinator& coordinator() const { return *group.coordinator; }
};

// Step 1, no workers yet: resolves options.model (ResolveModel), picks the
// run layers and creates the routing source; prints the job's header lines.
// Errors: ResolveModel's and RoutingSource::Create's; kInvalidArgument when
// --layers exceeds the model's MoE layers.
absl::Status ResolveRunModel(const RunJobOptions& options, RunJobState& job, std::ostream& out);

// Step 2, no workers yet: the group's size (PlanWorkers) and every step's
// per-rank token counts (a killed rank's masked steps 0), and the capacity
// N that bounds them. Errors: kInvalidArgument for --workers < 1, fewer
// experts than ranks, or a kill rank outside [0, world) (world >= 2);
// PlanWorkers's.
absl::Status PlanRunSteps(const RunJobOptions& options, RunJobState& job);

// True when step s (0-based) runs with the killed rank masked: from
// --kill-at-step up to (not including) --restart-at-step.
bool MaskedStep(const RunJobOptions& options, int s);

// Step 3, no workers yet: the memory preflight (client/memory_budget.h)
// against MemAvailable, which also caps each local worker's memory; prints
// the estimate (or why it was skipped). Errors: EstimateRunMemory's;
// kResourceExhausted from CheckRunMemory when the run does not fit.
absl::Status PreflightRunMemory(const RunJobOptions& options, RunJobState& job, std::ostream& out);

// Step 4: starts or attaches the workers and forms the group (with
// --attach, attaches to the workers' formed group instead), then
// configures it and allocates the workspace (ConfigureLayers: tp = attn_dp
// = world, moe_dense_tp 1, a2a on; AllocateWorkspace of capacity N).
// Errors: AttachWorkers's, FormWorkerGroup's / AttachFormedGroup's, the
// coordinator's; kInternal when AttachWorkers returns a different count;
// kInvalidArgument for a kill on workers this run did not start.
absl::Status FormRunGroup(const RunJobOptions& options, RunJobState& job, std::ostream& out);

// Step 5: the result's fields known before any step (model, world, steps,
// tolerance, memory figures; one LayerRunSummary per run layer).
void StartRunResult(const RunJobOptions& options, RunJobState& job);

// The LoadExpertsRequest of `layer`: the experts' kind (identity, bf16
// SwiGLU, fp8 block or MXFP4), the model's activation, the seed and the
// shared expert.
v1::LoadExpertsRequest RunLoadRequest(const RunJobOptions& options, const RunJobState& job,
                                      int layer);

// Step 6: for a kill run, the mask table (installed per layer with
// redundant slots); LoadExperts of every run layer (not with --attach:
// the owner loaded them), counting each rank's expert bytes. Errors: the
// table's and the coordinator's.
absl::Status LoadRunExperts(const RunJobOptions& options, RunJobState& job, std::ostream& out);

// Step 7: every step: the kill and restart at their steps, SyncTokenCounts,
// CommitGeometry and one Forward per layer (residual stream between
// layers), recorded for the verification; the rebalance after
// --rebalance-after and its load table at the end. Errors: the
// coordinator's and the workers' (a killed step's after its retries);
// kInternal when the workers report other counts than were sent.
absl::Status RunSteps(const RunJobOptions& options, RunJobState& job, std::ostream& out);

// Step 8: each run layer against the single-process reference (a chunk of
// experts at a time, plus the shared expert), merged into the layer's
// comparison; prints a line per failing (step, rank) and one per layer.
// Errors: the reference's (expert generation, shapes). A mismatch is not an
// error (RunJobResult::AllPass).
absl::Status VerifyRunLayers(const RunJobOptions& options, RunJobState& job, std::ostream& out);

}  // namespace moe_ep::client::run_job_internal
