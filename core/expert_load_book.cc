#include "core/expert_load_book.h"

#include <algorithm>

#include "absl/hash/hash.h"

namespace moe_ep::core {

uint64_t RoutingFingerprint(absl::string_view topk_ids) {
  return static_cast<uint64_t>(absl::Hash<absl::string_view>{}(topk_ids));
}

uint64_t RoutingFingerprint(absl::Span<const int32_t> topk_ids) {
  return RoutingFingerprint(absl::string_view(reinterpret_cast<const char*>(topk_ids.data()),
                                              topk_ids.size() * sizeof(int32_t)));
}

void ExpertLoadBook::Reset(int num_experts) {
  num_experts_ = std::max(num_experts, 0);
  layers_.clear();
}

void ExpertLoadBook::Add(int layer, const ExpertLoadCounts& step, LoadStepKey key) {
  Layer& l = layers_[layer];
  if (l.totals.empty()) {
    l.totals.assign(num_experts_, 0);
    l.window.tokens_per_expert.assign(num_experts_, 0);
  }
  const bool resent = key.epoch >= 0 && key.epoch == l.last_key.epoch &&
                      key.routing == l.last_key.routing && key.mask_round > l.last_key.mask_round;
  if (resent) {
    // The same step again: take back what its first run added.
    for (size_t e = 0; e < l.last_counts.size(); ++e) {
      l.totals[e] -= l.last_counts[e];
      if (l.last_in_window) l.window.tokens_per_expert[e] -= l.last_counts[e];
    }
    if (l.last_in_window) l.window.steps -= l.last_steps;
  }
  const size_t n = std::min<size_t>(num_experts_, step.tokens_per_expert.size());
  l.last_counts.assign(step.tokens_per_expert.begin(), step.tokens_per_expert.begin() + n);
  for (size_t e = 0; e < n; ++e) {
    l.window.tokens_per_expert[e] += step.tokens_per_expert[e];
    l.totals[e] += step.tokens_per_expert[e];
  }
  l.window.steps += step.steps;
  l.last_key = key;
  l.last_steps = step.steps;
  l.last_in_window = true;
}

ExpertLoadCounts ExpertLoadBook::Read(int layer, bool reset) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) {
    ExpertLoadCounts none;
    none.tokens_per_expert.assign(num_experts_, 0);
    return none;
  }
  ExpertLoadCounts out = it->second.window;
  if (reset) {
    std::fill(it->second.window.tokens_per_expert.begin(),
              it->second.window.tokens_per_expert.end(), 0);
    it->second.window.steps = 0;
    it->second.last_in_window = false;
  }
  return out;
}

std::vector<int64_t> ExpertLoadBook::Totals(int layer) const {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return std::vector<int64_t>(num_experts_, 0);
  return it->second.totals;
}

}  // namespace moe_ep::core
