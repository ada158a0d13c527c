#include "core/moe_reference.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/dispatch_rounding.h"
#include "core/expert_source.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

absl::Status CheckSpans(const char* who, int64_t num_tokens, int top_k, int64_t hidden,
                        size_t hidden_size, size_t ids_size, size_t weights_size) {
  if (num_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: num_tokens: expected >= 0, got %d", who, num_tokens));
  }
  if (static_cast<int64_t>(hidden_size) != num_tokens * hidden) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: hidden: expected T * H = %d * %d elements, got %d", who, num_tokens,
                        hidden, hidden_size));
  }
  if (static_cast<int64_t>(ids_size) != num_tokens * top_k) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: topk_ids: expected T * K = %d * %d elements, got %d", who, num_tokens,
                        top_k, ids_size));
  }
  if (static_cast<int64_t>(weights_size) != num_tokens * top_k) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: topk_weights: expected T * K = %d * %d elements, got %d", who,
                        num_tokens, top_k, weights_size));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status DenseMoeReference(const std::vector<const ExpertSet*>& experts, int num_experts,
                               absl::Span<const bf16_t> hidden, absl::Span<const int32_t> topk_ids,
                               absl::Span<const float> topk_weights, int64_t num_tokens, int top_k,
                               absl::Span<float> out) {
  if (experts.empty()) {
    return absl::InvalidArgumentError("experts: expected at least one ExpertSet, got none");
  }
  if (top_k < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("top_k: expected >= 1, got %d", top_k));
  }
  // owner[e] = index of the set holding expert e, -1 if none.
  std::vector<int> owner(std::max(num_experts, 0), -1);
  int64_t h = -1;
  for (size_t i = 0; i < experts.size(); ++i) {
    const ExpertSet* set = experts[i];
    if (set == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("experts[%d]: null", i));
    }
    if (h >= 0 && set->hidden() != h) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "experts[%d]: hidden: expected %d (as experts[0]), got %d", i, h, set->hidden()));
    }
    h = set->hidden();
    if (set->first_expert() < 0 || set->first_expert() + set->num_experts() > num_experts) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "experts[%d]: experts [%d, %d) reach outside [0, num_experts = %d)", i,
          set->first_expert(), set->first_expert() + set->num_experts(), num_experts));
    }
    for (int e = set->first_expert(); e < set->first_expert() + set->num_experts(); ++e) {
      if (owner[e] >= 0) {
        return absl::InvalidArgumentError(
            absl::StrFormat("experts[%d]: expert %d is also held by experts[%d]", i, e, owner[e]));
      }
      owner[e] = static_cast<int>(i);
    }
  }
  RETURN_IF_ERROR(CheckSpans("DenseMoeReference", num_tokens, top_k, h, hidden.size(),
                             topk_ids.size(), topk_weights.size()));
  if (static_cast<int64_t>(out.size()) != num_tokens * h) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "out: expected T * H = %d * %d elements, got %d", num_tokens, h, out.size()));
  }
  // rows_of[e]: flat (token * K + k) entries routed to expert e.
  std::vector<std::vector<int64_t>> rows_of(num_experts);
  for (int64_t i = 0; i < num_tokens * top_k; ++i) {
    const int32_t id = topk_ids[i];
    if (id < 0 || id >= num_experts) continue;
    if (owner[id] < 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "topk_ids[%d, %d] = %d: no ExpertSet holds this expert", i / top_k, i % top_k, id));
    }
    rows_of[id].push_back(i);
  }

  std::fill(out.begin(), out.end(), 0.0f);
  std::vector<float> xs, ys;
  for (int e = 0; e < num_experts; ++e) {
    const std::vector<int64_t>& rows = rows_of[e];
    if (rows.empty()) continue;
    const int64_t m = static_cast<int64_t>(rows.size());
    const ExpertSet& set = *experts[owner[e]];
    // Llama-4 (issue 35 item 5): the router weight scales the input, e(w x),
    // except for identity experts where both orders give w x.
    const bool scale_input = set.router_weight_use() == RouterWeightUse::kScalesInput &&
                             set.kind() != ExpertKind::kIdentity;
    xs.resize(m * h);
    ys.resize(m * h);
    for (int64_t j = 0; j < m; ++j) {
      const int64_t t = rows[j] / top_k;
      const float w = scale_input ? topk_weights[rows[j]] : 1.0f;
      for (int64_t c = 0; c < h; ++c) {
        const float v = Bf16ToFloat(hidden[t * h + c]);
        xs[j * h + c] = scale_input ? w * v : v;
      }
    }
    RETURN_IF_ERROR(set.Apply(e, xs, m, absl::MakeSpan(ys)));
    for (int64_t j = 0; j < m; ++j) {
      const int64_t t = rows[j] / top_k;
      const float w = scale_input ? 1.0f : topk_weights[rows[j]];
      for (int64_t c = 0; c < h; ++c) out[t * h + c] += w * ys[j * h + c];
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<EpReferenceResult> ReferenceEpForward(
    const ExpertPlacement& placement, const std::vector<const ExpertSet*>& rank_experts,
    const std::vector<EpRankInput>& inputs, int top_k, const EpReferenceOptions& options) {
  ASSIGN_OR_RETURN(PlacementTable table,
                   PlacementTable::Contiguous(placement.num_experts(), placement.ep_size()));
  return ReferenceEpForward(table, rank_experts, inputs, top_k, options);
}

absl::StatusOr<EpReferenceResult> ReferenceEpForward(
    const PlacementTable& table, const std::vector<const ExpertSet*>& rank_experts,
    const std::vector<EpRankInput>& inputs, int top_k, const EpReferenceOptions& options) {
  const int ep = table.ep_size();
  const int num_experts = table.num_experts();
  if (static_cast<int>(rank_experts.size()) != ep) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank_experts: expected ep_size = %d entries, got %d", ep, rank_experts.size()));
  }
  if (static_cast<int>(inputs.size()) != ep) {
    return absl::InvalidArgumentError(
        absl::StrFormat("inputs: expected ep_size = %d entries, got %d", ep, inputs.size()));
  }
  if (top_k < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("top_k: expected >= 1, got %d", top_k));
  }
  const int32_t invalid = options.invalid_expert_id;
  if (invalid != -1 && invalid != num_experts) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "invalid_expert_id: expected -1 or num_experts (%d), got %d", num_experts, invalid));
  }
  int64_t h = -1;
  for (int d = 0; d < ep; ++d) {
    const ExpertSet* set = rank_experts[d];
    if (set == nullptr) {
      return absl::InvalidArgumentError(absl::StrFormat("rank_experts[%d]: null", d));
    }
    const std::vector<int> want = DistinctSlotExperts(table, d);
    if (set->expert_ids() != want) {
      return absl::InvalidArgumentError(
          absl::StrFormat("rank_experts[%d]: expected experts %s of the placement, got %s", d,
                          DescribeExpertIds(want), DescribeExpertIds(set->expert_ids())));
    }
    if (h >= 0 && set->hidden() != h) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "rank_experts[%d]: hidden: expected %d (as rank 0), got %d", d, h, set->hidden()));
    }
    h = set->hidden();
  }
  int64_t max_tokens = 0;
  for (int s = 0; s < ep; ++s) {
    const EpRankInput& in = inputs[s];
    RETURN_IF_ERROR(CheckSpans(absl::StrFormat("inputs[%d]", s).c_str(), in.num_tokens, top_k, h,
                               in.hidden.size(), in.topk_ids.size(), in.topk_weights.size()));
    max_tokens = std::max(max_tokens, in.num_tokens);
  }
  for (int s = 0; s < ep; ++s) {
    if (!table.IsLive(s) && inputs[s].num_tokens != 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("inputs[%d]: rank %d is masked out; expected 0 tokens, got %d", s, s,
                          inputs[s].num_tokens));
    }
  }
  int64_t r_max = options.runtime_max_tokens_per_rank;
  if (r_max < 0) r_max = max_tokens;
  for (int s = 0; s < ep; ++s) {
    if (inputs[s].num_tokens > r_max) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "runtime_max_tokens_per_rank: expected >= rank %d's num_tokens %d, got %d", s,
          inputs[s].num_tokens, r_max));
    }
  }

  // The rows as dispatched (identity for bf16).
  std::vector<std::vector<bf16_t>> dispatched(ep);
  for (int s = 0; s < ep; ++s) {
    ASSIGN_OR_RETURN(dispatched[s], DispatchedHidden(options.dispatch_dtype, inputs[s].hidden,
                                                     inputs[s].num_tokens, h));
  }

  EpReferenceResult result;
  result.runtime_max_tokens_per_rank = r_max;
  for (int s = 0; s < ep; ++s) {
    ASSIGN_OR_RETURN(
        DispatchRoute route,
        ComputeDispatchRoute(inputs[s].topk_ids, inputs[s].num_tokens, top_k, table, s));
    result.routes.push_back(std::move(route));
  }

  // Dispatch: fill every destination's [E, R, ...] buffers.
  const int64_t rows = static_cast<int64_t>(ep) * r_max;
  result.received.resize(ep);
  for (int d = 0; d < ep; ++d) {
    EpRankReceive& rx = result.received[d];
    rx.counts.assign(ep, 0);
    rx.hidden.assign(rows * h, 0);
    rx.ids.assign(rows * top_k, invalid);
    rx.weights.assign(rows * top_k, 0.0f);
    rx.source_token.assign(rows, -1);
    for (int s = 0; s < ep; ++s) {
      const std::vector<int64_t>& tokens = result.routes[s].tokens_for_rank[d];
      rx.counts[s] = static_cast<int64_t>(tokens.size());
      for (size_t slot = 0; slot < tokens.size(); ++slot) {
        const int64_t t = tokens[slot];
        const int64_t row = s * r_max + static_cast<int64_t>(slot);
        rx.source_token[row] = t;
        std::copy_n(dispatched[s].begin() + t * h, h, rx.hidden.begin() + row * h);
        for (int k = 0; k < top_k; ++k) {
          rx.ids[row * top_k + k] =
              PayloadExpertId(table, s, t, inputs[s].topk_ids[t * top_k + k], d, invalid);
        }
        std::copy_n(inputs[s].topk_weights.begin() + t * top_k, top_k,
                    rx.weights.begin() + row * top_k);
      }
    }
  }

  // Expert compute on each destination; the combine payload is bf16.
  std::vector<float> x(rows * h), y(rows * h);
  for (int d = 0; d < ep; ++d) {
    EpRankReceive& rx = result.received[d];
    for (int64_t i = 0; i < rows * h; ++i) x[i] = Bf16ToFloat(rx.hidden[i]);
    RETURN_IF_ERROR(
        rank_experts[d]->ComputeWeightedSum(x, rx.ids, rx.weights, rows, top_k, absl::MakeSpan(y)));
    rx.expert_out.resize(rows * h);
    for (int64_t i = 0; i < rows * h; ++i) rx.expert_out[i] = FloatToBf16(y[i]);
  }

  // Combine: one term per distinct destination rank, fp32 sum, bf16 cast.
  result.output.resize(ep);
  std::vector<float> acc(h);
  for (int s = 0; s < ep; ++s) {
    const DispatchRoute& route = result.routes[s];
    std::vector<bf16_t>& out = result.output[s];
    out.assign(inputs[s].num_tokens * h, 0);
    for (int64_t t = 0; t < inputs[s].num_tokens; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t j = route.token_offsets[t]; j < route.token_offsets[t + 1]; ++j) {
        const int d = route.dest_rank[j];
        const int64_t row = s * r_max + route.dest_slot[j];
        const bf16_t* term = result.received[d].expert_out.data() + row * h;
        for (int64_t c = 0; c < h; ++c) acc[c] += Bf16ToFloat(term[c]);
      }
      for (int64_t c = 0; c < h; ++c) out[t * h + c] = FloatToBf16(acc[c]);
    }
  }
  return result;
}

}  // namespace moe_ep::core
