#include "kernels/nccl_graph_refs.h"

#include <thread>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/cuda_status.h"
#include "spdlog/spdlog.h"

namespace moe_ep::kernels {
namespace {

std::atomic<int> g_waiting_aborts{0};

// The user object's destructor: runs on a CUDA thread once the graph and all
// its instances are gone, so it only touches the counter (no CUDA call).
void ReleaseGraph(void* counter) {
  auto* live = static_cast<std::shared_ptr<std::atomic<int>>*>(counter);
  (*live)->fetch_sub(1, std::memory_order_acq_rel);
  delete live;
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
  live_->fetch_add(1, std::memory_order_acq_rel);
  // Moves the only reference into the graph: instantiation adds the
  // instances' own, so the release comes once all of them are destroyed.
  absl::Status moved =
      CudaStatus(cudaGraphRetainUserObject(graph, object, 1, cudaGraphUserObjectMove),
                 "cudaGraphRetainUserObject(NCCL graph reference)");
  if (!moved.ok()) {
    cudaUserObjectRelease(object, 1);  // runs ReleaseGraph: uncounted
    return moved;
  }
  last_capture_id_ = id;
  return absl::OkStatus();
}

void AbortNcclComm(ncclComm_t comm, int device, const NcclGraphRefs& refs) {
  if (comm == nullptr) return;
  const int live = refs.live();
  if (live == 0) {
    cudaSetDevice(device);
    ncclCommAbort(comm);
    return;
  }
  spdlog::warn(
      "NCCL communicator on device {}: {} CUDA graph(s) that captured its work still exist; NCCL "
      "frees it only once they are destroyed, so the abort finishes in the background when they "
      "are (destroy captured graphs before stopping the worker to free it at once)",
      device, live);
  g_waiting_aborts.fetch_add(1, std::memory_order_acq_rel);
  std::thread([comm, device] {
    cudaSetDevice(device);
    ncclCommAbort(comm);
    g_waiting_aborts.fetch_sub(1, std::memory_order_acq_rel);
  }).detach();
}

int NcclAbortsWaitingForGraphs() { return g_waiting_aborts.load(std::memory_order_acquire); }

}  // namespace moe_ep::kernels
