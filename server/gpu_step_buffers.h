#pragma once

// What both GPU data planes' Benchmark and the one-sided plane's Forward
// share (server/gpu_data_plane.h, server/onesided_data_plane.h; issue 15
// item 5): device buffers of one step's inputs and output, and the timed
// Benchmark loop over a dispatcher with identity experts. Only on a CUDA
// build (MOE_EP_HAVE_CUDA). Not thread-safe. Source: DESIGN §10, §13.

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/collective.h"
#include "core/status_macros.h"
#include "kernels/device_experts.h"
#include "server/call_gate.h"
#include "server/data_plane.h"

namespace moe_ep::server {

// One cudaMalloc on the current device of four 128-byte-aligned parts for
// N rows: hidden [N, H] bf16, topk_ids [N, K] int32, topk_weights [N, K]
// fp32, output [N, H] bf16. Freed on destruction.
class DeviceStepBuffers {
 public:
  // Errors: kResourceExhausted (cudaMalloc), kInternal.
  static absl::StatusOr<std::unique_ptr<DeviceStepBuffers>> Create(int64_t capacity, int64_t hidden,
                                                                   int top_k);
  // What Create allocates for these sizes.
  static int64_t Bytes(int64_t capacity, int64_t hidden, int top_k);
  ~DeviceStepBuffers();
  DeviceStepBuffers(const DeviceStepBuffers&) = delete;
  DeviceStepBuffers& operator=(const DeviceStepBuffers&) = delete;

  uint16_t* hidden() const { return hidden_; }
  int32_t* topk_ids() const { return ids_; }
  float* topk_weights() const { return weights_; }
  uint16_t* output() const { return output_; }
  int64_t bytes() const { return bytes_; }

  // Enqueues on `stream` the copies of `num_tokens` rows of host inputs
  // ([T, H] bf16, [T, K] int32, [T, K] fp32; pageable: each call returns once
  // its bytes are staged). Errors: kInternal (CUDA), naming the tensor.
  absl::Status Upload(const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                      int64_t num_tokens, cudaStream_t stream) const;

 private:
  DeviceStepBuffers() = default;
  char* base_ = nullptr;
  uint16_t* hidden_ = nullptr;
  int32_t* ids_ = nullptr;
  float* weights_ = nullptr;
  uint16_t* output_ = nullptr;
  int64_t bytes_ = 0;
  int64_t hidden_size_ = 0;
  int top_k_ = 0;
};

// The three phases a timed step calls, on stream(): what GpuEpDispatcher
// and OneSidedDispatcher both offer.
template <typename Dispatcher>
concept StepPhases = requires(Dispatcher& d, const uint16_t* h, const int32_t* i, const float* w,
                              const kernels::DeviceExpertSet& e, uint16_t* o) {
  { d.Dispatch(h, i, w, int64_t{0}) } -> std::same_as<absl::Status>;
  { d.ComputeExperts(e) } -> std::same_as<absl::Status>;
  { d.Combine(o) } -> std::same_as<absl::Status>;
  { d.stream() } -> std::same_as<cudaStream_t>;
};

// TimeIdentitySteps()
//
// The Benchmark loop of both GPU planes: `warmup + iterations` steps of
// `tokens` rows from `in` (uploaded already) on `dispatcher` (geometry
// committed at R = tokens), each entered through a call gate
// (server/call_gate.h) on `control` with `call`, then CUDA events (`events`, 4) around
// Dispatch and Combine, then `wait` (the plane's bounded wait for the
// stream). Returns the timed iterations' microseconds. Errors: those of
// the gate, the phases and `wait`; kInternal (CUDA events).
template <StepPhases Dispatcher>
absl::StatusOr<BenchmarkTimes> TimeIdentitySteps(
    Dispatcher& dispatcher, const kernels::DeviceExpertSet& identity, const DeviceStepBuffers& in,
    int64_t tokens, int warmup, int iterations, core::ControlCollective& control,
    const CallBound& call, cudaEvent_t events[4], const std::function<absl::Status()>& wait) {
  auto cuda = [](cudaError_t e, const char* what) {
    return e == cudaSuccess ? absl::OkStatus()
                            : absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
  };
  cudaStream_t stream = dispatcher.stream();
  BenchmarkTimes times;
  for (int i = 0; i < warmup + iterations; ++i) {
    RETURN_IF_ERROR(
        CallGate(control, call, BenchmarkGatePoint(i, warmup + iterations), kBenchmarkStopHint));
    RETURN_IF_ERROR(cuda(cudaEventRecord(events[0], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(dispatcher.Dispatch(in.hidden(), in.topk_ids(), in.topk_weights(), tokens));
    RETURN_IF_ERROR(cuda(cudaEventRecord(events[1], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(dispatcher.ComputeExperts(identity));
    RETURN_IF_ERROR(cuda(cudaEventRecord(events[2], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(dispatcher.Combine(in.output()));
    RETURN_IF_ERROR(cuda(cudaEventRecord(events[3], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(wait());
    if (i < warmup) continue;
    float dispatch_ms = 0;
    float combine_ms = 0;
    RETURN_IF_ERROR(
        cuda(cudaEventElapsedTime(&dispatch_ms, events[0], events[1]), "cudaEventElapsedTime"));
    RETURN_IF_ERROR(
        cuda(cudaEventElapsedTime(&combine_ms, events[2], events[3]), "cudaEventElapsedTime"));
    times.dispatch_us.push_back(dispatch_ms * 1000.0);
    times.combine_us.push_back(combine_ms * 1000.0);
  }
  return times;
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
