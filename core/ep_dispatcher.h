#pragma once

// The CPU expert-parallel data plane of one rank: geometry agreement,
// dispatch, expert compute and combine over a Collective (DESIGN §6, §7).
//
// Buffers (host memory, allocated once in Create, never on the step path):
//   dispatch send / recv  [E, N, dispatch_bytes]   (hidden bf16, K ids, K weights)
//   combine send / recv   [E, N, combine_bytes]    (hidden bf16)
// with N = capacity_tokens and each region 128-byte aligned (DESIGN §5).
// A step with runtime_max_tokens_per_rank R uses rows [0, R) of each
// [E, N, ...] slab; source s's tokens for this rank sit in slots
// 0..count[s]-1 of row s, padding slots carry the invalid id and zero weights.
//
// Sequence per step: Dispatch -> (ComputeExperts) -> Combine. A second
// Dispatch before Combine, or Combine without Dispatch, is kFailedPrecondition.
// Not thread-safe.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/collective.h"
#include "core/expert_placement.h"
#include "core/experts.h"
#include "core/workspace.h"

namespace moe_ep::core {

struct EpDispatcherOptions {
  WorkspaceSpec workspace;  // ep_size, capacity_tokens, hidden, top_k, dtype
  int num_experts = 0;
  int32_t invalid_expert_id = -1;           // -1 or num_experts (DESIGN §7)
  std::vector<int64_t> cuda_graph_buckets;  // ascending; empty = none (DESIGN §6)
};

// Byte and token counters of the last step.
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
};

class EpDispatcher {
 public:
  // `collective` must outlive the dispatcher; its size() is ep_size.
  // Errors: kInvalidArgument (options inconsistent with the collective or
  // each other, naming the field), kResourceExhausted (allocation beyond
  // `memory_cap_bytes` when > 0, with both numbers).
  static absl::StatusOr<std::unique_ptr<EpDispatcher>> Create(Collective* collective,
                                                              const EpDispatcherOptions& options,
                                                              int64_t memory_cap_bytes);

  // Bytes this dispatcher allocated (equals AllocatedWorkspace::total_bytes).
  int64_t allocated_bytes() const;

  // All-gathers `local_tokens` of every rank (collective). Returns one count
  // per rank. Errors: collective errors; kInvalidArgument for local_tokens < 0.
  absl::StatusOr<std::vector<int64_t>> SyncTokenCounts(int64_t local_tokens);

  // Commits (epoch, R) for the next Dispatch. Errors: kResourceExhausted when
  // R > capacity_tokens, kInvalidArgument when R < local_tokens or R < 0; the
  // message gives both numbers. On error the previous geometry stays.
  absl::Status CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                              int64_t local_tokens);
  int64_t epoch() const;
  int64_t runtime_max_tokens_per_rank() const;

  // One whole MoE layer on this rank: verifies that all ranks agree on the
  // committed (epoch, R) (kAborted naming the disagreeing rank otherwise),
  // dispatches hidden [T, H] bf16 with topk_ids [T, K] int32 and topk_weights
  // [T, K] fp32, runs `experts` on the received rows, combines, and writes
  // output [T, H] bf16. T may be 0 (the rank still takes part). Collective.
  // `shared_out` (empty = none) is this rank's shared-expert term [T, H]
  // bf16 (core/shared_expert.h), added to each token's fp32 sum after the
  // ranks' terms, before the bf16 cast (issue 18).
  // Errors: kInvalidArgument (span sizes, T > R), kFailedPrecondition (no
  // geometry committed), kAborted (ranks disagree), collective errors.
  absl::Status Forward(absl::Span<const bf16_t> hidden, absl::Span<const int32_t> topk_ids,
                       absl::Span<const float> topk_weights, int64_t num_tokens,
                       const ExpertSet& experts, absl::Span<bf16_t> output,
                       absl::Span<const bf16_t> shared_out = {});

  // The three phases of Forward, for benchmarks and tests.
  absl::Status Dispatch(absl::Span<const bf16_t> hidden, absl::Span<const int32_t> topk_ids,
                        absl::Span<const float> topk_weights, int64_t num_tokens);
  absl::Status ComputeExperts(const ExpertSet& experts);
  // `shared_out` as in Forward.
  absl::Status Combine(absl::Span<bf16_t> output, absl::Span<const bf16_t> shared_out = {});

  // After Dispatch: received rows of source `src` ([count, H] bf16 hidden,
  // [count, K] ids, [count, K] weights), for tests. count = received_counts()[src].
  const std::vector<int64_t>& received_counts() const;
  absl::Span<const bf16_t> ReceivedHidden(int src) const;  // [R, H], padding rows zero
  absl::Span<const int32_t> ReceivedIds(int src) const;    // [R, K], padding = invalid id
  absl::Span<const float> ReceivedWeights(int src) const;  // [R, K], padding = 0

  const StepStats& last_step() const;

 private:
  struct Impl;
  explicit EpDispatcher(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;

 public:
  ~EpDispatcher();
};

}  // namespace moe_ep::core
