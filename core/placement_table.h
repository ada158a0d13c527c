#pragma once

// The expert placement table of DESIGN §15: every logical (routed) expert maps
// to an ordered list of replicas, each a (rank, local slot) pair; every local
// slot of every rank holds exactly one logical expert. The contiguous placement
// of DESIGN §7 (core/expert_placement.h) is the default table; a rebalancer
// (core/eplb.h) produces tables with redundant slots (DeepSeek's EPLB: 256
// logical experts on 288-320 physical slots).
//
// Shapes: E = num_experts (logical), R = ep_size, S_r = slots of rank r,
// S = sum of S_r (physical slots, S >= E).
//
// Slot counts per rank follow the §7 split of S over R: all equal when R
// divides S (every rebalanced table), otherwise ranks below S % R hold one
// slot more — which is how §7 places E experts without redundancy today
// (10 experts on 4 ranks -> 3, 3, 2, 2 slots).
//
// A table is immutable once built and safe to read from any thread.
// Source: DESIGN §15; issue 17.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::core {

// One physical copy of a logical expert: local slot `slot` of EP rank `rank`.
struct ReplicaSlot {
  int rank = 0;
  int slot = 0;
  // Spelled out: CUDA translation units include this header in C++17.
  friend bool operator==(const ReplicaSlot& a, const ReplicaSlot& b) {
    return a.rank == b.rank && a.slot == b.slot;
  }
};

class PlacementTable {
 public:
  // Contiguous()
  //
  // Returns the DESIGN §7 placement with no redundant slot: rank r's slots
  // hold experts FirstExpert(r) .. FirstExpert(r) + NumLocalExperts(r) - 1 of
  // ExpertPlacement::Contiguous, in order; every expert has one replica.
  //
  // Errors: kInvalidArgument as ExpertPlacement::Contiguous (num_experts < 1,
  // ep_size < 1, num_experts < ep_size).
  // Example: Contiguous(8, 2) -> rank 0 slots [0 1 2 3], rank 1 [4 5 6 7].
  static absl::StatusOr<PlacementTable> Contiguous(int num_experts, int ep_size);

  // FromSlotExperts()
  //
  // Builds a table from the physical view: `slot_experts[r][s]` is the logical
  // expert held by slot s of rank r ([R][S_r]). Replicas of each expert are
  // ordered by (rank, slot), so equal physical maps give equal tables.
  //
  // Errors (kInvalidArgument; messages name rank, slot, expert, expected and
  // got):
  //   num_experts < 1; slot_experts empty (ep_size 0);
  //   a rank with no slot;
  //   slot counts not the §7 split of their total (see the file comment);
  //   an expert id outside [0, num_experts);
  //   a logical expert held by no slot.
  static absl::StatusOr<PlacementTable> FromSlotExperts(int num_experts,
                                                        std::vector<std::vector<int>> slot_experts);

  // FromReplicas()
  //
  // Builds a table from the logical view: `replicas[e]` lists the slots that
  // hold logical expert e ([E][replicas of e], any order; the table keeps them
  // sorted by (rank, slot)). Every rank has `slots_per_rank` slots.
  //
  // Errors (kInvalidArgument; messages name expert, replica, rank, slot):
  //   num_experts, ep_size or slots_per_rank < 1;
  //   replicas.size() != num_experts;
  //   an expert with no replica;
  //   a rank outside [0, ep_size) or a slot outside [0, slots_per_rank);
  //   a slot given to two replicas;
  //   a slot given to none (R * slots_per_rank slots must all be filled).
  static absl::StatusOr<PlacementTable> FromReplicas(
      int num_experts, int ep_size, int slots_per_rank,
      const std::vector<std::vector<ReplicaSlot>>& replicas);

  int num_experts() const { return num_experts_; }
  int ep_size() const { return static_cast<int>(slot_experts_.size()); }
  // Physical slots over all ranks (S).
  int num_slots() const { return static_cast<int>(replicas_.size()); }

  // Slots of `rank` (S_r). REQUIRES: 0 <= rank < ep_size().
  int NumSlots(int rank) const;

  // SlotExperts()
  //
  // The logical expert held by each local slot of `rank`, [S_r]: what
  // LoadExperts loads into that rank's slots (replicas of one logical expert
  // share its weights). REQUIRES: 0 <= rank < ep_size().
  const std::vector<int>& SlotExperts(int rank) const;

  // PhysicalToLogical()
  //
  // The slots of all ranks in rank order, [S]: entry (S_0 + .. + S_{r-1}) + s is the
  // logical expert of slot s of rank r. This is EPLB's `phy2log` row (and
  // SGLang's `physical_to_logical_map` row) when slot counts are equal.
  std::vector<int> PhysicalToLogical() const;

  // Replicas()
  //
  // The replicas of logical expert `expert`, sorted by (rank, slot), at least
  // one. REQUIRES: 0 <= expert < num_experts().
  absl::Span<const ReplicaSlot> Replicas(int expert) const;

  // WithMask()
  //
  // This table under a rank mask (DESIGN §15 rank masks; issue 17 item 3):
  // only ranks r with live[r] receive tokens. ChooseReplica then picks among
  // the live replicas of an expert (LiveReplicas); an expert with none is
  // lost (LostExperts): its choices are sent nowhere and contribute zero.
  // The physical map (SlotExperts, Replicas) stays; CanonicalText, the
  // fingerprint and operator== include the mask, so ranks that vote on the
  // fingerprint verify the same mask. All ranks live gives a table equal to
  // this one without a mask (masked() false).
  // Errors: kInvalidArgument when live.size() != ep_size() or no rank is live.
  // Example: Contiguous(4, 2) with live {true, false} -> LostExperts {2, 3}.
  absl::StatusOr<PlacementTable> WithMask(const std::vector<bool>& live) const;

  // Whether a rank is masked out.
  bool masked() const { return !live_.empty(); }
  // Whether `rank` receives tokens (true for every rank without a mask).
  // REQUIRES: 0 <= rank < ep_size().
  bool IsLive(int rank) const { return live_.empty() || live_[rank]; }
  // The replicas of `expert` on live ranks, sorted by (rank, slot); empty for
  // a lost expert. Equals Replicas(expert) without a mask.
  absl::Span<const ReplicaSlot> LiveReplicas(int expert) const;
  // The logical experts with no live replica, ascending (empty without a mask).
  const std::vector<int>& LostExperts() const { return lost_; }

  // ChooseReplica()
  //
  // The replica that receives logical expert `expert` for token
  // `source_token_idx` (the token's index in its source rank's batch of the
  // step, >= 0) sent from `source_rank`:
  //
  //   LiveReplicas(expert)[(source_token_idx + source_rank) mod NumLive]
  //
  // (LiveReplicas is Replicas without a mask; REQUIRES: it is not empty.)
  //
  // A pure function of its arguments and the table, so every run (and the
  // CPU reference and a device kernel computing the same formula) routes the
  // same token to the same replica, bit for bit. Round-robin over the token
  // index splits an expert's tokens evenly over its replicas, which is the
  // load model the rebalancer balances (core/placement_load.h); the rank
  // offset keeps token 0 of every rank from landing on the same replica. A
  // same-rank preference was not chosen: it would make a replica's load depend
  // on where tokens come from rather than on the table.
  //
  // REQUIRES: 0 <= source_rank < ep_size(), source_token_idx >= 0,
  // 0 <= expert < num_experts(). Thread-safe.
  // Example: replicas {(0,3), (5,1)}; rank 2, token 7 -> (7 + 2) mod 2 = 1
  // -> (5,1).
  ReplicaSlot ChooseReplica(int source_rank, int64_t source_token_idx, int expert) const;

  // CanonicalText()
  //
  // The text the fingerprint digests:
  // "moe-ep-placement/v1;experts=E;rank0=e,e,...;rank1=...;" — the physical
  // map, which determines the table.
  std::string CanonicalText() const;

  // Fingerprint()
  //
  // Fingerprint64 (core/fingerprint.h) of CanonicalText(): equal on every rank and
  // across processes for the same table; any moved replica changes it. Ranks
  // all-gather it before using a new table (DESIGN §15).
  uint64_t Fingerprint() const;

  friend bool operator==(const PlacementTable& a, const PlacementTable& b) {
    return a.num_experts_ == b.num_experts_ && a.slot_experts_ == b.slot_experts_ &&
           a.live_ == b.live_;
  }

 private:
  PlacementTable() = default;

  int num_experts_ = 0;
  std::vector<std::vector<int>> slot_experts_;  // [R][S_r]
  std::vector<int> replica_offsets_;            // [E + 1], CSR into replicas_
  std::vector<ReplicaSlot> replicas_;           // [S], grouped by expert
  // The rank mask (WithMask): empty = every rank live; else [R], and the
  // live replicas as a CSR like the above, and the lost experts.
  std::vector<bool> live_;
  std::vector<int> live_offsets_;           // [E + 1] into live_replicas_
  std::vector<ReplicaSlot> live_replicas_;  // grouped by expert
  std::vector<int> lost_;
};

}  // namespace moe_ep::core
