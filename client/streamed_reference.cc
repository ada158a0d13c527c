#include "client/streamed_reference.h"

#include <cblas.h>

#include <algorithm>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace moe_ep::client {

absl::StatusOr<StreamedReferenceStats> StreamedMoeReference(
    const ExpertChunkFactory& make_chunk, int num_experts, int chunk_experts, int64_t hidden,
    absl::Span<const core::bf16_t> hidden_states, absl::Span<const int32_t> topk_ids,
    absl::Span<const float> topk_weights, int64_t num_tokens, int top_k, absl::Span<float> out) {
  if (num_experts < 1 || chunk_experts < 1 || hidden < 1 || top_k < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_experts, chunk_experts, hidden, top_k: expected >= 1, got %d, %d, %d, %d", num_experts,
        chunk_experts, hidden, top_k));
  }
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_tokens: expected >= 0, got %d", num_tokens));
  }
  const auto check = [](const char* name, size_t got, int64_t rows, int64_t cols) {
    if (static_cast<int64_t>(got) == rows * cols) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrFormat("%s: expected %d x %d = %d elements, got %d",
                                                      name, rows, cols, rows * cols, got));
  };
  RETURN_IF_ERROR(check("hidden_states", hidden_states.size(), num_tokens, hidden));
  RETURN_IF_ERROR(check("topk_ids", topk_ids.size(), num_tokens, top_k));
  RETURN_IF_ERROR(check("topk_weights", topk_weights.size(), num_tokens, top_k));
  RETURN_IF_ERROR(check("out", out.size(), num_tokens, hidden));

  // rows_of[e]: flat (token * K + k) entries routed to expert e, ascending.
  std::vector<std::vector<int64_t>> rows_of(num_experts);
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    const int32_t id = topk_ids[i];
    if (id >= 0 && id < num_experts) rows_of[id].push_back(i);
  }

  std::fill(out.begin(), out.end(), 0.0f);
  StreamedReferenceStats stats;
  stats.blas_threads = openblas_get_num_threads();
  std::vector<float> xs, ys;
  // One expert's fp32 weights and intermediate, reused by every Apply: a
  // fresh 3 * I * H * 4-byte buffer per expert costs more in page faults
  // than the expert's GEMMs.
  std::vector<float> scratch;
  for (int first = 0; first < num_experts; first += chunk_experts) {
    const int count = std::min(chunk_experts, num_experts - first);
    const bool selected = std::any_of(rows_of.begin() + first, rows_of.begin() + first + count,
                                      [](const std::vector<int64_t>& r) { return !r.empty(); });
    if (!selected) {
      ++stats.chunks_skipped;
      continue;
    }
    ASSIGN_OR_RETURN(core::ExpertSet chunk, make_chunk(first, count));
    if (chunk.first_expert() != first || chunk.num_experts() != count || chunk.hidden() != hidden) {
      return absl::InternalError(absl::StrFormat(
          "expert chunk: asked for experts [%d, %d) with H = %d, got [%d, %d) with H = %d", first,
          first + count, hidden, chunk.first_expert(), chunk.first_expert() + chunk.num_experts(),
          chunk.hidden()));
    }
    ++stats.chunks_made;
    stats.max_chunk_bytes = std::max(stats.max_chunk_bytes, chunk.weight_bytes());
    // The same per-expert order and arithmetic as core::DenseMoeReference.
    for (int e = first; e < first + count; ++e) {
      const std::vector<int64_t>& rows = rows_of[e];
      if (rows.empty()) continue;
      const int64_t m = static_cast<int64_t>(rows.size());
      // Llama-4: e(w * x) (issue 35 item 5), as core::DenseMoeReference.
      const bool scale_input = chunk.router_weight_use() == core::RouterWeightUse::kScalesInput &&
                               chunk.kind() != core::ExpertKind::kIdentity;
      xs.resize(m * hidden);
      ys.resize(m * hidden);
      for (int64_t j = 0; j < m; ++j) {
        const int64_t t = rows[j] / top_k;
        const float w = scale_input ? topk_weights[rows[j]] : 1.0f;
        for (int64_t c = 0; c < hidden; ++c) {
          const float v = core::Bf16ToFloat(hidden_states[t * hidden + c]);
          xs[j * hidden + c] = scale_input ? w * v : v;
        }
      }
      RETURN_IF_ERROR(chunk.Apply(e, xs, m, absl::MakeSpan(ys), scratch));
      for (int64_t j = 0; j < m; ++j) {
        const int64_t t = rows[j] / top_k;
        const float w = scale_input ? 1.0f : topk_weights[rows[j]];
        for (int64_t c = 0; c < hidden; ++c) out[t * hidden + c] += w * ys[j * hidden + c];
      }
    }
  }
  return stats;
}

}  // namespace moe_ep::client
