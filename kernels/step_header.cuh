#pragma once

// Host launchers of the step header kernels (DESIGN §6): write this rank's
// step header {epoch, R, T} on the stream (no host copy), and, after the
// headers of every rank have been exchanged on the device, verify that all
// ranks agree on (epoch, R).

#include <cuda_runtime.h>

#include <cstdint>

#include "absl/status/status.h"
#include "kernels/expert_id_error.h"

namespace moe_ep::kernels {

// The T a refused step's header carries to the peers in place of the token
// count (LaunchWriteStepHeader with `refused`; GpuEpDispatcher::RefuseStep):
// no step has a negative T, so every peer's header check sees the refusal.
// Issue 30 item 1.
inline constexpr int64_t kRefusedStepTokens = -1;
// The T a refused combine's header carries (GpuEpDispatcher::RefuseCombine):
// the rank dispatched the step but its combine's arguments failed its
// checks. The header travels in the combine's NCCL group and the combine
// reduction reads it (CombineReduceParams::headers): no rank writes an
// output row of that step. Issue 30 item 1.
inline constexpr int64_t kRefusedCombineTokens = -2;

// What a header's T says of the step (LaunchWriteStepHeader's `sent`).
enum class HeaderRefusal : int {
  kNone,     // the step's own T
  kStep,     // kRefusedStepTokens: the dispatch (and the step) refused
  kCombine,  // kRefusedCombineTokens: the combine refused
};

// The device-side record of the first (epoch, R) disagreement or refused
// step seen since the owner last reset it (all zero = none), and of the
// out-of-range expert ids the route kernel saw (kernels/expert_id_error.h).
// 64 bytes, device memory.
struct StepHeaderError {
  int32_t rank_plus_1 = 0;  // first disagreeing (or refusing) rank + 1; 0 = no error
  int32_t r_differs = 0;    // 1 when that rank's R differs (not only its epoch)
  int64_t their_epoch = 0;  // that rank's epoch
  int64_t their_r = 0;      // that rank's R
  int64_t my_epoch = 0;     // this rank's epoch in that step
  int64_t my_r = 0;         // this rank's R in that step
  // 1 when that rank agreed on (epoch, R) but refused its dispatch (its
  // header's T was kRefusedStepTokens: its caller's arguments failed its
  // checks; the step then moved only padding from it) or, with `combine`,
  // its combine (kRefusedCombineTokens); either way no output was written.
  int32_t refused = 0;
  // 1 when the refusal was of the combine (kRefusedCombineTokens, recorded
  // by the combine reduction; my_epoch / my_r are then that rank's too).
  int32_t combine = 0;
  ExpertIdError ids;  // ids neither valid nor the invalid id (DESIGN §7)
};

#ifdef __CUDACC__
// RecordStepHeaderError()
//
// Records rank r's header row `row` ({epoch, R, T}) in `error`, with this
// rank's (my_epoch, my_r) and the flags, unless an earlier record sticks
// (error->rank_plus_1 != 0). One thread; the header check
// (LaunchCheckStepHeaders) and the combine reduction's refusal check both
// fill the record through it.
__device__ inline void RecordStepHeaderError(StepHeaderError* error, int r, const int64_t* row,
                                             int32_t r_differs, int32_t refused, int32_t combine,
                                             int64_t my_epoch, int64_t my_r) {
  if (error->rank_plus_1 != 0) return;
  error->rank_plus_1 = r + 1;
  error->r_differs = r_differs;
  error->refused = refused;
  error->combine = combine;
  error->their_epoch = row[0];
  error->their_r = row[1];
  error->my_epoch = my_epoch;
  error->my_r = my_r;
}
#endif  // __CUDACC__

// LaunchWriteStepHeader()
//
// Writes header[0..2] = {epoch, r, num_tokens} and the same three values
// into each of the `num_replicas` rows of `replicas` ([num_replicas, 3]
// int64, the send buffer of the header exchange; may be null when
// num_replicas is 0). With `sent` kStep (this rank's caller failed its
// checks; issue 30 item 1) the replicas' T is kRefusedStepTokens instead, so
// the peers' LaunchCheckStepHeaders record the refusal; with kCombine it is
// kRefusedCombineTokens, which the peers' combine reduction reads; `header`
// keeps `num_tokens` (0 for a refusal: this rank's kernels move only
// padding).
// The values travel as kernel arguments, so nothing is copied from
// (pageable) host memory and the host never waits.
// Errors: kInvalidArgument (null header, null replicas with num_replicas > 0,
// num_replicas outside [0, kMaxEpSize]), kInternal (launch). Never allocates
// or synchronises.
absl::Status LaunchWriteStepHeader(int64_t* header, int64_t* replicas, int num_replicas,
                                   int64_t epoch, int64_t r, int64_t num_tokens, HeaderRefusal sent,
                                   cudaStream_t stream);

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

// LaunchCheckStepHeaders()
//
// As LaunchVerifyStepHeader, recording the disagreement in `error` (only
// when error->rank_plus_1 is still 0, so the first one sticks until the
// owner resets it) and setting header[2] (T) to 0, so the rest of the step
// writes no output row. When every rank agrees on (epoch, R) but some sent
// T = kRefusedStepTokens (a refused step, issue 30 item 1): on `rank`
// itself (its own row refused) nothing is recorded (its caller has the
// error); elsewhere the lowest refusing rank is recorded with
// error->refused = 1. Either way header[2] becomes 0. Errors (also `rank`
// outside [0, E)) and guarantees as LaunchVerifyStepHeader.
absl::Status LaunchCheckStepHeaders(const int64_t* gathered, int ep_size, int rank, int64_t* header,
                                    StepHeaderError* error, cudaStream_t stream);

}  // namespace moe_ep::kernels
