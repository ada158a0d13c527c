#include "core/placement_table.h"

#include <algorithm>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "core/expert_placement.h"
#include "core/fingerprint.h"
#include "core/status_macros.h"

namespace moe_ep::core {

absl::StatusOr<PlacementTable> PlacementTable::Contiguous(int num_experts, int ep_size) {
  ASSIGN_OR_RETURN(ExpertPlacement placement, ExpertPlacement::Contiguous(num_experts, ep_size));
  std::vector<std::vector<int>> slot_experts(ep_size);
  for (int r = 0; r < ep_size; ++r) {
    for (int i = 0; i < placement.NumLocalExperts(r); ++i) {
      slot_experts[r].push_back(placement.FirstExpert(r) + i);
    }
  }
  return FromSlotExperts(num_experts, std::move(slot_experts));
}

absl::StatusOr<PlacementTable> PlacementTable::FromSlotExperts(
    int num_experts, std::vector<std::vector<int>> slot_experts) {
  if (num_experts < 1) {
    return absl::InvalidArgumentError(
        absl::StrFormat("num_experts: expected >= 1, got %d", num_experts));
  }
  const int ep_size = static_cast<int>(slot_experts.size());
  if (ep_size < 1) {
    return absl::InvalidArgumentError("slot_experts: expected one list per rank, got no rank");
  }
  int64_t total = 0;
  for (int r = 0; r < ep_size; ++r) {
    if (slot_experts[r].empty()) {
      return absl::InvalidArgumentError(
          absl::StrFormat("slot_experts: rank %d has no slot; every rank needs >= 1", r));
    }
    total += static_cast<int64_t>(slot_experts[r].size());
  }
  // DESIGN §7's split of `total` slots: equal when ep_size divides it, else
  // the first total % ep_size ranks hold one more.
  const int64_t base = total / ep_size;
  const int64_t rem = total % ep_size;
  for (int r = 0; r < ep_size; ++r) {
    const int64_t expected = base + (r < rem ? 1 : 0);
    if (static_cast<int64_t>(slot_experts[r].size()) != expected) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "slot_experts: rank %d has %d slots, expected %d: %d slots on %d ranks must be split "
          "equally, or when %d does not divide them the first %d ranks hold one more (DESIGN §7)",
          r, slot_experts[r].size(), expected, total, ep_size, ep_size, rem));
    }
  }
  std::vector<int> replica_count(num_experts, 0);
  for (int r = 0; r < ep_size; ++r) {
    for (int s = 0; s < static_cast<int>(slot_experts[r].size()); ++s) {
      const int e = slot_experts[r][s];
      if (e < 0 || e >= num_experts) {
        return absl::InvalidArgumentError(
            absl::StrFormat("slot_experts: rank %d slot %d holds expert %d, expected an id in "
                            "[0, %d)",
                            r, s, e, num_experts));
      }
      ++replica_count[e];
    }
  }
  for (int e = 0; e < num_experts; ++e) {
    if (replica_count[e] == 0) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "slot_experts: logical expert %d is held by no slot; every expert needs >= 1 replica",
          e));
    }
  }

  PlacementTable table;
  table.num_experts_ = num_experts;
  table.replica_offsets_.assign(num_experts + 1, 0);
  for (int e = 0; e < num_experts; ++e) {
    table.replica_offsets_[e + 1] = table.replica_offsets_[e] + replica_count[e];
  }
  table.replicas_.resize(total);
  std::vector<int> next(table.replica_offsets_.begin(), table.replica_offsets_.end() - 1);
  // Rank-major, slot-minor traversal fills each expert's list sorted by
  // (rank, slot).
  for (int r = 0; r < ep_size; ++r) {
    for (int s = 0; s < static_cast<int>(slot_experts[r].size()); ++s) {
      table.replicas_[next[slot_experts[r][s]]++] = ReplicaSlot{r, s};
    }
  }
  table.slot_experts_ = std::move(slot_experts);
  return table;
}

absl::StatusOr<PlacementTable> PlacementTable::FromReplicas(
    int num_experts, int ep_size, int slots_per_rank,
    const std::vector<std::vector<ReplicaSlot>>& replicas) {
  if (num_experts < 1 || ep_size < 1 || slots_per_rank < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "num_experts, ep_size and slots_per_rank: expected each >= 1, got %d, %d and %d",
        num_experts, ep_size, slots_per_rank));
  }
  if (static_cast<int64_t>(replicas.size()) != num_experts) {
    return absl::InvalidArgumentError(
        absl::StrFormat("replicas: expected one list per logical expert (%d), got %d lists",
                        num_experts, replicas.size()));
  }
  constexpr int kEmpty = -1;
  std::vector<std::vector<int>> slot_experts(ep_size, std::vector<int>(slots_per_rank, kEmpty));
  for (int e = 0; e < num_experts; ++e) {
    if (replicas[e].empty()) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "replicas: logical expert %d has no replica; every expert needs >= 1", e));
    }
    for (int i = 0; i < static_cast<int>(replicas[e].size()); ++i) {
      const ReplicaSlot& rs = replicas[e][i];
      if (rs.rank < 0 || rs.rank >= ep_size) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "replicas: expert %d replica %d: rank %d outside [0, %d)", e, i, rs.rank, ep_size));
      }
      if (rs.slot < 0 || rs.slot >= slots_per_rank) {
        return absl::InvalidArgumentError(
            absl::StrFormat("replicas: expert %d replica %d: slot %d outside [0, %d) on rank %d", e,
                            i, rs.slot, slots_per_rank, rs.rank));
      }
      int& held = slot_experts[rs.rank][rs.slot];
      if (held != kEmpty) {
        return absl::InvalidArgumentError(
            absl::StrFormat("replicas: rank %d slot %d is given twice, to expert %d and to "
                            "expert %d; every slot holds exactly one expert",
                            rs.rank, rs.slot, held, e));
      }
      held = e;
    }
  }
  for (int r = 0; r < ep_size; ++r) {
    for (int s = 0; s < slots_per_rank; ++s) {
      if (slot_experts[r][s] == kEmpty) {
        return absl::InvalidArgumentError(absl::StrFormat(
            "replicas: rank %d slot %d holds no expert; all %d x %d slots must be filled", r, s,
            ep_size, slots_per_rank));
      }
    }
  }
  return FromSlotExperts(num_experts, std::move(slot_experts));
}

int PlacementTable::NumSlots(int rank) const {
  CHECK(rank >= 0 && rank < ep_size());
  return static_cast<int>(slot_experts_[rank].size());
}

const std::vector<int>& PlacementTable::SlotExperts(int rank) const {
  CHECK(rank >= 0 && rank < ep_size());
  return slot_experts_[rank];
}

std::vector<int> PlacementTable::PhysicalToLogical() const {
  std::vector<int> out;
  out.reserve(replicas_.size());
  for (const std::vector<int>& rank : slot_experts_)
    out.insert(out.end(), rank.begin(), rank.end());
  return out;
}

absl::Span<const ReplicaSlot> PlacementTable::Replicas(int expert) const {
  CHECK(expert >= 0 && expert < num_experts_);
  return absl::MakeConstSpan(replicas_).subspan(
      replica_offsets_[expert], replica_offsets_[expert + 1] - replica_offsets_[expert]);
}

absl::StatusOr<PlacementTable> PlacementTable::WithMask(const std::vector<bool>& live) const {
  if (static_cast<int>(live.size()) != ep_size()) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "rank mask: expected %d entries (one per rank), got %d", ep_size(), live.size()));
  }
  if (std::none_of(live.begin(), live.end(), [](bool b) { return b; })) {
    return absl::InvalidArgumentError("rank mask: no rank is live");
  }
  PlacementTable out = *this;
  out.live_.clear();
  out.live_offsets_.clear();
  out.live_replicas_.clear();
  out.lost_.clear();
  if (std::all_of(live.begin(), live.end(), [](bool b) { return b; })) return out;
  out.live_ = live;
  out.live_offsets_.push_back(0);
  for (int e = 0; e < num_experts_; ++e) {
    for (const ReplicaSlot& replica : Replicas(e)) {
      if (live[replica.rank]) out.live_replicas_.push_back(replica);
    }
    out.live_offsets_.push_back(static_cast<int>(out.live_replicas_.size()));
    if (out.live_offsets_[e + 1] == out.live_offsets_[e]) out.lost_.push_back(e);
  }
  return out;
}

absl::Span<const ReplicaSlot> PlacementTable::LiveReplicas(int expert) const {
  if (live_.empty()) return Replicas(expert);
  CHECK(expert >= 0 && expert < num_experts_);
  return absl::MakeConstSpan(live_replicas_)
      .subspan(live_offsets_[expert], live_offsets_[expert + 1] - live_offsets_[expert]);
}

ReplicaSlot PlacementTable::ChooseReplica(int source_rank, int64_t source_token_idx,
                                          int expert) const {
  CHECK(source_rank >= 0 && source_rank < ep_size());
  CHECK(source_token_idx >= 0);
  const absl::Span<const ReplicaSlot> list = LiveReplicas(expert);
  CHECK(!list.empty());
  // Unsigned sum: no overflow for any valid token index and rank.
  const uint64_t key = static_cast<uint64_t>(source_token_idx) + static_cast<uint64_t>(source_rank);
  return list[key % list.size()];
}

std::string PlacementTable::CanonicalText() const {
  std::string text = absl::StrCat("moe-ep-placement/v1;experts=", num_experts_, ";");
  for (int r = 0; r < ep_size(); ++r) {
    absl::StrAppend(&text, "rank", r, "=", absl::StrJoin(slot_experts_[r], ","), ";");
  }
  if (masked()) {
    std::vector<int> live;
    for (int r = 0; r < ep_size(); ++r) {
      if (live_[r]) live.push_back(r);
    }
    absl::StrAppend(&text, "live=", absl::StrJoin(live, ","), ";");
  }
  return text;
}

uint64_t PlacementTable::Fingerprint() const { return Fingerprint64(CanonicalText()); }

}  // namespace moe_ep::core
