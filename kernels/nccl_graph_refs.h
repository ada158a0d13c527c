#pragma once

// CUDA graphs that captured a communicator's NCCL work, and a teardown that
// never waits on them (issue 30: an engine stopping its worker while its
// captured graphs still exist hung in moe_ep_worker_stop).
//
// Since NCCL 2.26, ncclCommAbort and ncclCommDestroy poll until every CUDA
// graph (and executable instance) that captured work of the communicator is
// destroyed: a graph holds the communicator. An engine that captured
// dispatch / combine on the NCCL plane and stops the worker before it drops
// its graphs (torch keeps them until they go out of scope) would block that
// thread forever. NcclGraphRefs counts those graphs the same way NCCL does
// (a cudaUserObject moved into each capture, released when the graph and
// all its instances are gone); AbortNcclComm aborts at once when none is
// left and otherwise hands the abort to a detached thread, which finishes
// when the engine destroys its last graph (or never, if it keeps them to
// the end of the process: the communicator is then reclaimed at exit).

#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <memory>

#include "absl/status/status.h"

namespace moe_ep::kernels {

class NcclGraphRefs {
 public:
  NcclGraphRefs();

  // Call before enqueueing NCCL work on `stream`: when the stream is
  // capturing into a graph not counted yet, moves a user object into that
  // graph whose release (the graph and every instance of it destroyed)
  // uncounts it. A stream not capturing costs one cudaStreamGetCaptureInfo.
  // Errors: kInternal (a CUDA call failed; nothing counted).
  // Not thread-safe (the collective's caller thread); live() is.
  absl::Status NoteEnqueue(cudaStream_t stream);

  // Graphs (with their instances) that captured work and still exist.
  int live() const { return live_->load(std::memory_order_acquire); }

 private:
  std::shared_ptr<std::atomic<int>> live_;
  unsigned long long last_capture_id_ = 0;  // NOLINT(google-runtime-int): CUDA's type
};

// ncclCommAbort(comm) on `device`, on this thread when `refs` counts no live
// graph, else on a detached thread (a warning is logged naming the count),
// so that the caller never waits on graphs it does not own. Thread-safe.
void AbortNcclComm(ncclComm_t comm, int device, const NcclGraphRefs& refs);

// Aborts handed to a detached thread that have not finished: their graphs
// still exist. For tests and diagnostics. Thread-safe.
int NcclAbortsWaitingForGraphs();

}  // namespace moe_ep::kernels
