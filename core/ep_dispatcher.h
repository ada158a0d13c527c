#pragma once

// The CPU expert-parallel data plane of one rank: geometry agreement,
// dispatch, expert compute and combine over a Collective (DESIGN §6, §7).
//
// Buffers (host memory, allocated once in Create, never on the step path):
//   dispatch send / recv  [E, N, dispatch_bytes]   (hidden bf16, K ids, K weights;
//                                                  fp8_e4m3: hidden as e4m3 codes and
//                                                  one fp32 scale per 128, core/fp8_e4m3.h)
//   dispatch dequant      [E, N, H] bf16           (fp8_e4m3 only: the dispatched rows)
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
#include <functional>
#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/collective.h"
#include "core/ep_contract.h"
#include "core/expert_placement.h"
#include "core/experts.h"
#include "core/placement_table.h"
#include "core/step_dispatcher.h"
#include "core/stop_check.h"
#include "core/workspace.h"

namespace moe_ep::core {

// Tokens routed to each logical expert (DESIGN §15 load statistics): for
// every step this rank dispatched since the last reset, the (token, choice)
// pairs of its own tokens whose id is expert e (core::CountExpertTokens).
// The group's load is the sum over ranks.
struct ExpertLoadCounts {
  std::vector<int64_t> tokens_per_expert;  // [num_experts]
  int64_t steps = 0;                       // dispatched steps counted
};

class EpDispatcher final : public StepDispatcher {
 public:
  // `collective` must outlive the dispatcher; its size() is ep_size.
  // Errors: kInvalidArgument (core::ValidateEpOptions with kCpuLimits),
  // kResourceExhausted (allocation beyond `memory_cap_bytes` when > 0, with
  // both numbers).
  static absl::StatusOr<std::unique_ptr<EpDispatcher>> Create(ControlCollective* collective,
                                                              const EpDispatcherOptions& options,
                                                              int64_t memory_cap_bytes);

  // What the CPU data plane cannot do: an even H (4-byte aligned payload
  // parts); it moves bf16 and fp8_e4m3 (core/fp8_e4m3.h) dispatch.
  static constexpr BackendLimits kCpuLimits = {
      "CPU data plane", 1 << 16, 1 << 16, 2,
      DispatchDTypeBit(DispatchDType::kBF16) | DispatchDTypeBit(DispatchDType::kFP8E4M3)};

  // SetPlacement()
  //
  // Installs `table` for the next steps (DESIGN §15): dispatch sends each
  // valid choice to table.ChooseReplica(rank, token, id)'s rank with the
  // payload ids of core::PayloadExpertId, and ComputeExperts then expects
  // this rank's distinct slot experts (core::DistinctSlotExperts). Nothing
  // is reallocated: the workspace is per rank, not per slot, and the table
  // must fit the slot budget fixed at Create (core::ValidatePlacement).
  // Local: the caller agrees on the table across ranks first (the Worker
  // service votes on its fingerprint). The default is
  // PlacementTable::Contiguous. Errors: kFailedPrecondition (a step is in
  // flight), kInvalidArgument (ValidatePlacement). On error nothing changes.
  // Cheap when `table` is the one installed (a pointer compare), so a data
  // plane with one table per layer calls it before every step. kInvalidArgument
  // also for a null table.
  absl::Status SetPlacement(std::shared_ptr<const PlacementTable> table);
  // The installed table (never null).
  const std::shared_ptr<const PlacementTable>& placement() const;

  // ReadExpertLoad()
  //
  // This rank's load counters (ExpertLoadCounts); with `reset`, zeroes them
  // after reading. Counted by Dispatch once the ranks agreed on the step.
  ExpertLoadCounts ReadExpertLoad(bool reset);

  // Bytes this dispatcher allocated (equals layout().total_bytes).
  int64_t allocated_bytes() const override;
  // The workspace layout it allocated (AllocateWorkspace's breakdown).
  const CpuWorkspaceLayout& layout() const;

  // All-gathers `local_tokens` of every rank (collective). Returns one count
  // per rank. Errors: collective errors; kInvalidArgument for local_tokens < 0.
  absl::StatusOr<std::vector<int64_t>> SyncTokenCounts(int64_t local_tokens);

  // Commits (epoch, R) for the next Dispatch: core::GeometryState::Commit
  // (kFailedPrecondition mid-step, kResourceExhausted R > N,
  // kInvalidArgument R < local_tokens or R < 0). On error the previous
  // geometry stays.
  absl::Status CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                              int64_t local_tokens) override;
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
  // `before_combine` (null = none) runs on every rank after the experts and
  // before the combine (the server's call gate, itself a collective): its
  // error ends the step there on this rank, with nothing combined (the next
  // Dispatch starts afresh), and is returned.
  // `stop` (core/stop_check.h; null = never) is polled before each chunk of
  // received rows and each expert with rows (ExpertSet::ComputeWeightedSum):
  // once it answers true the expert compute ends there and, in place of
  // the combine, `before_combine` still runs (the peers wait in it) and its
  // error is returned; with no error from it (or no `before_combine`) the
  // LocalStop is returned and nothing is combined. In a group, pass a `stop`
  // only with a `before_combine` that stops every rank whenever `stop` has
  // fired on one (server::CallGate on the same server::CallBound does:
  // server/call_gate.h), or the peers would wait in the combine.
  // Errors: kInvalidArgument (span sizes, T > R, an expert id outside
  // [0, num_experts) other than the invalid id: core::ValidateExpertIds),
  // kFailedPrecondition (no geometry committed), kAborted (ranks disagree),
  // collective errors.
  absl::Status Forward(absl::Span<const bf16_t> hidden, absl::Span<const int32_t> topk_ids,
                       absl::Span<const float> topk_weights, int64_t num_tokens,
                       const ExpertSet& experts, absl::Span<bf16_t> output,
                       absl::Span<const bf16_t> shared_out = {},
                       const std::function<absl::Status()>& before_combine = nullptr,
                       const StopCheck& stop = nullptr);

  // The three phases of Forward, for benchmarks, tests and engines that run
  // their own experts. A non-OK `local_error` (the caller's own check of
  // arguments beyond these, e.g. its output buffers) still joins the
  // agreement round, so peers return kAborted at once, and is returned.
  absl::Status Dispatch(absl::Span<const bf16_t> hidden, absl::Span<const int32_t> topk_ids,
                        absl::Span<const float> topk_weights, int64_t num_tokens,
                        absl::Status local_error = absl::OkStatus());
  absl::Status ComputeExperts(const ExpertSet& experts);
  // True between a Dispatch that succeeded and the Combine (or the failed
  // Forward, or ReleaseStep) that ends its step: a Dispatch now is
  // kFailedPrecondition.
  bool step_in_flight() const;
  // Ends the dispatched step without a combine: for an exchange whose
  // result is the received rows themselves (server/moe_ep.h
  // moe_ep_dispatch_only). Not a collective, but every rank must end the
  // same step this way (its peers would otherwise wait in their Combine).
  // The received rows stay readable until the next Dispatch. Errors:
  // kFailedPrecondition (no dispatched step).
  absl::Status ReleaseStep();
  // `shared_out` as in Forward.
  absl::Status Combine(absl::Span<bf16_t> output, absl::Span<const bf16_t> shared_out = {});

  // Instead of ComputeExperts, for engines that run their own experts
  // (DESIGN §14): `expert_out` [E, rows, H] bf16 (rows >= R) holds, for
  // slot j < received_counts()[s] of source s, the token's weighted sum over
  // its choices among this rank's experts; padding slots are not read. Packs
  // it as the combine payload; Combine follows. Not a collective.
  // Errors: kFailedPrecondition (no dispatched step), kInvalidArgument
  // (rows < R, or the size is not E * rows * H). On error nothing changes.
  absl::Status SetExpertOutputs(absl::Span<const bf16_t> expert_out, int64_t rows);

  // After Dispatch: received rows of source `src` ([count, H] bf16 hidden,
  // [count, K] ids, [count, K] weights), for tests. count = received_counts()[src].
  // With fp8_e4m3 dispatch the hidden rows are the dequantized ones the
  // experts read (core::fp8::DequantizeRow of what arrived).
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
  ~EpDispatcher() override;
};

}  // namespace moe_ep::core
