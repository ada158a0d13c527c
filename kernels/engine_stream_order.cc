#include "kernels/engine_stream_order.h"

#include "core/status_macros.h"
#include "kernels/cuda_status.h"

namespace moe_ep::kernels {

absl::StatusOr<std::unique_ptr<EngineStreamOrder>> EngineStreamOrder::Create(cudaStream_t own) {
  std::unique_ptr<EngineStreamOrder> order(new EngineStreamOrder());
  order->own_ = own;
  for (cudaEvent_t* event : {&order->fork_, &order->join_}) {
    RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(event, cudaEventDisableTiming),
                               "cudaEventCreate(engine stream order)"));
  }
  return order;
}

EngineStreamOrder::~EngineStreamOrder() {
  for (cudaEvent_t event : {fork_, join_}) {
    if (event != nullptr) cudaEventDestroy(event);
  }
}

absl::StatusOr<cudaStream_t> EngineStreamOrder::Begin(cudaStream_t caller) {
  if (mode_ != Mode::kNone) {
    return absl::FailedPreconditionError("EngineStreamOrder::Begin: an engine call is open");
  }
  if (caller == own_) {
    RETURN_IF_ERROR(Settle());
    return own_;
  }
  // The legacy stream is never captured: no query for it.
  const bool legacy = caller == nullptr || caller == cudaStreamLegacy;
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (!legacy) {
    RETURN_IF_ERROR(CudaStatus(cudaStreamIsCapturing(caller, &capture),
                               "cudaStreamIsCapturing(engine stream)"));
  }
  if (capture != cudaStreamCaptureStatusNone) {
    open_ = caller;
    mode_ = Mode::kCaptured;
    return caller;
  }
  if (legacy || caller == cudaStreamPerThread) {
    // A default stream (torch's unless the engine sets one): launches into
    // the legacy stream cost more on the host than the fork and join
    // (bench/results/engine-host call 3), so the call forks onto the own
    // stream and joins back.
    RETURN_IF_ERROR(Settle());
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(fork_, caller), "cudaEventRecord(engine stream)"));
    RETURN_IF_ERROR(
        CudaStatus(cudaStreamWaitEvent(own_, fork_, 0), "cudaStreamWaitEvent(own stream)"));
    open_ = caller;
    mode_ = Mode::kForked;
    return own_;
  }
  unsigned long long id = 0;  // NOLINT(google-runtime-int)
  RETURN_IF_ERROR(CudaStatus(cudaStreamGetId(caller, &id), "cudaStreamGetId(engine stream)"));
  if (tail_ == nullptr) {
    // The own stream holds the latest work.
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(fork_, own_), "cudaEventRecord(own stream)"));
    RETURN_IF_ERROR(
        CudaStatus(cudaStreamWaitEvent(caller, fork_, 0), "cudaStreamWaitEvent(engine stream)"));
  } else if (tail_ != caller || tail_id_ != id) {
    // Another engine stream does: join_ marks its end.
    RETURN_IF_ERROR(
        CudaStatus(cudaStreamWaitEvent(caller, join_, 0), "cudaStreamWaitEvent(engine stream)"));
  }
  open_ = caller;
  mode_ = Mode::kDirect;
  tail_id_ = id;
  return caller;
}

absl::Status EngineStreamOrder::End() {
  if (mode_ == Mode::kNone) return absl::OkStatus();
  const cudaStream_t caller = open_;
  const Mode mode = mode_;
  open_ = nullptr;
  mode_ = Mode::kNone;
  if (mode == Mode::kCaptured) return absl::OkStatus();
  if (mode == Mode::kForked) {
    // The own stream holds the latest work (tail_ stays null).
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(join_, own_), "cudaEventRecord(own stream)"));
    return CudaStatus(cudaStreamWaitEvent(caller, join_, 0), "cudaStreamWaitEvent(engine stream)");
  }
  // No tail until the record succeeds (a failed record means a broken
  // context, which the next CUDA call reports).
  tail_ = nullptr;
  RETURN_IF_ERROR(CudaStatus(cudaEventRecord(join_, caller), "cudaEventRecord(engine stream)"));
  tail_ = caller;
  return absl::OkStatus();
}

absl::Status EngineStreamOrder::Settle() {
  if (tail_ == nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamWaitEvent(own_, join_, 0), "cudaStreamWaitEvent(own stream)"));
  tail_ = nullptr;
  return absl::OkStatus();
}

}  // namespace moe_ep::kernels
