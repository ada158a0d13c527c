#pragma once

// Host launcher of the device-side geometry check of a replayed CUDA graph
// (DESIGN §6): after the step header {epoch, R, T} of every rank has been
// all-gathered on the device, verify that all ranks agree on (epoch, R).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

// LaunchVerifyStepHeader()
//
// One thread. `gathered` is device [E, 3] int64 (rank-major {epoch, R, T}),
// `header` this rank's device {epoch, R, T}. On the first rank r whose
// (epoch, R) differs from this rank's, writes *error_rank = r + 1 and sets
// header[2] (T) to 0, so the rest of the step moves only padding and no
// out-of-range slot is ever written. *error_rank is left as is otherwise
// (the owner resets it to 0 after reading it).
// Errors: kInvalidArgument (null pointers, E outside [1, kMaxEpSize]),
// kInternal (launch). Never allocates or synchronises.
absl::Status LaunchVerifyStepHeader(const int64_t* gathered, int ep_size, int64_t* header,
                                    int32_t* error_rank, cudaStream_t stream);

}  // namespace moe_ep::kernels
