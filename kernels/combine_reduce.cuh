#pragma once

// Host launcher of the combine reduction (DESIGN §7): each source token sums
// one term per distinct destination rank, in fp32, and is written as bf16.

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/step_header.cuh"

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
  // device [E, 3] int64: every rank's step header {epoch, R, T} as the
  // combine's NCCL group delivered it (GpuEpDispatcher), or null for no
  // check. A T of kRefusedCombineTokens (a refused combine, issue 30 item 1)
  // in any row ends the step here without an output row.
  const int64_t* headers = nullptr;
  int rank = 0;                      // this rank, with headers
  StepHeaderError* error = nullptr;  // device; with headers: where a peer's refusal is recorded
};

// LaunchCombineReduce()
//
// Enqueues out[t] = bf16( sum over d ascending with token_slot[t, d] >= 0 of
// float(recv[d, token_slot[t, d]]) [+ float(shared[t])] ) for t < T. Grid: R blocks of 256
// threads, block t reads its destination slots into shared memory and
// reduces 4 elements per thread step; blocks t >= T exit.
// A token with no valid expert gets a zero row.
// With `headers`: when some row's T is kRefusedCombineTokens no block writes
// a row. When this rank's own row is one of them nothing is recorded (its
// caller has the error), whatever the peers' rows say; else block 0 records
// the lowest refusing peer if error->rank_plus_1 is 0 (refused = 1,
// combine = 1, their/my epoch and R from its row). Launches max(R, 1)
// blocks then, so the check runs even at R = 0.
//
// Errors (host checks): kInvalidArgument for null pointers (error null
// with headers; rank outside [0, E) with headers), max_tokens < 0,
// H not a positive multiple of 4, E outside [1, kMaxEpSize]; kInternal when
// the launch fails. Never allocates or synchronises (graph-capturable).
absl::Status LaunchCombineReduce(const CombineReduceParams& params, cudaStream_t stream);

}  // namespace moe_ep::kernels
