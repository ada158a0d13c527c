#pragma once

// Contiguous placement of routed experts on EP ranks (DESIGN §7): with
// base = num_experts / ep_size and rem = num_experts % ep_size, ranks
// 0..rem-1 own base + 1 consecutive experts and the rest own base.
// Example: 10 experts on 4 ranks -> ranks own [0,3), [3,6), [6,8), [8,10).

#include <cstdint>

#include "absl/status/statusor.h"

namespace moe_ep::core {

class ExpertPlacement {
 public:
  // Errors: kInvalidArgument when num_experts < 1, ep_size < 1, or
  // num_experts < ep_size (a rank would own no expert); the message names the
  // field with expected and actual values.
  static absl::StatusOr<ExpertPlacement> Contiguous(int num_experts, int ep_size);

  int num_experts() const { return num_experts_; }
  int ep_size() const { return ep_size_; }

  // True when 0 <= expert_id < num_experts. Ids outside mean "no expert".
  bool IsValid(int64_t expert_id) const { return expert_id >= 0 && expert_id < num_experts_; }
  // Owner rank of a valid expert id. REQUIRES: IsValid(expert_id).
  int RankOf(int64_t expert_id) const;
  // First expert id owned by `rank`. REQUIRES: 0 <= rank < ep_size.
  int FirstExpert(int rank) const;
  // Number of experts owned by `rank`. REQUIRES: 0 <= rank < ep_size.
  int NumLocalExperts(int rank) const;

 private:
  ExpertPlacement(int num_experts, int ep_size) : num_experts_(num_experts), ep_size_(ep_size) {}
  int num_experts_;
  int ep_size_;
};

}  // namespace moe_ep::core
