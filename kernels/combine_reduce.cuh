#pragma once

// Host launcher of the combine reduction (DESIGN §7): each source token sums
// one term per distinct destination rank, in fp32, and is written as bf16.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"

namespace moe_ep::kernels {

struct CombineReduceParams {
  const uint16_t* recv = nullptr;       // device [E, R, H] bf16: row d*R + s = rank d's
                                        // result for this rank's token in slot s
  const int32_t* token_slot = nullptr;  // device [R, E] from LaunchRoute
  const int64_t* num_tokens = nullptr;  // device scalar T, clamped to max_tokens
  int64_t max_tokens = 0;               // R
  int64_t hidden_size = 0;              // H, a multiple of 4
  int ep_size = 0;                      // E
  uint16_t* output = nullptr;           // device [T, H] bf16
  // device [T, H] bf16: this rank's shared-expert term (issue 18), added
  // after the ranks' terms; null = none.
  const uint16_t* shared = nullptr;
};

// LaunchCombineReduce()
//
// Enqueues out[t] = bf16( sum over d ascending with token_slot[t, d] >= 0 of
// float(recv[d, token_slot[t, d]]) [+ float(shared[t])] ) for t < T. Grid: R blocks of 256
// threads, block t reads its destination slots into shared memory and
// reduces 4 elements per thread step; blocks t >= T exit.
// A token with no valid expert gets a zero row.
//
// Errors (host checks): kInvalidArgument for null pointers, max_tokens < 0,
// H not a positive multiple of 4, E outside [1, kMaxEpSize]; kInternal when
// the launch fails. Never allocates or synchronises (graph-capturable).
absl::Status LaunchCombineReduce(const CombineReduceParams& params, cudaStream_t stream);

}  // namespace moe_ep::kernels
