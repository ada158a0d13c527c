#pragma once

// How a communicator follows an agreed rank mask (DESIGN §15 rank masks;
// issue 17 item 3): the host-side arithmetic of the NCCL plane's
// ncclCommShrink / re-initialisation, kept free of NCCL so it is tested on
// any machine.
//
// A communicator's members are original ranks (the numbering of the group
// as formed), listed in the communicator's rank order: member i is
// communicator rank i. The group as formed has members {0..world-1}; a
// shrunk one drops the lost ranks and closes the gaps (ncclCommShrink
// "re-orders ranks to fill the gap of removed ones"), so it keeps ascending
// order. Given the members of the communicator in use (the parent) and the
// mask the survivors agreed on:
//   kKeep    the live ranks are the parent's members: nothing to do;
//   kShrink  every live rank is a member of the parent: exclude the parent
//            ranks (parent numbering, ascending) whose original rank is
//            masked; the survivors call ncclCommShrink with that list;
//   kReinit  a live rank is not in the parent (a restarted rank returning,
//            the Rejoin RPC): the live ranks form a fresh communicator
//            (ncclCommInitRank with a new unique id that members.front()
//            makes and shares over the mask round's bootstrap group).
// In every case the new communicator's members are the live ranks ascending
// and this rank's new rank is its index among them.
// Pure functions; thread-safe. Source: DESIGN §15; issue 17 item 3.

#include <vector>

#include "absl/status/statusor.h"

namespace moe_ep::core {

struct ShrinkPlan {
  enum class Kind { kKeep, kShrink, kReinit };
  Kind kind = Kind::kKeep;
  std::vector<int> exclude;  // kShrink: parent ranks to drop, ascending (parent numbering)
  std::vector<int> members;  // the new communicator's original ranks, ascending
  int new_rank = 0;          // this rank's rank in the new communicator
};

// PlanShrink()
//
// `parent_members`: original ranks of the communicator in use, ascending,
// each in [0, live.size()); `live` [world]: the agreed mask; `rank`: this
// rank's original number, which must be live. Errors: kInvalidArgument
// (naming the entry: parent members not ascending or out of range, an empty
// parent, rank out of range or masked).
absl::StatusOr<ShrinkPlan> PlanShrink(const std::vector<int>& parent_members,
                                      const std::vector<bool>& live, int rank);

// The communicator rank of original rank `original` among `members`
// (ascending original ranks): its index, or -1 when it is not a member.
int CommRankOf(const std::vector<int>& members, int original);

// The original ranks that are live, ascending: a communicator's members
// under mask `live`.
std::vector<int> LiveMembers(const std::vector<bool>& live);

}  // namespace moe_ep::core
