#include "client/memory_budget.h"

#include <algorithm>
#include <fstream>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "client/text_table.h"
#include "core/expert_placement.h"
#include "core/quantized_weights.h"
#include "core/status_macros.h"
#include "core/workspace.h"

namespace moe_ep::client {
namespace {

constexpr int64_t kGiB = int64_t{1} << 30;
constexpr int64_t kMiB = int64_t{1} << 20;
constexpr int64_t kReferenceChunkBudgetBytes = kGiB;
constexpr int kMaxReferenceChunkExperts = 16;
constexpr int64_t kWorkerProcessBytes = 128 * kMiB;
constexpr int64_t kCoordinatorProcessBytes = 256 * kMiB;
// Rows of one ComputeWeightedSum call in the CPU data plane (core/ep_dispatcher.cc).
constexpr int64_t kComputeChunkRows = 512;

std::string Bytes(int64_t b) { return FormatBytes(static_cast<double>(b)); }

// Bytes usable by the run: available minus the margin (may be negative).
int64_t Usable(int64_t available_bytes) {
  return available_bytes - MemorySafetyMarginBytes(available_bytes);
}

}  // namespace

int ReferenceChunkExperts(int64_t expert_bytes, int num_experts) {
  int64_t chunk = kMaxReferenceChunkExperts;
  if (expert_bytes > 0) chunk = std::min(chunk, kReferenceChunkBudgetBytes / expert_bytes);
  chunk = std::min<int64_t>(chunk, num_experts);
  return static_cast<int>(std::max<int64_t>(chunk, 1));
}

absl::StatusOr<RunMemoryEstimate> EstimateRunMemory(const RunMemoryInput& in) {
  const std::pair<const char*, int64_t> positive[] = {{"num_experts", in.num_experts},
                                                      {"hidden", in.hidden},
                                                      {"intermediate", in.intermediate},
                                                      {"top_k", in.top_k},
                                                      {"world", in.world},
                                                      {"num_layers", in.num_layers},
                                                      {"capacity_tokens", in.capacity_tokens}};
  for (const auto& [name, value] : positive) {
    if (value < 1) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= 1, got ", value));
    }
  }
  const std::pair<const char*, int64_t> non_negative[] = {
      {"num_local_workers", in.num_local_workers},
      {"rows_per_layer", in.rows_per_layer},
      {"max_step_rows", in.max_step_rows}};
  for (const auto& [name, value] : non_negative) {
    if (value < 0) {
      return absl::InvalidArgumentError(absl::StrCat(name, ": expected >= 0, got ", value));
    }
  }
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(in.num_experts, in.world));
  const int64_t H = in.hidden;
  const int64_t I = in.intermediate;
  const int64_t K = in.top_k;

  RunMemoryEstimate e;
  const bool bf16 = in.weight_format == core::quant::ExpertWeightFormat::kBf16;
  e.expert_bytes = core::quant::ExpertWeightBytes(in.weight_format, H, I);
  e.layer_expert_bytes = int64_t{in.num_experts} * e.expert_bytes;
  // Rank 0 holds the most experts under contiguous placement; a placement
  // table may give a rank its redundant slots' experts too.
  const int64_t held = in.identity ? 0 : e.expert_bytes;
  const int64_t worker_experts = std::min<int64_t>(
      in.num_experts, placement.NumLocalExperts(0) + std::max(in.redundant_slots_per_rank, 0));
  e.worker_expert_bytes = worker_experts * held * in.num_layers;
  core::WorkspaceSpec spec;
  spec.ep_size = in.world;
  spec.capacity_tokens = in.capacity_tokens;
  spec.hidden = H;
  spec.top_k = in.top_k;
  spec.dtype = core::DispatchDType::kBF16;
  ASSIGN_OR_RETURN(core::AllocatedWorkspace workspace, core::ComputeAllocatedWorkspace(spec));
  e.worker_workspace_bytes = workspace.total_bytes;
  const int64_t widened = in.identity || !bf16 ? 0 : 3 * I * H * 4;
  const int64_t compute_rows = std::min(int64_t{in.world} * in.capacity_tokens, kComputeChunkRows);
  e.worker_other_bytes =
      widened + compute_rows * (8 * H + 8 * I) + 8 * in.capacity_tokens * H + kWorkerProcessBytes;
  e.worker_bytes = e.worker_expert_bytes + e.worker_workspace_bytes + e.worker_other_bytes;
  e.local_workers_bytes = int64_t{in.num_local_workers} * e.worker_bytes;

  e.reference_chunk_experts = ReferenceChunkExperts(held, in.num_experts);
  e.reference_chunk_bytes = int64_t{e.reference_chunk_experts} * held;
  const int64_t rows = in.rows_per_layer;
  const int64_t records = int64_t{in.num_layers} * rows * (4 * H + 8 * K);
  const int64_t verify = rows * (14 * H + 8 * K) + (in.identity ? 0 : rows * 8 * I + widened);
  const int64_t messages = 8 * in.max_step_rows * H;
  e.coordinator_bytes =
      e.reference_chunk_bytes + records + verify + messages + kCoordinatorProcessBytes;
  e.needed_bytes = e.local_workers_bytes + e.coordinator_bytes;
  return e;
}

int64_t MemorySafetyMarginBytes(int64_t available_bytes) {
  return std::max(kGiB, available_bytes / 10);
}

absl::Status CheckRunMemory(const RunMemoryInput& input, int64_t available_bytes) {
  ASSIGN_OR_RETURN(RunMemoryEstimate e, EstimateRunMemory(input));
  const int64_t usable = Usable(available_bytes);
  if (e.needed_bytes <= usable) return absl::OkStatus();

  std::string msg =
      absl::StrCat("memory preflight: this run needs about ", Bytes(e.needed_bytes),
                   " on this machine, but only ", Bytes(usable), " is available (MemAvailable ",
                   Bytes(available_bytes), " minus a ",
                   Bytes(MemorySafetyMarginBytes(available_bytes)), " safety margin): ");
  if (input.num_local_workers > 0) {
    absl::StrAppend(&msg, input.num_local_workers, " local worker(s) x ", Bytes(e.worker_bytes),
                    " (experts ", Bytes(e.worker_expert_bytes), " for ", input.num_layers,
                    " layer(s), workspace ", Bytes(e.worker_workspace_bytes), ", other ",
                    Bytes(e.worker_other_bytes), ") + ");
  }
  absl::StrAppend(&msg, "this process ", Bytes(e.coordinator_bytes), " (reference chunk of ",
                  e.reference_chunk_experts, " expert(s) ", Bytes(e.reference_chunk_bytes),
                  "); one layer's experts are ", Bytes(e.layer_expert_bytes), ". Options:");

  if (!input.identity) {
    RunMemoryInput identity = input;
    identity.identity = true;
    ASSIGN_OR_RETURN(RunMemoryEstimate ie, EstimateRunMemory(identity));
    absl::StrAppend(&msg,
                    "\n  --experts identity   a communication-only run (expert weights take "
                    "no memory): needs ",
                    Bytes(ie.needed_bytes),
                    ie.needed_bytes <= usable ? ", fits" : ", still too much");
  }
  int fitting_layers = 0;
  for (int l = input.num_layers - 1; l >= 1; --l) {
    RunMemoryInput fewer = input;
    fewer.num_layers = l;
    ASSIGN_OR_RETURN(RunMemoryEstimate fe, EstimateRunMemory(fewer));
    if (fe.needed_bytes <= usable) {
      fitting_layers = l;
      break;
    }
  }
  if (fitting_layers > 0) {
    absl::StrAppend(&msg, "\n  --layers ", fitting_layers,
                    "           the most MoE layers that fit");
  } else {
    absl::StrAppend(&msg, "\n  --layers             fewer layers do not help: ",
                    input.num_layers == 1 ? "one layer" : "even one layer", " does not fit");
  }
  absl::StrAppend(&msg,
                  "\n  --targets h:p,...    workers on other machines (moe-ep-worker there); this "
                  "process alone needs ",
                  Bytes(e.coordinator_bytes),
                  e.coordinator_bytes <= usable ? ", fits" : ", still too much");
  return absl::ResourceExhaustedError(msg);
}

int64_t LocalWorkerMemoryCapBytes(const RunMemoryEstimate& estimate, int num_local_workers,
                                  int64_t available_bytes) {
  if (num_local_workers < 1) return 0;
  const int64_t left = Usable(available_bytes) - estimate.coordinator_bytes;
  return std::max<int64_t>(left / num_local_workers, 1);
}

}  // namespace moe_ep::client
