#pragma once

// What both GPU transports (server/gpu_data_plane.h,
// server/onesided_data_plane.h) keep around their dispatcher's stream,
// written once (issue 34 items 1 and 3: CUDA calls live in kernels/): the
// four timing events of a step (server/gpu_step_buffers.h AddStepTimes, the
// Benchmark loop) and the fork from and join back to an engine's stream.
// Only on a CUDA build. Source: DESIGN §14, §17.

#include <cuda_runtime.h>

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe_ep::kernels {

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
  const cudaEvent_t* step() const { return step_; }

  // Records step event `i` (0..3, as step()) on `stream`.
  // Errors: kInternal "cudaEventRecord(step event <i>): ...".
  absl::Status Record(int i, cudaStream_t stream);
  // Milliseconds from step event `from` to step event `to`, both recorded
  // and complete. Errors: kInternal (not recorded, not complete).
  absl::StatusOr<float> ElapsedMs(int from, int to) const;

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

}  // namespace moe_ep::kernels
