#pragma once

// The local slot of an expert id on one rank (DESIGN §15, §17 "expert sets
// hold any ids"): a rank's experts are its local slots 0..L-1, each answering
// to one id, in ascending id order (the distinct logical experts of its
// placement-table slots, core::DistinctSlotExperts, or the one-sided plane's
// dispatch ids of those slots, server/onesided_route_map.h). Every path that
// indexes a rank's expert weights or counters (the device expert set and the
// kernels that group received rows by expert, kernels/device_experts.h) turns
// an id into its slot with LocalSlot, never by subtracting a first id, so a
// rank may hold any set of ids.
//
// MOE_EP_HOST_DEVICE expands to `__host__ __device__` under nvcc and to
// nothing otherwise (as core/seeded_stream.h), so the host tests and the
// kernels run the same code and core/ stays CUDA-free.
// Pure and thread-safe. Source: DESIGN §15, §17; issue 34 item 2.

#include <cstdint>

#if defined(__CUDACC__)
#define MOE_EP_HOST_DEVICE __host__ __device__
#else
#define MOE_EP_HOST_DEVICE
#endif

namespace moe_ep::core {

// LocalSlot()
//
// The slot s with slot_ids[s] == id, or -1 when no slot answers to `id`
// (another rank's expert, the invalid id -1 or num_experts, padding).
// `slot_ids` [num_slots] is ascending and distinct (REQUIRES; num_slots >= 0,
// slot_ids may be null when num_slots is 0). Ids that form one range
// [a, a + n) take the slot id - a without a search (two reads); any other set
// is searched by bisection (about log2(n) reads).
// Example: slot_ids {2, 5, 9}: id 5 -> 1, id 9 -> 2, id 3 -> -1, id -1 -> -1;
// slot_ids {4, 5, 6}: id 6 -> 2.
MOE_EP_HOST_DEVICE inline int LocalSlot(const int32_t* slot_ids, int num_slots, int32_t id) {
  if (num_slots <= 0) return -1;
  const int32_t lo = slot_ids[0];
  const int32_t hi = slot_ids[num_slots - 1];
  if (id < lo || id > hi) return -1;
  if (hi - lo == num_slots - 1) return static_cast<int>(id - lo);
  int begin = 0;
  int end = num_slots;
  while (begin < end) {
    const int mid = begin + (end - begin) / 2;
    if (slot_ids[mid] < id) {
      begin = mid + 1;
    } else {
      end = mid;
    }
  }
  return begin < num_slots && slot_ids[begin] == id ? begin : -1;
}

}  // namespace moe_ep::core
