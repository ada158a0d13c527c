#pragma once

// Device helpers of the placement table shared by the route and pack kernels
// (DESIGN §7, §15). Internal to kernels/.

#include <cstdint>

#include "kernels/route.cuh"

namespace moe_ep::kernels::internal {

// Owner rank of a valid expert under the contiguous placement: the first
// `rem` ranks own base + 1 experts, the rest own base.
__device__ __forceinline__ int RankOfExpert(int expert, int base, int rem) {
  const int big = rem * (base + 1);
  return expert < big ? expert / (base + 1) : rem + (expert - big) / base;
}

// Replicas of valid expert `id` under `placement` (REQUIRES: a table).
__device__ __forceinline__ int32_t NumReplicas(const DevicePlacement& placement, int32_t id) {
  return placement.replica_offsets[id + 1] - placement.replica_offsets[id];
}

// The rank that serves valid choice `id` of token `t`: the contiguous owner,
// or under a table core::PlacementTable::ChooseReplica's rank among the live
// replicas the device copy holds; -1 for an expert with none (lost under a
// rank mask, DESIGN §15: the choice goes nowhere and contributes zero).
__device__ __forceinline__ int DestinationRank(const DevicePlacement& placement, int64_t t,
                                               int32_t id, int base, int rem) {
  if (placement.replica_offsets == nullptr) return RankOfExpert(id, base, rem);
  const int32_t begin = placement.replica_offsets[id];
  const int32_t n = placement.replica_offsets[id + 1] - begin;
  if (n == 0) return -1;
  const uint64_t key = static_cast<uint64_t>(t) + static_cast<uint64_t>(placement.source_rank);
  return placement.replica_ranks[begin + static_cast<int32_t>(key % static_cast<uint64_t>(n))];
}

}  // namespace moe_ep::kernels::internal
