#include "server/gpu_plane_events.h"

#ifdef MOE_EP_HAVE_CUDA

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda_status.h"
#include "kernels/nccl_collective.h"

namespace moe_ep::server {

using kernels::CudaStatus;

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

absl::Status CheckEngineDevicePointers(
    const char* call, absl::string_view plane, int device,
    std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  for (const auto& [name, ptr] : ptrs) {
    if (ptr != nullptr && !kernels::IsDevicePointer(ptr)) {
      return absl::InvalidArgumentError(absl::StrCat(call, ": ", name,
                                                     " is not device memory; the ", plane,
                                                     " data plane takes device pointers "
                                                     "(CUDA device ",
                                                     device, ")"));
    }
  }
  return absl::OkStatus();
}

kernels::UnpackReceivedParams EngineUnpackParams(const core::EpDispatcherOptions& options,
                                                 const EngineRecvBuffers& out, const uint8_t* recv,
                                                 int64_t runtime_max, int first_expert,
                                                 int num_local_experts) {
  kernels::UnpackReceivedParams p;
  p.recv = recv;
  p.runtime_max = runtime_max;
  p.rows = out.rows;
  p.hidden_size = options.workspace.hidden;
  p.top_k = options.workspace.top_k;
  p.ep_size = options.workspace.ep_size;
  p.first_expert = first_expert;
  p.num_local_experts = num_local_experts;
  p.invalid_expert_id = options.invalid_expert_id;
  p.hidden = reinterpret_cast<uint16_t*>(out.hidden);
  p.topk_ids = out.topk_ids;
  p.topk_weights = out.topk_weights;
  p.source_counts = out.source_counts;
  p.expert_counts = out.expert_counts;
  return p;
}

absl::Status EnqueueExpertOutputsPack(const void* expert_out, int64_t rows, void* dst,
                                      int64_t runtime_max, int64_t hidden, int ep_size,
                                      cudaStream_t stream) {
  const int64_t row_bytes = hidden * 2;
  return CudaStatus(
      cudaMemcpy2DAsync(dst, runtime_max * row_bytes, expert_out, rows * row_bytes,
                        runtime_max * row_bytes, ep_size, cudaMemcpyDeviceToDevice, stream),
      "cudaMemcpy2DAsync(expert outputs)");
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
