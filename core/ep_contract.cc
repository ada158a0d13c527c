#include "core/ep_contract.h"

#include <cstddef>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/expert_source.h"
#include "core/fp8_e4m3.h"
#include "core/geometry.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

absl::Status InRange(const char* field, int64_t value, int64_t max) {
  if (value < 1 || value > max) {
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": expected in [1, ", max, "], got ", value));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateMoeSizes(int64_t hidden_size, int64_t num_experts, int64_t top_k,
                              int64_t max_hidden, int64_t max_experts) {
  RETURN_IF_ERROR(InRange("hidden_size", hidden_size, max_hidden));
  RETURN_IF_ERROR(InRange("num_experts", num_experts, max_experts));
  RETURN_IF_ERROR(InRange("top_k", top_k, max_experts));
  if (top_k > num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("top_k: expected <= num_experts (", num_experts, "), got ", top_k));
  }
  return absl::OkStatus();
}

absl::Status ValidateDispatchDType(DispatchDType dtype, const BackendLimits& limits) {
  if ((limits.dispatch_dtypes & DispatchDTypeBit(dtype)) != 0) return absl::OkStatus();
  std::vector<std::string> moved;
  for (DispatchDType d : {DispatchDType::kBF16, DispatchDType::kNVFP4, DispatchDType::kMXFP8,
                          DispatchDType::kFP8E4M3}) {
    if ((limits.dispatch_dtypes & DispatchDTypeBit(d)) != 0) moved.push_back(DispatchDTypeName(d));
  }
  return absl::InvalidArgumentError(
      absl::StrCat("workspace.dtype (dispatch_dtype): the ", limits.name, " moves ",
                   absl::StrJoin(moved, " or "), ", got ", DispatchDTypeName(dtype)));
}

absl::Status ValidateEpOptions(const EpDispatcherOptions& options, int group_size,
                               const BackendLimits& limits) {
  const WorkspaceSpec& ws = options.workspace;
  if (ws.ep_size != group_size) {
    return absl::InvalidArgumentError(absl::StrCat("workspace.ep_size: expected the group size ",
                                                   group_size, ", got ", ws.ep_size));
  }
  if (ws.ep_size < 1 || ws.ep_size > limits.max_ep_size) {
    return absl::InvalidArgumentError(absl::StrCat("workspace.ep_size: expected in [1, ",
                                                   limits.max_ep_size, "] on the ", limits.name,
                                                   ", got ", ws.ep_size));
  }
  if (ws.capacity_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("workspace.capacity_tokens: expected >= 1, got ", ws.capacity_tokens));
  }
  RETURN_IF_ERROR(ValidateMoeSizes(ws.hidden, options.num_experts, ws.top_k));
  if (ws.top_k > limits.max_top_k) {
    return absl::InvalidArgumentError(absl::StrCat("top_k: expected in [1, ", limits.max_top_k,
                                                   "] on the ", limits.name, ", got ", ws.top_k));
  }
  RETURN_IF_ERROR(ValidateDispatchDType(ws.dtype, limits));
  if (ws.hidden % limits.hidden_multiple != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "hidden_size: the ", limits.name, " needs a multiple of ", limits.hidden_multiple,
        " (keeps the int32/fp32 payload parts aligned), got ", ws.hidden));
  }
  if (ws.dtype == DispatchDType::kFP8E4M3 && ws.hidden % fp8::kBlockSize != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("hidden_size: fp8_e4m3 dispatch needs a multiple of ", fp8::kBlockSize,
                     " (one fp32 scale per ", fp8::kBlockSize, " values), got ", ws.hidden));
  }
  if (options.num_experts < ws.ep_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_experts: expected >= ", ws.ep_size,
                     " (the world size: every rank owns an expert), got ", options.num_experts));
  }
  if (options.invalid_expert_id != -1 && options.invalid_expert_id != options.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("invalid_expert_id: expected -1 or num_experts (", options.num_experts,
                     "), got ", options.invalid_expert_id));
  }
  if (options.redundant_slots_per_rank < 0 ||
      options.redundant_slots_per_rank > options.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat(
        "redundant_slots_per_rank: expected in [0, num_experts = ", options.num_experts, "], got ",
        options.redundant_slots_per_rank));
  }
  const std::vector<int64_t>& buckets = options.cuda_graph_buckets;
  for (size_t i = 0; i < buckets.size(); ++i) {
    if (buckets[i] < 1 || buckets[i] > ws.capacity_tokens ||
        (i > 0 && buckets[i] <= buckets[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_graph_buckets: expected strictly ascending values in [1, capacity_tokens = ",
          ws.capacity_tokens, "], got [", absl::StrJoin(buckets, ", "), "]"));
    }
  }
  return absl::OkStatus();
}

int SlotBudgetPerRank(const EpDispatcherOptions& options) {
  const int ep = options.workspace.ep_size;
  return (options.num_experts + ep - 1) / ep + options.redundant_slots_per_rank;
}

absl::Status ValidatePlacement(const PlacementTable& table, const EpDispatcherOptions& options) {
  if (table.num_experts() != options.num_experts) {
    return absl::InvalidArgumentError(absl::StrCat("placement: num_experts expected ",
                                                   options.num_experts, " (the workspace's), got ",
                                                   table.num_experts()));
  }
  if (table.ep_size() != options.workspace.ep_size) {
    return absl::InvalidArgumentError(absl::StrCat("placement: ep_size expected ",
                                                   options.workspace.ep_size,
                                                   " (the workspace's), got ", table.ep_size()));
  }
  const int budget = SlotBudgetPerRank(options);
  for (int r = 0; r < table.ep_size(); ++r) {
    if (table.NumSlots(r) > budget) {
      return absl::InvalidArgumentError(absl::StrCat(
          "placement: rank ", r, " has ", table.NumSlots(r), " slots, the workspace's budget is ",
          budget, " (ceil(num_experts / ep_size) + redundant_slots_per_rank ",
          options.redundant_slots_per_rank, "); allocate with more redundant slots"));
    }
  }
  return absl::OkStatus();
}

absl::Status ValidateLocalTokens(int64_t local_tokens, int rank) {
  if (local_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("local_tokens: expected >= 0, got ", local_tokens, " (rank ", rank, ")"));
  }
  return absl::OkStatus();
}

absl::Status GeometryState::Commit(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                                   int64_t local_tokens) {
  if (in_step()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "CommitGeometry: a dispatched step is in flight on rank ", rank_, "; Combine it first"));
  }
  const absl::Status valid =
      CheckRuntimeMaxTokens(local_tokens, runtime_max_tokens_per_rank, capacity_);
  if (!valid.ok()) {
    return absl::Status(valid.code(), absl::StrCat(valid.message(), " (rank ", rank_, ")"));
  }
  committed_ = true;
  epoch_ = epoch;
  runtime_max_ = runtime_max_tokens_per_rank;
  return absl::OkStatus();
}

absl::Status GeometryState::CheckStep(const char* call, int64_t num_tokens) const {
  if (!committed_) {
    return absl::FailedPreconditionError(absl::StrCat(call, ": no geometry committed on rank ",
                                                      rank_, "; call CommitGeometry first"));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("num_tokens: expected >= 0, got ", num_tokens, " (rank ", rank_, ")"));
  }
  if (num_tokens > runtime_max_) {
    return absl::InvalidArgumentError(absl::StrCat("num_tokens ", num_tokens,
                                                   " exceeds runtime_max_tokens_per_rank ",
                                                   runtime_max_, " (rank ", rank_, ")"));
  }
  return absl::OkStatus();
}

absl::Status GeometryState::BeginDispatch(const char* call) const {
  if (in_step()) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": a dispatch is in flight on rank ", rank_,
                     ": call combine first (its step was dispatched but not combined)"));
  }
  return absl::OkStatus();
}

absl::Status GeometryState::RequireDispatched(const char* call) const {
  if (!in_step()) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, " needs a dispatch first: no dispatched step on rank ", rank_));
  }
  return absl::OkStatus();
}

absl::Status GeometryState::RequireComputed(const char* call) const {
  RETURN_IF_ERROR(RequireDispatched(call));
  if (phase_ != Phase::kComputed) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": the expert outputs of this step are not computed on rank ", rank_,
                     "; call ComputeExperts first"));
  }
  return absl::OkStatus();
}

absl::Status ValidateMaxIntermediate(int64_t max_intermediate) {
  if (max_intermediate < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("max_intermediate: expected >= 0, got ", max_intermediate));
  }
  return absl::OkStatus();
}

absl::Status ValidateStepPointers(const char* call, int rank, int64_t num_tokens,
                                  const void* hidden, const void* topk_ids,
                                  const void* topk_weights) {
  if (num_tokens > 0 && (hidden == nullptr || topk_ids == nullptr || topk_weights == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        call, " on rank ", rank, ": null device pointer with ", num_tokens, " tokens"));
  }
  return absl::OkStatus();
}

absl::Status ValidateStepOutput(const char* call, int rank, int64_t num_tokens,
                                const void* output) {
  if (num_tokens > 0 && output == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat(call, " on rank ", rank, ": null output with ", num_tokens, " tokens"));
  }
  return absl::OkStatus();
}

absl::Status ValidateExpertSlice(int rank, const ExpertSlice& expected, const ExpertSlice& got) {
  if (got.hidden != expected.hidden || got.slot_ids != expected.slot_ids) {
    return absl::InvalidArgumentError(
        absl::StrCat("experts on rank ", rank, ": expected hidden ", expected.hidden,
                     " and experts ", DescribeExpertIds(expected.slot_ids), ", got hidden ",
                     got.hidden, " and ", DescribeExpertIds(got.slot_ids)));
  }
  return absl::OkStatus();
}

absl::Status ValidateCaptureArgs(int rank, int64_t bucket, int64_t capacity, const void* hidden,
                                 const void* topk_ids, const void* topk_weights,
                                 const void* output) {
  if (bucket < 1 || bucket > capacity) {
    return absl::InvalidArgumentError(absl::StrCat(
        "CaptureForward on rank ", rank, ": bucket expected in [1, ", capacity, "], got ", bucket));
  }
  if (hidden == nullptr || topk_ids == nullptr || topk_weights == nullptr || output == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("CaptureForward on rank ", rank, ": null device pointer"));
  }
  return absl::OkStatus();
}

absl::Status ValidateReplayTokens(int rank, int64_t bucket, int64_t num_tokens) {
  if (num_tokens < 0 || num_tokens > bucket) {
    return absl::InvalidArgumentError(absl::StrCat("ReplayForward on rank ", rank,
                                                   ": num_tokens expected in [0, bucket=", bucket,
                                                   "], got ", num_tokens));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::core
