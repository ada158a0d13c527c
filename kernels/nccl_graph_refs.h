#pragma once

// CUDA graphs that captured a communicator's NCCL work, and a teardown that
// never waits on them (issue 30: an engine stopping its worker while its
// captured graphs still existed hung in moe_ep_worker_stop).
//
// ncclCommAbort and ncclCommDestroy poll until every CUDA graph (with its
// instances and clones) that captured a kernel plan of the communicator is
// destroyed (NCCL's commDestroySync, since 2.14; per communicator since
// 2.26): a graph holds the communicator. An engine that captured dispatch /
// combine on the NCCL plane and stops the worker before it drops its graphs
// (torch keeps them until they go out of scope) would block that thread
// forever. NcclGraphRefs counts those captures the way NCCL does (a
// cudaUserObject moved into each capture, released when the graph and all
// its instances are gone). It may count a capture NCCL does not hold (a
// one-rank collective NCCL runs as a copy, a call that failed): the abort
// then only waits longer than it had to. AbortNcclComm aborts at once when
// no capture is left and otherwise on a detached thread once the engine has
// destroyed them; if the process exits first, the communicator is left to
// the exit (never aborted while the process tears down).

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <memory>

#include "absl/status/status.h"

namespace moe_ep::kernels {

class NcclGraphRefs {
 public:
  NcclGraphRefs();
  NcclGraphRefs(const NcclGraphRefs&) = delete;
  NcclGraphRefs& operator=(const NcclGraphRefs&) = delete;

  // Call before enqueueing NCCL work on `stream`: when the stream is
  // capturing (on its own, or joined to another stream's capture through an
  // event) into a graph not counted yet, moves a user object into that graph
  // whose release (the graph and every instance and clone of it destroyed)
  // uncounts it. A stream not capturing costs one cudaStreamGetCaptureInfo.
  // Errors: the CUDA error as a status (kernels/cuda_status.h: e.g.
  // kResourceExhausted, kInternal) naming the call; nothing is counted.
  // Not thread-safe (the collective's caller thread); live() is.
  absl::Status NoteEnqueue(cudaStream_t stream);

  // Captures (each with its instances and clones) that still exist. The
  // release runs on a CUDA thread shortly after the last one is destroyed.
  int live() const { return live_->load(std::memory_order_acquire); }

 private:
  friend void AbortNcclComm(ncclComm_t comm, int device, const NcclGraphRefs& refs);

  // Shared with each capture's user object, which may outlive this object.
  std::shared_ptr<std::atomic<int>> live_;
  unsigned long long last_capture_id_ = 0;  // NOLINT(google-runtime-int): CUDA's type
};

// ncclCommAbort(comm) on `device`. When `refs` counts no live capture (after
// up to 200 ms for releases of graphs destroyed just before, which CUDA runs
// asynchronously), on this thread; else a warning naming the count is logged
// and a detached thread waits until the captures are gone, then aborts
// (skipped once the process has begun to exit); NcclAbortsWaitingForGraphs
// counts those. Never waits on graphs the caller does not own. Thread-safe.
void AbortNcclComm(ncclComm_t comm, int device, const NcclGraphRefs& refs);

// Deferred aborts that have not finished: their captures still exist. For
// tests and diagnostics. Thread-safe.
int NcclAbortsWaitingForGraphs();

}  // namespace moe_ep::kernels
