#include "kernels/nccl_graph_refs.h"

#include <chrono>
#include <cstdlib>
#include <system_error>
#include <thread>

#include "core/status_macros.h"
#include "kernels/cuda_status.h"
#include "spdlog/spdlog.h"

namespace moe_ep::kernels {
namespace {

using Clock = std::chrono::steady_clock;

std::atomic<int> g_waiting_aborts{0};
// Set by an atexit hook: a deferred abort that has not started by then
// leaves the communicator to the exit (NCCL's and CUDA's teardown would race
// a late ncclCommAbort).
std::atomic<bool> g_exiting{false};

void MarkExiting() { g_exiting.store(true, std::memory_order_release); }

// The user object's destructor: runs on a CUDA thread once the graph and all
// its instances are gone, so it only touches the counter (no CUDA call).
void ReleaseGraph(void* counter) {
  auto* live = static_cast<std::shared_ptr<std::atomic<int>>*>(counter);
  (*live)->fetch_sub(1, std::memory_order_acq_rel);
  delete live;
}

// Waits until `live` reads 0 or `limit` has passed; true when it reached 0.
bool WaitForNoCaptures(const std::shared_ptr<std::atomic<int>>& live, Clock::duration limit) {
  const Clock::time_point end = Clock::now() + limit;
  while (live->load(std::memory_order_acquire) > 0) {
    if (Clock::now() >= end) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return true;
}

void AbortNow(ncclComm_t comm, int device) {
  cudaSetDevice(device);
  const ncclResult_t r = ncclCommAbort(comm);
  if (r != ncclSuccess) {
    spdlog::warn("ncclCommAbort on device {}: {}", device, ncclGetErrorString(r));
  }
}

}  // namespace

NcclGraphRefs::NcclGraphRefs() : live_(std::make_shared<std::atomic<int>>(0)) {}

absl::Status NcclGraphRefs::NoteEnqueue(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;  // NOLINT(google-runtime-int): CUDA's type
  cudaGraph_t graph = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaStreamGetCaptureInfo(stream, &status, &id, &graph),
                             "cudaStreamGetCaptureInfo(NCCL stream)"));
  if (status != cudaStreamCaptureStatusActive || id == last_capture_id_) return absl::OkStatus();
  auto* counter = new std::shared_ptr<std::atomic<int>>(live_);
  cudaUserObject_t object = nullptr;
  absl::Status made = CudaStatus(
      cudaUserObjectCreate(&object, counter, ReleaseGraph, 1, cudaUserObjectNoDestructorSync),
      "cudaUserObjectCreate(NCCL graph reference)");
  if (!made.ok()) {
    delete counter;
    return made;
  }
  // Counted before the move: if the move fails, releasing the object runs
  // ReleaseGraph, which takes the count back.
  live_->fetch_add(1, std::memory_order_acq_rel);
  // Moves the only reference into the graph: instantiation and cloning add
  // their own, so the release comes once all of them are destroyed.
  absl::Status moved =
      CudaStatus(cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove),
                 "cudaGraphRetainUserObject(NCCL graph reference)");
  if (!moved.ok()) {
    cudaUserObjectRelease(object, 1);
    return moved;
  }
  last_capture_id_ = id;
  return absl::OkStatus();
}

void AbortNcclComm(ncclComm_t comm, int device, const NcclGraphRefs& refs) {
  if (comm == nullptr) return;
  // A graph destroyed just before this call is released on a CUDA thread a
  // moment later: wait briefly rather than defer a clean shutdown.
  const std::shared_ptr<std::atomic<int>> live = refs.live_;
  if (WaitForNoCaptures(live, std::chrono::milliseconds(200))) {
    AbortNow(comm, device);
    return;
  }
  static const bool hooked = std::atexit(MarkExiting) == 0;
  (void)hooked;
  spdlog::warn(
      "NCCL communicator on device {}: {} CUDA graph capture(s) of its work still exist; NCCL "
      "frees it only once they are destroyed, so it is aborted in the background when they are "
      "(destroy captured graphs before stopping the worker to free it at once)",
      device, live->load(std::memory_order_acquire));
  g_waiting_aborts.fetch_add(1, std::memory_order_acq_rel);
  try {
    std::thread([comm, device, live] {
      WaitForNoCaptures(live, Clock::duration::max() / 2);
      if (!g_exiting.load(std::memory_order_acquire)) AbortNow(comm, device);
      g_waiting_aborts.fetch_sub(1, std::memory_order_acq_rel);
    }).detach();
  } catch (const std::system_error& e) {
    // No thread: leave the communicator to the exit rather than block here.
    g_waiting_aborts.fetch_sub(1, std::memory_order_acq_rel);
    spdlog::warn("NCCL communicator on device {} left unaborted: no thread ({})", device, e.what());
  }
}

int NcclAbortsWaitingForGraphs() { return g_waiting_aborts.load(std::memory_order_acquire); }

}  // namespace moe_ep::kernels
