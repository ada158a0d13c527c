#include "server/expert_load_book.h"

#include <algorithm>

namespace moe_ep::server {

void ExpertLoadBook::Reset(int num_experts) {
  num_experts_ = std::max(num_experts, 0);
  layers_.clear();
}

void ExpertLoadBook::Add(int layer, const core::ExpertLoadCounts& step) {
  Layer& l = layers_[layer];
  if (l.totals.empty()) {
    l.totals.assign(num_experts_, 0);
    l.window.tokens_per_expert.assign(num_experts_, 0);
  }
  const size_t n = std::min<size_t>(num_experts_, step.tokens_per_expert.size());
  for (size_t e = 0; e < n; ++e) {
    l.window.tokens_per_expert[e] += step.tokens_per_expert[e];
    l.totals[e] += step.tokens_per_expert[e];
  }
  l.window.steps += step.steps;
}

core::ExpertLoadCounts ExpertLoadBook::Read(int layer, bool reset) {
  auto it = layers_.find(layer);
  if (it == layers_.end()) {
    core::ExpertLoadCounts none;
    none.tokens_per_expert.assign(num_experts_, 0);
    return none;
  }
  core::ExpertLoadCounts out = it->second.window;
  if (reset) {
    std::fill(it->second.window.tokens_per_expert.begin(),
              it->second.window.tokens_per_expert.end(), 0);
    it->second.window.steps = 0;
  }
  return out;
}

std::vector<int64_t> ExpertLoadBook::Totals(int layer) const {
  auto it = layers_.find(layer);
  if (it == layers_.end()) return std::vector<int64_t>(num_experts_, 0);
  return it->second.totals;
}

}  // namespace moe_ep::server
