#pragma once

// The rank-invariant token bound R = runtime_max_tokens_per_rank (DESIGN §6).
// The all-to-all buffers are shaped [ep_size, R, ...]; every EP rank must use
// the same R for a step (sglang issues 30242, 27945).

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::core {

// ChooseRuntimeMaxTokens()
//
// Returns R from every EP rank's dispatch token count `token_counts` [ep_size]
// (identical on every rank: it comes from an all-gather): the maximum count,
// rounded up to the smallest of `cuda_graph_buckets` (strictly ascending,
// each >= 1) that is >= the maximum when buckets are given. With no buckets an
// all-zero step gives R = 0 (valid: every rank still joins the collectives);
// with buckets it gives the smallest bucket.
//
// Errors:
//   kInvalidArgument    token_counts empty or a count < 0 (naming the rank);
//                       capacity_tokens < 1; buckets not strictly ascending or
//                       < 1 (naming the index).
//   kResourceExhausted  the maximum exceeds the largest bucket (both numbers);
//                       R > capacity_tokens (both numbers).
//
// Pure and thread-safe. Source: DESIGN §6; FlashInfer dispatcher (seed 000).
// Example: counts [3, 7, 0, 5], buckets [1, 2, 4, 8, 16], N 4096 -> R 8.
absl::StatusOr<int64_t> ChooseRuntimeMaxTokens(absl::Span<const int64_t> token_counts,
                                               absl::Span<const int64_t> cuda_graph_buckets,
                                               int64_t capacity_tokens);

// CheckRuntimeMaxTokens()
//
// Checks local_tokens <= R <= N for this rank.
// Errors (messages give both numbers):
//   kResourceExhausted  R > capacity_tokens.
//   kInvalidArgument    R < local_tokens; any value negative; capacity < 1.
absl::Status CheckRuntimeMaxTokens(int64_t local_tokens, int64_t runtime_max_tokens_per_rank,
                                   int64_t capacity_tokens);

// ScatteredTokens()
//
// This attention-TP rank's share of its DP group's `dp_group_tokens` in
// SCATTERED mode, split like torch.tensor_split: the first
// (dp_group_tokens % attn_tp_size) ranks get the ceiling, the rest the floor.
// The largest share, ceil(dp_group_tokens / attn_tp_size), is what a rank
// feeds into dispatch for R (DESIGN §6).
// REQUIRES: dp_group_tokens >= 0, attn_tp_size >= 1, 0 <= attn_tp_rank <
// attn_tp_size; returns 0 otherwise.
// Example: 5 tokens, attn_tp 2 -> rank 0: 3, rank 1: 2.
int64_t ScatteredTokens(int64_t dp_group_tokens, int attn_tp_size, int attn_tp_rank);

// ceil(dp_group_tokens / attn_tp_size): the largest ScatteredTokens of the
// group. Same REQUIRES; 0 otherwise.
int64_t MaxScatteredTokens(int64_t dp_group_tokens, int attn_tp_size);

}  // namespace moe_ep::core
