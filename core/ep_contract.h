#pragma once

// The EP data-plane contract that both memory spaces implement
// (core::EpDispatcher on host memory over Gloo, kernels::GpuEpDispatcher on
// device memory over NCCL) and that the Worker service validates against:
// one option validation with one wording, one geometry state (commit, check,
// in-step guard, epoch), one step-statistics record. A backend adds only what
// its memory space limits (BackendLimits); every message is written here once
// and the tests pin it once for both backends (tests/core/ep_contract_test.cc).
//
// Source: DESIGN §5-§7 (options, geometry, step sequence); STYLE §7
// ("validate once, in the contract"); issue 10 item 1.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "core/placement_table.h"
#include "core/workspace.h"

namespace moe_ep::core {

// What a data plane is sized by (AllocateWorkspace, normalized).
struct EpDispatcherOptions {
  WorkspaceSpec workspace;  // ep_size, capacity_tokens, hidden, top_k, dtype
  int num_experts = 0;
  int32_t invalid_expert_id = -1;           // -1 or num_experts (DESIGN §7)
  std::vector<int64_t> cuda_graph_buckets;  // ascending; empty = none (DESIGN §6)
  // Physical expert slots a rank may hold beyond the contiguous placement's
  // ceil(num_experts / ep_size): the slot budget of placement tables
  // installed later (DESIGN §15), fixed here so that installing a table never
  // reallocates. 0 = only tables with at most ceil(E / R) slots a rank.
  int redundant_slots_per_rank = 0;
};

// SlotBudgetPerRank()
//
// The most physical expert slots one rank may hold under `options`:
// ceil(num_experts / ep_size) + redundant_slots_per_rank.
// REQUIRES: ValidateEpOptions(options, ...) is OK. Pure.
// Example: 256 experts, 8 ranks, 4 redundant -> 32 + 4 = 36.
int SlotBudgetPerRank(const EpDispatcherOptions& options);

// ValidatePlacement()
//
// The checks of installing `table` on a workspace sized by `options`
// (DESIGN §15): table.num_experts() == options.num_experts, table.ep_size()
// == workspace.ep_size, and every rank's slots <= SlotBudgetPerRank.
// Errors: kInvalidArgument naming the field or rank, expected and got. Pure.
absl::Status ValidatePlacement(const PlacementTable& table, const EpDispatcherOptions& options);

// Byte and token counters of one step, the same record on both backends.
struct StepStats {
  int64_t runtime_max_tokens_per_rank = 0;  // R
  int64_t tokens_sent = 0;                  // token copies sent, one per distinct destination rank
  int64_t tokens_received = 0;              // valid rows received from all sources
  int64_t bytes_sent_remote = 0;            // dispatch + combine payload bytes to other ranks
  int64_t dispatch_us = 0;
  int64_t expert_us = 0;
  int64_t combine_us = 0;
  // The shared expert of the layer (0 without one; issue 18): its compute
  // time, and on the GPU the part of it that ran while the dispatch did
  // (CUDA events on both streams).
  int64_t shared_us = 0;
  int64_t shared_overlap_us = 0;
  // Under a rank mask (DESIGN §15): this rank's (token, choice) pairs whose
  // expert has no live replica (they contribute zero), and those experts'
  // ids, ascending.
  int64_t lost_choices = 0;
  std::vector<int> lost_experts;
};

// The bit of `dtype` in BackendLimits::dispatch_dtypes.
constexpr uint32_t DispatchDTypeBit(DispatchDType dtype) {
  return uint32_t{1} << static_cast<int>(dtype);
}

// What one memory space cannot do; everything else is the contract's.
struct BackendLimits {
  const char* name = "data plane";  // for messages: "CPU data plane", "GPU data plane"
  int max_ep_size = 1 << 16;
  int max_top_k = 1 << 16;
  int64_t hidden_multiple = 1;  // H must be a positive multiple of this
  // The dispatch dtypes its data plane moves (DispatchDTypeBit of each);
  // every other dtype is refused at AllocateWorkspace (issue 15 item 4).
  uint32_t dispatch_dtypes = DispatchDTypeBit(DispatchDType::kBF16);
};

// ValidateDispatchDType()
//
// OK when `limits` moves `dtype`. Errors: kInvalidArgument naming the field,
// the backend, what it moves and the value, e.g. "workspace.dtype
// (dispatch_dtype): the GPU data plane moves bf16 or fp8_e4m3, got nvfp4".
// A dtype DESIGN §5 sizes but no data plane moves (nvfp4, mxfp8) is refused
// here, never silently sized. Pure.
absl::Status ValidateDispatchDType(DispatchDType dtype, const BackendLimits& limits);

// The request-level MoE sizes (AllocateWorkspace, Benchmark, and every
// backend): hidden_size in [1, max_hidden], num_experts in [1, max_experts],
// top_k in [1, num_experts]. Errors: kInvalidArgument naming the field with
// the expected range and the value. Pure.
// Example: (64, 8, 9) -> "top_k: expected in [1, num_experts = 8], got 9".
absl::Status ValidateMoeSizes(int64_t hidden_size, int64_t num_experts, int64_t top_k,
                              int64_t max_hidden = int64_t{1} << 20,
                              int64_t max_experts = int64_t{1} << 16);

// Every check on EpDispatcherOptions, for a group of `group_size` ranks and a
// backend with `limits`: ep_size == group_size (and <= max_ep_size),
// capacity_tokens >= 1, ValidateMoeSizes, top_k <= max_top_k,
// ValidateDispatchDType, hidden a multiple of hidden_multiple (and of the
// dtype's scale block: 128 for fp8_e4m3),
// num_experts >= ep_size (every rank owns an expert), invalid_expert_id -1 or
// num_experts, cuda_graph_buckets strictly ascending in [1, capacity_tokens].
// Errors: kInvalidArgument, the message names the field ("workspace.top_k:
// ...") with expected and got. Pure and thread-safe.
absl::Status ValidateEpOptions(const EpDispatcherOptions& options, int group_size,
                               const BackendLimits& limits);

// The geometry and step sequence of one rank's data plane (DESIGN §6, §7):
// the committed (epoch, R) and the phase idle -> dispatched -> (computed) ->
// idle. Both dispatchers hold one and ask it before acting; it changes only
// when a check passes. Not thread-safe (like its owner).
class GeometryState {
 public:
  // `rank` is for messages; `capacity_tokens` is N.
  GeometryState(int rank, int64_t capacity_tokens) : rank_(rank), capacity_(capacity_tokens) {}

  // Commits (epoch, R) for the next steps. Errors: kFailedPrecondition (a
  // dispatched step is in flight), kResourceExhausted (R > N),
  // kInvalidArgument (R < 0, R < local_tokens); messages give both
  // numbers and the rank. On error the previous geometry stays.
  absl::Status Commit(int64_t epoch, int64_t runtime_max_tokens_per_rank, int64_t local_tokens);

  // The checks before a step of `num_tokens` rows: a geometry is committed
  // (kFailedPrecondition naming CommitGeometry) and 0 <= T <= R
  // (kInvalidArgument with both numbers and the rank). `call` names the
  // caller in messages ("Dispatch", "Forward").
  absl::Status CheckStep(const char* call, int64_t num_tokens) const;

  // Phase guards. BeginDispatch: kFailedPrecondition when a step is already
  // dispatched ("Dispatch: a dispatch is in flight on rank 0: call combine
  // first ..."). RequireDispatched: when none is ("Combine needs a dispatch
  // first: no dispatched step on rank 0"; issue 30).
  // RequireComputed: when the dispatched step's experts have not run.
  absl::Status BeginDispatch(const char* call) const;
  absl::Status RequireDispatched(const char* call) const;
  absl::Status RequireComputed(const char* call) const;
  void MarkDispatched() { phase_ = Phase::kDispatched; }
  void MarkComputed() { phase_ = Phase::kComputed; }
  void MarkIdle() { phase_ = Phase::kIdle; }
  bool in_step() const { return phase_ != Phase::kIdle; }

  bool committed() const { return committed_; }
  // -1 / 0 before the first commit.
  int64_t epoch() const { return epoch_; }
  int64_t runtime_max_tokens_per_rank() const { return runtime_max_; }
  int64_t capacity_tokens() const { return capacity_; }

 private:
  enum class Phase { kIdle, kDispatched, kComputed };
  int rank_;
  int64_t capacity_;
  bool committed_ = false;
  int64_t epoch_ = -1;
  int64_t runtime_max_ = 0;
  Phase phase_ = Phase::kIdle;
};

// The check of SyncTokenCounts' input on every backend: local_tokens >= 0.
// Errors: kInvalidArgument naming the rank.
absl::Status ValidateLocalTokens(int64_t local_tokens, int rank);

// The per-call argument checks of the device data planes
// (kernels::GpuEpDispatcher, kernels::onesided::OneSidedDispatcher), written
// once (review duplicate D1). Each is pure; errors are kInvalidArgument
// naming the call, the rank and the numbers.

// max_intermediate (the largest SwiGLU I the expert scratch is sized for)
// >= 0: "max_intermediate: expected >= 0, got -1".
absl::Status ValidateMaxIntermediate(int64_t max_intermediate);

// A step of `num_tokens` rows needs non-null hidden, ids and weights
// (null is allowed for 0 rows): "Forward on rank 1: null device pointer
// with 3 tokens".
absl::Status ValidateStepPointers(const char* call, int rank, int64_t num_tokens,
                                  const void* hidden, const void* topk_ids,
                                  const void* topk_weights);

// ... and a non-null output when it writes rows: "Forward on rank 0: null
// output with 3 tokens".
absl::Status ValidateStepOutput(const char* call, int rank, int64_t num_tokens, const void* output);

// The experts a rank computes with: hidden size and the ids its local slots
// answer to, ascending (any set, not only a range: DESIGN §17,
// core/expert_slots.h).
struct ExpertSlice {
  int64_t hidden = 0;
  std::vector<int> slot_ids;
};

// `got` must equal `expected`: "experts on rank 0: expected hidden 64 and
// experts [0, 4), got hidden 64 and [0, 2)" (ids as core::DescribeExpertIds
// writes them: "[a, b)" for a range, "{a,c,...}" otherwise).
absl::Status ValidateExpertSlice(int rank, const ExpertSlice& expected, const ExpertSlice& got);

// CaptureForward's bucket in [1, capacity] and its pointers non-null:
// "CaptureForward on rank 0: bucket expected in [1, 16], got 17".
absl::Status ValidateCaptureArgs(int rank, int64_t bucket, int64_t capacity, const void* hidden,
                                 const void* topk_ids, const void* topk_weights,
                                 const void* output);

// ReplayForward's T in [0, bucket]: "ReplayForward on rank 0: num_tokens
// expected in [0, bucket=8], got 9".
absl::Status ValidateReplayTokens(int rank, int64_t bucket, int64_t num_tokens);

}  // namespace moe_ep::core
