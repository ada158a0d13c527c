#pragma once

// Join's formation of a group (DESIGN §8; issue 13 items 5-6): the
// rendezvous store of the joined generation (rank 0's Rendezvous service over
// gRPC, or an in-process store for a group of one) and the data plane formed
// through it (server/data_plane.h FormDataPlane).
//
// Thread-safe as FormDataPlane; blocks until the group formed or failed.

#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "server/data_plane.h"
#include "server/request_options.h"

namespace moe_ep::server {

// The group a worker is in when a Join arrives.
struct JoinedGroup {
  bool joined = false;             // JOINED or later
  bool broken = false;             // a collective of it failed
  std::string broken_reason;       // why
  const JoinArgs* args = nullptr;  // what it was joined with (when joined)
};

// CheckJoin()
//
// Whether a Join with `args` may go ahead, given the group in force and the
// highest generation this worker ever tried to form (`max_generation_used`;
// rendezvous keys are write-once). *same_group = true (and OK): the group
// formed with these very arguments is in force and not broken, Join is a
// no-op. Otherwise OK means "form a new group". kFailedPrecondition: the same
// arguments on a broken group ("... is broken (<reason>); re-join with a new
// generation"), the joined generation with other arguments, or a generation
// <= max_generation_used. kInvalidArgument: a generation above
// GenerationLimit (naming --max-generation and the generation to use).
absl::Status CheckJoin(const JoinedGroup& current, int64_t max_generation_used,
                       int64_t max_generation, const JoinArgs& args, bool* same_group);

// GenerationLimit()
//
// The highest generation a Join may ask for: `max_generation` (the
// --max-generation flag), or 1 + `max_generation_used` once that is higher,
// so that a worker that reached the top of the range still accepts the next
// generation (one per Join: 2^63 - 2^53 Joins before int64 runs out) and a
// single Join never jumps far above the range (issue 13 item 3).
int64_t GenerationLimit(int64_t max_generation_used, int64_t max_generation);

// FormJoinedGroup()
//
// Forms the group of `args` on CUDA device `device` (NCCL only), the
// one-sided plane's kernels `onesided_sm_budget` blocks each, its windows
// with receive buffers when `onesided_receive_buffers` (DataPlaneGroup).
// Meeting the peers ends by `call_deadline` or after args.timeout,
// whichever is first (the caller is gone once its deadline passed).
// Errors: FormDataPlane's. (A budget over the device's multiprocessors is
// refused later, when the one-sided dispatcher is made: AllocateWorkspace,
// kInvalidArgument naming the count.)
absl::StatusOr<std::unique_ptr<DataPlane>> FormJoinedGroup(const JoinArgs& args, int device,
                                                           int onesided_sm_budget,
                                                           bool onesided_receive_buffers,
                                                           absl::Time call_deadline);

}  // namespace moe_ep::server
