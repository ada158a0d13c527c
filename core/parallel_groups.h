#pragma once

// The communication groups of one rank under a parallel layout (DESIGN §2):
// the world group (TP = EP = all ranks) and this rank's attention-TP group,
// ranks [g * attn_tp_size, (g + 1) * attn_tp_size) for DP group g.

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "core/collective.h"
#include "core/layer_plan.h"
#include "core/status_macros.h"

namespace moe_ep::core {

// `Group` is core::ControlCollective (the CPU layer stack) or
// kernels::StreamCollective (the GPU layer communicator): anything with
// rank(), size() and Split(ranks, tag) -> StatusOr<unique_ptr<Group>>.
template <typename Group>
class BasicParallelGroups {
 public:
  // Create()
  //
  // Forms this rank's attention-TP sub-group from `world` with
  // world->Split(ranks of its DP group, tag_prefix + "." + dp_rank). A
  // collective over `world`: every rank calls Create with the same layout and
  // tag_prefix, in the same order relative to its other collective calls.
  // The sub-group is formed even when attn_tp_size is 1 or tp_size (then it
  // is a single rank or the whole world), so every step has a group to call.
  // `world` is not owned and must outlive the returned object.
  //
  // Errors:
  //   kInvalidArgument  world null; ValidateLayout errors; world->size() !=
  //                     layout.tp_size (both numbers); tag_prefix empty.
  //   Split errors (kDeadlineExceeded, kUnavailable, ...) from the backend.
  //
  // Not thread-safe (like Collective). Source: DESIGN §2; sglang dp_attention
  // (attention-TP groups).
  // Example: tp 4, attn_dp 2, rank 3 -> dp_rank 1, attn_tp_rank 1, attention-TP
  // group {2, 3}.
  static absl::StatusOr<std::unique_ptr<BasicParallelGroups>> Create(
      Group* world, const ParallelLayout& layout, const std::string& tag_prefix = "attn_tp") {
    if (world == nullptr) return absl::InvalidArgumentError("world collective is null");
    RETURN_IF_ERROR(ValidateLayout(layout));
    if (world->size() != layout.tp_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "world size must equal tp_size ", layout.tp_size, " (tp_size = world, DESIGN ",
          "§2), got world size ", world->size(), " on rank ", world->rank()));
    }
    if (tag_prefix.empty()) return absl::InvalidArgumentError("tag_prefix must not be empty");
    const int attn_tp_size = layout.attn_tp_size();
    const int dp_rank = world->rank() / attn_tp_size;
    std::vector<int> ranks;
    ranks.reserve(attn_tp_size);
    for (int j = 0; j < attn_tp_size; ++j) ranks.push_back(dp_rank * attn_tp_size + j);
    ASSIGN_OR_RETURN(std::unique_ptr<Group> attn_tp,
                     world->Split(ranks, absl::StrCat(tag_prefix, ".", dp_rank)));
    return std::unique_ptr<BasicParallelGroups>(
        new BasicParallelGroups(world, std::move(attn_tp), layout));
  }

  const ParallelLayout& layout() const { return layout_; }
  // The TP / EP group: all ranks.
  Group& world() const { return *world_; }
  // This rank's attention-TP group; its rank() is attn_tp_rank().
  Group& attn_tp() const { return *attn_tp_; }

  int rank() const { return rank_; }
  int tp_size() const { return layout_.tp_size; }
  int attn_tp_size() const { return attn_tp_size_; }
  int attn_dp_size() const { return layout_.attn_dp_size; }
  // DP group of this rank: rank / attn_tp_size.
  int dp_rank() const { return rank_ / attn_tp_size_; }
  // Index inside the attention-TP group: rank % attn_tp_size.
  int attn_tp_rank() const { return rank_ % attn_tp_size_; }
  // World ranks of DP group `dp_rank`, ascending. REQUIRES: 0 <= dp_rank <
  // attn_dp_size().
  std::vector<int> AttnTpRanks(int dp_rank) const {
    std::vector<int> ranks;
    ranks.reserve(attn_tp_size_);
    for (int j = 0; j < attn_tp_size_; ++j) ranks.push_back(dp_rank * attn_tp_size_ + j);
    return ranks;
  }

 private:
  BasicParallelGroups(Group* world, std::unique_ptr<Group> attn_tp, const ParallelLayout& layout)
      : world_(world),
        attn_tp_(std::move(attn_tp)),
        layout_(layout),
        rank_(world->rank()),
        attn_tp_size_(layout.attn_tp_size()) {}

  Group* world_;
  std::unique_ptr<Group> attn_tp_;
  ParallelLayout layout_;
  int rank_;
  int attn_tp_size_;
};

// The CPU groups (Gloo, or the control view of any group).
using ParallelGroups = BasicParallelGroups<ControlCollective>;

}  // namespace moe_ep::core
