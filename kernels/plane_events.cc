#include "kernels/plane_events.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda_status.h"

namespace moe_ep::kernels {

absl::StatusOr<std::unique_ptr<GpuPlaneEvents>> GpuPlaneEvents::Create() {
  std::unique_ptr<GpuPlaneEvents> events(new GpuPlaneEvents());
  for (cudaEvent_t& event : events->step_) {
    RETURN_IF_ERROR(CudaStatus(cudaEventCreate(&event), "cudaEventCreate(step timing)"));
  }
  for (cudaEvent_t* event : {&events->fork_, &events->join_}) {
    RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
                               "cudaEventCreate(engine stream join)"));
  }
  return events;
}

GpuPlaneEvents::~GpuPlaneEvents() {
  for (cudaEvent_t event : {step_[0], step_[1], step_[2], step_[3], fork_, join_}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
}

absl::Status GpuPlaneEvents::Record(int i, cudaStream_t stream) {
  return CudaStatus(cudaEventRecord(step_[i], stream),
                    absl::StrCat("cudaEventRecord(step event ", i, ")"));
}

absl::StatusOr<float> GpuPlaneEvents::ElapsedMs(int from, int to) const {
  float ms = 0;
  RETURN_IF_ERROR(
      CudaStatus(cudaEventElapsedTime(&ms, step_[from], step_[to]),
                 absl::StrCat("cudaEventElapsedTime(step events ", from, ", ", to, ")")));
  return ms;
}

absl::Status GpuPlaneEvents::OnCallerStream(cudaStream_t caller, cudaStream_t own,
                                            const std::function<absl::Status()>& enqueue) {
  const bool fork = caller != own;
  if (fork) {
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(fork_, caller), "cudaEventRecord(caller stream)"));
    RETURN_IF_ERROR(CudaStatus(cudaStreamWaitEvent(own, fork_, 0), "cudaStreamWaitEvent"));
  }
  absl::Status status = enqueue();
  if (fork) {
    absl::Status joined =
        CudaStatus(cudaEventRecord(join_, own), "cudaEventRecord(dispatcher stream)");
    if (joined.ok()) {
      joined = CudaStatus(cudaStreamWaitEvent(caller, join_, 0), "cudaStreamWaitEvent");
    }
    if (status.ok()) status = joined;
  }
  return status;
}

}  // namespace moe_ep::kernels
