#pragma once

// The communication groups of one rank under a parallel layout (DESIGN §2):
// the world group (TP = EP = all ranks) and this rank's attention-TP group,
// ranks [g * attn_tp_size, (g + 1) * attn_tp_size) for DP group g.

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/collective.h"
#include "core/layer_plan.h"

namespace moe_ep::core {

class ParallelGroups {
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
  static absl::StatusOr<std::unique_ptr<ParallelGroups>> Create(
      Collective* world, const ParallelLayout& layout, const std::string& tag_prefix = "attn_tp");

  const ParallelLayout& layout() const { return layout_; }
  // The TP / EP group: all ranks.
  Collective& world() const { return *world_; }
  // This rank's attention-TP group; its rank() is attn_tp_rank().
  Collective& attn_tp() const { return *attn_tp_; }

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
  std::vector<int> AttnTpRanks(int dp_rank) const;

 private:
  ParallelGroups(Collective* world, std::unique_ptr<Collective> attn_tp,
                 const ParallelLayout& layout);

  Collective* world_;
  std::unique_ptr<Collective> attn_tp_;
  ParallelLayout layout_;
  int rank_;
  int attn_tp_size_;
};

}  // namespace moe_ep::core
