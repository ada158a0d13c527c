#pragma once

// Single-process references of one MoE layer (DESIGN §7), for tests of the
// data planes (CPU and GPU) and for `moe-ep` result checks:
//  - DenseMoeReference: out = sum_k w_k * expert_k(x) straight from the
//    routing, with no notion of ranks;
//  - ReferenceEpForward: the whole expert-parallel step simulated in process
//    for E ranks: dispatch into [E, R, ...] receive buffers (padding slots
//    sanitized), expert compute on each destination, combine in fp32 with one
//    term per distinct destination rank, cast to bf16. It exposes what every
//    rank received so that real data planes can be compared exactly (ids,
//    weights, slots) and numerically (hidden, expert outputs).
// Both are slow, simple and deterministic. Thread-compatible.

#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/expert_placement.h"
#include "core/experts.h"
#include "core/placement_table.h"
#include "core/routing.h"
#include "core/workspace.h"

namespace moe_ep::core {

// DenseMoeReference()
//
// out[t, :] = sum over k with 0 <= topk_ids[t, k] < num_experts of
// topk_weights[t, k] * expert_{topk_ids[t,k]}(hidden[t, :]), accumulated in
// fp32 and returned in fp32 so that callers can compare bf16 results against
// it. A set whose router_weight_use() is kScalesInput (Llama-4) contributes
// expert_k(topk_weights[t, k] * hidden[t, :]) instead (the product in fp32). hidden [T, H] bf16,
// topk_ids [T, K] int32, topk_weights [T, K] fp32, out [T, H] fp32 (overwritten). `experts`
// together hold the layer's experts (any split into ExpertSets, e.g. one per rank, or one holding
// all); ids outside [0, num_experts) contribute nothing.
//
// Errors: kInvalidArgument when `experts` is empty or holds a null, sets
// disagree on H, a set reaches outside [0, num_experts) or two sets overlap,
// a span size differs from its shape, K < 1 or T < 0, or a valid id in
// topk_ids is owned by no set (naming token, slot and id).
absl::Status DenseMoeReference(const std::vector<const ExpertSet*>& experts, int num_experts,
                               absl::Span<const bf16_t> hidden, absl::Span<const int32_t> topk_ids,
                               absl::Span<const float> topk_weights, int64_t num_tokens, int top_k,
                               absl::Span<float> out);

// One source rank's input to ReferenceEpForward.
struct EpRankInput {
  absl::Span<const bf16_t> hidden;       // [T, H]
  absl::Span<const int32_t> topk_ids;    // [T, K]
  absl::Span<const float> topk_weights;  // [T, K]
  int64_t num_tokens = 0;                // T, may be 0
};

struct EpReferenceOptions {
  // Id written into every padding slot: -1 or num_experts (DESIGN §7).
  int32_t invalid_expert_id = -1;
  // R; < 0 means max over ranks of num_tokens (DESIGN §6).
  int64_t runtime_max_tokens_per_rank = -1;
  // The dispatch payload's dtype: every received hidden row is
  // core::DispatchedHidden of the source's row (fp8_e4m3: quantized and
  // dequantized as every data plane does; issue 15 item 4).
  DispatchDType dispatch_dtype = DispatchDType::kBF16;
};

// What one destination rank holds after dispatch and expert compute. Rows are
// indexed [source, slot] with slot < R; source s's tokens occupy slots
// [0, counts[s]) in increasing source-token order; padding slots have hidden
// zero, all K ids = invalid_expert_id and weights 0.
struct EpRankReceive {
  std::vector<int64_t> counts;        // [E] tokens received from each source
  std::vector<bf16_t> hidden;         // [E, R, H]
  std::vector<int32_t> ids;           // [E, R, K]
  std::vector<float> weights;         // [E, R, K]
  std::vector<int64_t> source_token;  // [E, R]: token index on the source, -1 for padding
  // The combine payload: bf16(sum over local k of w_k * expert_k(x)), zero
  // for padding slots and rows with no local expert. [E, R, H].
  std::vector<bf16_t> expert_out;
};

struct EpReferenceResult {
  int64_t runtime_max_tokens_per_rank = 0;  // R used
  std::vector<DispatchRoute> routes;        // [E], by source rank
  std::vector<EpRankReceive> received;      // [E], by destination rank
  // [E] by source rank: [T_s, H] bf16 = bf16(sum over destination ranks d of
  // float(expert_out_d[s, slot])), summed in ascending rank order in fp32.
  // Tokens sent nowhere get zeros.
  std::vector<std::vector<bf16_t>> output;
};

// ReferenceEpForward()
//
// Simulates one EP MoE layer over placement.ep_size() ranks (E).
// `rank_experts[d]` holds exactly rank d's experts under `placement`
// (first_expert and num_experts match); `inputs[s]` is source rank s's input.
//
// Errors: kInvalidArgument when rank_experts or inputs do not have E entries,
// a set is null, does not match the placement or disagrees on H, an input
// span's size differs from its shape, K < 1, invalid_expert_id is neither -1
// nor num_experts, or R (when given) is below a rank's num_tokens (message
// names the rank and both numbers).
absl::StatusOr<EpReferenceResult> ReferenceEpForward(
    const ExpertPlacement& placement, const std::vector<const ExpertSet*>& rank_experts,
    const std::vector<EpRankInput>& inputs, int top_k, const EpReferenceOptions& options = {});

// ReferenceEpForward() under a placement table (DESIGN §15)
//
// As above for table.ep_size() ranks, with each valid choice routed to the
// rank of table.ChooseReplica(source, token, id) and carrying the ids of
// core::PayloadExpertId (core/routing.h), as both data planes do.
// `rank_experts[d]` holds exactly rank d's distinct slot experts
// (core::DistinctSlotExperts). With PlacementTable::Contiguous the result
// equals the overload above. Under a rank mask (PlacementTable::WithMask)
// masked ranks receive nothing, choices of lost experts contribute zero
// (the masked data plane's result), and a masked rank must have 0 tokens.
// Errors: as above, and kInvalidArgument naming a masked rank with tokens.
absl::StatusOr<EpReferenceResult> ReferenceEpForward(
    const PlacementTable& table, const std::vector<const ExpertSet*>& rank_experts,
    const std::vector<EpRankInput>& inputs, int top_k, const EpReferenceOptions& options = {});

}  // namespace moe_ep::core
