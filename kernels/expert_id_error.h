#pragma once

// The device-side record of expert ids a GPU data plane was handed that are
// neither in [0, num_experts) nor the configured invalid id (DESIGN §7: only
// that id masks; any other is the caller's routing bug). The engine's calls
// take ids in device memory and only enqueue (DESIGN §14), so the check runs
// in the route kernels: such a choice selects no expert, and the step's sync
// point (CheckStep) reports the first one and the count (issue 30 item 1).

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

// All zero = none seen. 16 bytes of device memory, reset by the owner after
// reading it. first_inverted is ~((index << 32) | uint32(id)) of the bad
// choice with the lowest flat index t * K + k (atomicMax of the inverse is
// atomicMin of the index, so the record is deterministic under any schedule).
struct ExpertIdError {
  unsigned long long first_inverted = 0;
  unsigned long long count = 0;
};

// ExpertIdErrorStatus()
//
// OK when `e` records nothing; else core::ExpertIdError (ValidateExpertIds'
// words) plus where it was found, e.g. "topk_ids[row 3, choice 1] = 300: outside
// [0, 256) and not the invalid expert id -1 (2 ids out of range; found on the
// device by rank 0's step: those choices selected no expert)". Thread-safe.
absl::Status ExpertIdErrorStatus(const ExpertIdError& e, int top_k, int num_experts,
                                 int32_t invalid_expert_id, int rank);

}  // namespace moe_ep::kernels
