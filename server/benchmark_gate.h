#pragma once

// The start of each Benchmark iteration (both data planes): the ranks agree
// whether any of them is past its call's deadline, so that a Benchmark whose
// iterations outlast its caller stops on every rank at the same iteration
// and frees the collective slot (issue 13 item 6: work must not outlive its
// caller; found by the long fuzz run, bench/results/fuzz-long/). The
// collective itself stays usable; WorkerService still marks its group broken
// on the DEADLINE_EXCEEDED, as for any collective that ran out of time.
//
// Thread-compatible (one Benchmark at a time holds the collective slot).

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "core/collective.h"

namespace moe_ep::server {

// BenchmarkIterationGate()
//
// A collective over `collective` (it replaces the per-iteration barrier:
// every rank enters it): all-gathers "now >= deadline" from each rank. OK
// when no rank is past its deadline; otherwise kDeadlineExceeded on every
// rank: "Benchmark: the call's deadline passed after <done> of <total>
// iterations (warmup included); ask for fewer iterations or a longer
// deadline". The collective's own errors pass through.
absl::Status BenchmarkIterationGate(core::ControlCollective& collective, absl::Time deadline,
                                    int done, int total);

}  // namespace moe_ep::server
