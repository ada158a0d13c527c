#pragma once

// What both GPU transports (server/gpu_data_plane.h, server/onesided_data_plane.h)
// keep around their dispatcher's stream, written once (issue 34 item 1):
// the four timing events of a step (AddStepTimes, the Benchmark loop), the
// fork from and join back to an engine's stream, and the engine calls'
// device checks and unpack parameters.

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <memory>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "core/ep_dispatcher.h"
#include "kernels/engine_rows.cuh"
#include "server/data_plane.h"

namespace moe_ep::server {

// The events of one GPU transport. Create and destroy on the transport's
// device (each plane makes it current first). Thread-compatible: the
// plane's calls are serialised by the service.
class GpuPlaneEvents {
 public:
  // Four timing events and two untimed ones on the current device.
  // Errors: kInternal (cudaEventCreate).
  static absl::StatusOr<std::unique_ptr<GpuPlaneEvents>> Create();
  ~GpuPlaneEvents();
  GpuPlaneEvents(const GpuPlaneEvents&) = delete;
  GpuPlaneEvents& operator=(const GpuPlaneEvents&) = delete;

  // [4], recorded on the step's stream before Dispatch, after Dispatch,
  // before and after Combine (server/gpu_step_buffers.h AddStepTimes).
  cudaEvent_t* step() { return step_; }

  // Runs `enqueue` (work on `own`) ordered after the work already on
  // `caller` and joins it back into `caller` (an event each way; a CUDA
  // graph capture of `caller` follows both). The join happens on error too,
  // so a capture of `caller` can always end. Nothing is forked when
  // `caller` is `own`. Errors: `enqueue`'s, else kInternal (CUDA).
  absl::Status OnCallerStream(cudaStream_t caller, cudaStream_t own,
                              const std::function<absl::Status()>& enqueue);

 private:
  GpuPlaneEvents() = default;

  cudaEvent_t step_[4] = {nullptr, nullptr, nullptr, nullptr};
  cudaEvent_t fork_ = nullptr;  // caller's stream -> `own`
  cudaEvent_t join_ = nullptr;  // and back
};

// CheckEngineDevicePointers()
//
// Every non-null pointer of `ptrs` (name, pointer) is device memory: the
// GPU planes' engine calls take device pointers on `device`.
// Errors: kInvalidArgument naming the call, the pointer, `plane` and `device`.
absl::Status CheckEngineDevicePointers(
    const char* call, absl::string_view plane, int device,
    std::initializer_list<std::pair<const char*, const void*>> ptrs);

// EngineUnpackParams()
//
// The unpack of a dispatch's receive region `recv` (R = `runtime_max`) into
// the caller's `out`, for the rank holding experts [first_expert,
// first_expert + num_local_experts) of a workspace of `options`
// (kernels/engine_rows.cuh LaunchUnpackReceived). Pure.
kernels::UnpackReceivedParams EngineUnpackParams(const core::EpDispatcherOptions& options,
                                                 const EngineRecvBuffers& out, const uint8_t* recv,
                                                 int64_t runtime_max, int first_expert,
                                                 int num_local_experts);

// EnqueueExpertOutputsPack()
//
// Enqueues on `stream` the copy of an engine's expert outputs [E, rows, H]
// bf16 at `expert_out` into [E, R, H] at `dst` (R = `runtime_max` <= rows;
// what a combine sends). Errors: kInternal (cudaMemcpy2DAsync).
absl::Status EnqueueExpertOutputsPack(const void* expert_out, int64_t rows, void* dst,
                                      int64_t runtime_max, int64_t hidden, int ep_size,
                                      cudaStream_t stream);

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
