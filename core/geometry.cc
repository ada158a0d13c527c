#include "core/geometry.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moe_ep::core {

absl::StatusOr<int64_t> ChooseRuntimeMaxTokens(absl::Span<const int64_t> token_counts,
                                               absl::Span<const int64_t> cuda_graph_buckets,
                                               int64_t capacity_tokens) {
  if (token_counts.empty()) {
    return absl::InvalidArgumentError("token_counts is empty: need one count per EP rank");
  }
  if (capacity_tokens < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity_tokens must be >= 1, got ", capacity_tokens));
  }
  int64_t max_tokens = 0;
  for (size_t rank = 0; rank < token_counts.size(); ++rank) {
    if (token_counts[rank] < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("token count of rank ", rank, " must be >= 0, got ", token_counts[rank]));
    }
    max_tokens = std::max(max_tokens, token_counts[rank]);
  }
  for (size_t i = 0; i < cuda_graph_buckets.size(); ++i) {
    if (cuda_graph_buckets[i] < 1 ||
        (i > 0 && cuda_graph_buckets[i] <= cuda_graph_buckets[i - 1])) {
      return absl::InvalidArgumentError(absl::StrCat(
          "cuda_graph_buckets must be strictly ascending and >= 1; entry ", i, " is ",
          cuda_graph_buckets[i], " in [", absl::StrJoin(cuda_graph_buckets, ", "), "]"));
    }
  }
  int64_t r = max_tokens;
  if (!cuda_graph_buckets.empty()) {
    auto it = std::lower_bound(cuda_graph_buckets.begin(), cuda_graph_buckets.end(), max_tokens);
    if (it == cuda_graph_buckets.end()) {
      return absl::ResourceExhaustedError(absl::StrCat("max tokens per rank ", max_tokens,
                                                       " exceeds the largest CUDA-graph bucket ",
                                                       cuda_graph_buckets.back()));
    }
    r = *it;
  }
  if (r > capacity_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("runtime_max_tokens_per_rank ", r,
                                                     " exceeds capacity_tokens ", capacity_tokens,
                                                     " (max tokens per rank ", max_tokens, ")"));
  }
  return r;
}

absl::Status CheckRuntimeMaxTokens(int64_t local_tokens, int64_t runtime_max_tokens_per_rank,
                                   int64_t capacity_tokens) {
  const int64_t r = runtime_max_tokens_per_rank;
  if (local_tokens < 0 || r < 0 || capacity_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat(
        "local_tokens and runtime_max_tokens_per_rank must be >= 0 and capacity_tokens >= 1, got ",
        local_tokens, ", ", r, ", ", capacity_tokens));
  }
  if (r > capacity_tokens) {
    return absl::ResourceExhaustedError(absl::StrCat("runtime_max_tokens_per_rank ", r,
                                                     " exceeds capacity_tokens ", capacity_tokens));
  }
  if (r < local_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "runtime_max_tokens_per_rank ", r, " is below this rank's local_tokens ", local_tokens));
  }
  return absl::OkStatus();
}

int64_t ScatteredTokens(int64_t dp_group_tokens, int attn_tp_size, int attn_tp_rank) {
  if (dp_group_tokens < 0 || attn_tp_size < 1 || attn_tp_rank < 0 || attn_tp_rank >= attn_tp_size) {
    return 0;
  }
  const int64_t base = dp_group_tokens / attn_tp_size;
  const int64_t remainder = dp_group_tokens % attn_tp_size;
  return base + (attn_tp_rank < remainder ? 1 : 0);
}

int64_t MaxScatteredTokens(int64_t dp_group_tokens, int attn_tp_size) {
  if (dp_group_tokens < 0 || attn_tp_size < 1) return 0;
  return dp_group_tokens / attn_tp_size + (dp_group_tokens % attn_tp_size != 0 ? 1 : 0);
}

}  // namespace moe_ep::core
