#pragma once

// Device side of kernels/expert_id_error.h: the route kernels call it once
// per (token, choice) id they read (one block only, so each is counted once).

#include <cstdint>

#include "kernels/expert_id_error.h"

namespace moe_ep::kernels::internal {

// Records topk_ids[index] = id in *e unless it is a valid expert or the
// configured invalid id. e may be null (not checked).
__device__ __forceinline__ void CheckExpertId(ExpertIdError* e, int32_t id, int64_t index,
                                              int num_experts, int32_t invalid_expert_id) {
  if (e == nullptr || (id >= 0 && id < num_experts) || id == invalid_expert_id) return;
  atomicAdd(&e->count, 1ULL);
  const unsigned long long packed =
      (static_cast<unsigned long long>(index) << 32) | static_cast<uint32_t>(id);
  atomicMax(&e->first_inverted, ~packed);
}

// The id a receiver is sent for `id`: itself when it is an expert, else the
// invalid id (receivers see only those two kinds; CheckExpertId recorded
// any other).
__device__ __forceinline__ int32_t ExpertOrInvalid(int32_t id, int num_experts,
                                                   int32_t invalid_expert_id) {
  return id >= 0 && id < num_experts ? id : invalid_expert_id;
}

}  // namespace moe_ep::kernels::internal
