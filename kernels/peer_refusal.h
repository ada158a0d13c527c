#pragma once

// What a rank's sync point (CheckStep) says when a peer refused a call of
// the step both device planes share (issue 30 item 1): the refusing rank's
// caller failed its own checks and got the error; the refusal ran in place
// of that call so this rank's step ended at once instead of waiting for it.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/strings/string_view.h"

namespace moe_ep::kernels {

// The call the peer refused: its dispatch (the whole step) or its combine.
enum class RefusedPhase { kDispatch, kCombine };

// PeerRefusalError()
//
// kAborted "rank <rank> refused its <dispatch|combine> of the step at epoch
// <epoch> (its arguments failed that rank's checks; its call returned the
// error); <here>; the group is still usable". `here` says what the step did
// on this rank (e.g. "the step wrote no output here (its received rows lack
// that rank's)"). Thread-safe (pure).
absl::Status PeerRefusalError(int rank, int64_t epoch, RefusedPhase phase, absl::string_view here);

}  // namespace moe_ep::kernels
