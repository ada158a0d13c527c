#include "core/parallel_groups.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"

namespace moe_ep::core {

ParallelGroups::ParallelGroups(Collective* world, std::unique_ptr<Collective> attn_tp,
                               const ParallelLayout& layout)
    : world_(world),
      attn_tp_(std::move(attn_tp)),
      layout_(layout),
      rank_(world->rank()),
      attn_tp_size_(layout.attn_tp_size()) {}

std::vector<int> ParallelGroups::AttnTpRanks(int dp_rank) const {
  std::vector<int> ranks;
  ranks.reserve(attn_tp_size_);
  for (int j = 0; j < attn_tp_size_; ++j) ranks.push_back(dp_rank * attn_tp_size_ + j);
  return ranks;
}

absl::StatusOr<std::unique_ptr<ParallelGroups>> ParallelGroups::Create(
    Collective* world, const ParallelLayout& layout, const std::string& tag_prefix) {
  if (world == nullptr) return absl::InvalidArgumentError("world collective is null");
  RETURN_IF_ERROR(ValidateLayout(layout));
  if (world->size() != layout.tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("world size must equal tp_size ", layout.tp_size, " (tp_size = world, DESIGN ",
                     "§2), got world size ", world->size(), " on rank ", world->rank()));
  }
  if (tag_prefix.empty()) return absl::InvalidArgumentError("tag_prefix must not be empty");
  const int attn_tp_size = layout.attn_tp_size();
  const int dp_rank = world->rank() / attn_tp_size;
  std::vector<int> ranks;
  ranks.reserve(attn_tp_size);
  for (int j = 0; j < attn_tp_size; ++j) ranks.push_back(dp_rank * attn_tp_size + j);
  ASSIGN_OR_RETURN(std::unique_ptr<Collective> attn_tp,
                   world->Split(ranks, absl::StrCat(tag_prefix, ".", dp_rank)));
  return std::unique_ptr<ParallelGroups>(new ParallelGroups(world, std::move(attn_tp), layout));
}

}  // namespace moe_ep::core
