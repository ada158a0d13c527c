#pragma once

// The device side of bench/floor_bench.cc (issue 32 item 1): the smallest
// kernels a data-plane phase cannot do without, as host launchers so the
// bench itself stays plain C++. Each launch is stream-ordered and capturable.

#include <cuda_runtime.h>

#include <cstdint>

namespace moe_ep::bench {

// One rank's flag words, each on its own 128-byte line: `epoch` (the rank's
// own step counter, on the device so a replayed graph advances it), `own`
// (where the peer publishes) and `peer` (the peer's `own`; `own` itself at
// one rank, as a one-sided rank signals its own window at EP 1).
struct FlagSlots {
  uint64_t* epoch;
  uint64_t* own;
  uint64_t* peer;
};

// A kernel that does nothing, `blocks` x `threads`.
cudaError_t LaunchEmpty(cudaStream_t stream, int blocks, int threads);

// A one-block kernel whose argument ReplayForward-style code rewrites per
// replay (the step's T); it does nothing with it.
cudaError_t LaunchStepNode(cudaStream_t stream, int64_t tokens);

// One thread: epoch += 1, a release store of it into `peer`, then an acquire
// spin on `own` until the peer's store of the same epoch lands. Both ranks
// must launch it the same number of times.
cudaError_t LaunchFlagExchange(cudaStream_t stream, FlagSlots slots);

}  // namespace moe_ep::bench
