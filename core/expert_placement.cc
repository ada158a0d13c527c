#include "core/expert_placement.h"

#include "absl/status/status.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"

namespace moe_ep::core {

absl::StatusOr<ExpertPlacement> ExpertPlacement::Contiguous(int num_experts, int ep_size) {
  if (num_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_experts: expected >= 1, got %d", num_experts));
  }
  if (ep_size < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("ep_size: expected >= 1, got %d", ep_size));
  }
  if (num_experts < ep_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_experts: expected >= ep_size (%d) so that every rank owns an expert, got %d", ep_size,
        num_experts));
  }
  return ExpertPlacement(num_experts, ep_size);
}

// Ranks [0, rem) own base + 1 experts each and cover ids [0, rem * (base + 1));
// the remaining ranks own base experts each.
int ExpertPlacement::RankOf(int64_t expert_id) const {
  CHECK(IsValid(expert_id));
  const int base = num_experts_ / ep_size_;
  const int rem = num_experts_ % ep_size_;
  const int64_t boundary = static_cast<int64_t>(rem) * (base + 1);
  if (expert_id < boundary) return static_cast<int>(expert_id / (base + 1));
  return rem + static_cast<int>((expert_id - boundary) / base);
}

int ExpertPlacement::FirstExpert(int rank) const {
  CHECK(rank >= 0 && rank < ep_size_);
  const int base = num_experts_ / ep_size_;
  const int rem = num_experts_ % ep_size_;
  return rank * base + (rank < rem ? rank : rem);
}

int ExpertPlacement::NumLocalExperts(int rank) const {
  CHECK(rank >= 0 && rank < ep_size_);
  const int base = num_experts_ / ep_size_;
  const int rem = num_experts_ % ep_size_;
  return base + (rank < rem ? 1 : 0);
}

}  // namespace moe_ep::core
