#pragma once

// What both GPU data planes' Benchmark and Forward share
// (server/gpu_data_plane.h, server/onesided_data_plane.h; issue 15 item 5):
// one step's inputs and output on the device (both planes' Forward staging), the timed Benchmark
// step over a dispatcher with identity experts (the loop is the core's: DataPlane::Benchmark), and
// the tail of a Forward step: its counters and phase times. Only on a CUDA build
// (MOE_EP_HAVE_CUDA). Not thread-safe. Source: DESIGN §10, §13.

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include <array>
#include <concepts>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/time.h"
#include "core/collective.h"
#include "core/ep_contract.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "kernels/cuda_status.h"
#include "kernels/device_experts.h"
#include "kernels/onesided/peer_window.h"
#include "server/data_plane.h"
#include "server/gpu_shared_experts.h"

namespace moe_ep::server {

// StepStaging
//
// One step's inputs and output on the device, for N rows: Forward's staging
// on both GPU transports and the Benchmark step's buffers (one class, DESIGN
// §17; issue 34 item 1). One device block of four 128-byte-aligned parts:
// hidden [N, H] bf16, topk_ids [N, K] int32, topk_weights [N, K] fp32,
// output [N, H] bf16; allocated here, or bound to device memory the caller
// owns (the NCCL dispatcher's tail, so its workspace is one allocation).
// Optionally a pinned host mirror of the same four parts followed by a
// step's counts [2, kMaxEpSize] int32 (the NCCL plane's host copies, DESIGN
// §10). Frees what it allocated on destruction. Not thread-safe.
class StepStaging {
 public:
  struct Options {
    // Null: allocate the device block here (cudaMalloc on the current
    // device). Else Bytes() bytes of 128-byte-aligned device memory that
    // outlives this object (Rebind moves it).
    void* device = nullptr;
    bool pinned_host = false;  // also the pinned host mirror and counts
  };
  // Errors: kResourceExhausted (cudaMalloc / cudaMallocHost, with the
  // bytes), kInternal.
  static absl::StatusOr<std::unique_ptr<StepStaging>> Create(int64_t capacity, int64_t hidden,
                                                             int top_k, Options options);
  static absl::StatusOr<std::unique_ptr<StepStaging>> Create(int64_t capacity, int64_t hidden,
                                                             int top_k) {
    return Create(capacity, hidden, top_k, Options());
  }
  // The device block's bytes for these sizes:
  // 2 * AlignTo128(N * H * 2) + 2 * AlignTo128(N * K * 4).
  static int64_t Bytes(int64_t capacity, int64_t hidden, int top_k);
  ~StepStaging();
  StepStaging(const StepStaging&) = delete;
  StepStaging& operator=(const StepStaging&) = delete;

  // The device parts.
  uint16_t* hidden() const { return Part<uint16_t>(device_, 0); }
  int32_t* topk_ids() const { return Part<int32_t>(device_, 1); }
  float* topk_weights() const { return Part<float>(device_, 2); }
  uint16_t* output() const { return Part<uint16_t>(device_, 3); }
  // The pinned mirror's parts (null without Options::pinned_host).
  void* host_hidden() const { return Part<char>(host_, 0); }
  void* host_topk_ids() const { return Part<char>(host_, 1); }
  void* host_topk_weights() const { return Part<char>(host_, 2); }
  void* host_output() const { return Part<char>(host_, 3); }
  // Pinned [2, kMaxEpSize] int32 for a step's counts (null without the mirror).
  int32_t* host_counts() const;
  // Bytes() for this object's sizes (the device block, allocated here or not).
  int64_t bytes() const { return bytes_; }
  // Moves a bound device block to `device` (a grown dispatcher's tail);
  // nothing when the block was allocated here.
  void Rebind(void* device) {
    if (owned_device_ == nullptr) device_ = device;
  }

  // Enqueues on `stream` the copies of `num_tokens` rows of host inputs
  // ([T, H] bf16, [T, K] int32, [T, K] fp32; pageable: each call returns once
  // its bytes are staged). Errors: kInternal (CUDA), naming the tensor.
  absl::Status Upload(const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                      int64_t num_tokens, cudaStream_t stream) const;

 private:
  StepStaging() = default;
  template <typename T>
  T* Part(void* base, int i) const {
    return base == nullptr ? nullptr : reinterpret_cast<T*>(static_cast<char*>(base) + offsets_[i]);
  }
  std::array<int64_t, 4> offsets_ = {0, 0, 0, 0};
  int64_t bytes_ = 0;
  int64_t host_bytes_ = 0;
  int64_t hidden_size_ = 0;
  int top_k_ = 0;
  void* device_ = nullptr;
  void* owned_device_ = nullptr;  // device_ when Create allocated it
  void* host_ = nullptr;
};

// StepCountStats()
//
// The counters of one Forward step as core::EpDispatcher counts them, from
// the host copy of the dispatcher's step counts `counts` [2, members] int32:
// counts[d] token copies this rank sent to member d, counts[members + s]
// rows member s sent here. tokens_sent and tokens_received sum them;
// bytes_sent_remote adds, for every member but `self` (this rank's index
// among the members), sent * DispatchBytesPerToken(ws.dtype, ws.hidden,
// ws.top_k) + received * CombineBytesPerToken(ws.hidden).
// runtime_max_tokens_per_rank is `runtime_max` (the step's R); the phase
// times and the lost experts are left 0. Errors: those of
// core::DispatchBytesPerToken (kInvalidArgument). Pure.
// Example: members 2, self 0, counts {3, 4, 3, 5}, bf16 H 8 K 2 (dispatch 32,
// combine 16 bytes a token) -> sent 7, received 8, remote 4*32 + 5*16 = 208.
absl::StatusOr<core::StepStats> StepCountStats(const int32_t* counts, int members, int self,
                                               const core::WorkspaceSpec& ws, int64_t runtime_max);

// DeviceTokensSent()
//
// The token copies the last step on `stream` sent, summed from a
// dispatcher's device send counts `send_counts` [members] int32 (each token
// once per distinct destination rank, as core::ComputeDispatchRoute counts
// it): Benchmark reads the route the device took, as Forward does, instead
// of routing again on the host (issue 32 item 2). Waits for `stream`.
// Errors: kInternal (CUDA).
absl::StatusOr<int64_t> DeviceTokensSent(const int32_t* send_counts, int members,
                                         cudaStream_t stream);

// AddStepTimes()
//
// After the step's stream synchronised: the phase times of `stats` in whole
// microseconds (truncated) from `events` [4], recorded on the main stream
// before Dispatch, after Dispatch, before and after Combine: dispatch_us
// [0, 1], expert_us [1, 2], combine_us [2, 3]. With `shared` (not null: the
// layer has a shared expert) also shared_us and shared_overlap_us
// (GpuSharedExperts::Times against the dispatch events). Errors: kInternal
// (cudaEventElapsedTime), those of GpuSharedExperts::Times; `stats` may then
// be partly written.
absl::Status AddStepTimes(const cudaEvent_t events[4], const GpuSharedExperts* shared,
                          core::StepStats* stats);

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

// GpuBenchmarkRun
//
// Benchmark's scratch step on a GPU transport (DataPlane::MakeBenchmarkRun):
// `dispatcher` (geometry committed at R = tokens, inputs uploaded into
// `buffers`) over `windows` where it runs on peer windows (null for the
// NCCL dispatcher), identity experts, CUDA events (`events`, 4, the
// plane's) around Dispatch and Combine, then `hooks.wait` (the plane's
// bounded wait for the stream). Members go in reverse order: the
// dispatcher before the windows it stores into.
struct GpuBenchmarkHooks {
  std::function<absl::Status()> wait;                    // after each step's work is enqueued
  std::function<absl::StatusOr<int64_t>()> tokens_sent;  // the device's count of the last step
  std::function<absl::Status()> finish;                  // null: nothing (DataPlane's Finish)
};

template <StepPhases Dispatcher>
class GpuBenchmarkRun final : public BenchmarkRun {
 public:
  GpuBenchmarkRun(std::unique_ptr<kernels::onesided::PeerWindows> windows,
                  std::unique_ptr<Dispatcher> dispatcher,
                  std::unique_ptr<kernels::DeviceExpertSet> identity,
                  std::unique_ptr<StepStaging> buffers, int64_t tokens, cudaEvent_t* events,
                  GpuBenchmarkHooks hooks)
      : windows_(std::move(windows)),
        dispatcher_(std::move(dispatcher)),
        identity_(std::move(identity)),
        buffers_(std::move(buffers)),
        tokens_(tokens),
        events_(events),
        hooks_(std::move(hooks)) {}

  absl::StatusOr<PhaseTimes> Step() override {
    cudaStream_t stream = dispatcher_->stream();
    const StepStaging& in = *buffers_;
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(events_[0], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(dispatcher_->Dispatch(in.hidden(), in.topk_ids(), in.topk_weights(), tokens_));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(events_[1], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(dispatcher_->ComputeExperts(*identity_));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(events_[2], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(dispatcher_->Combine(in.output()));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventRecord(events_[3], stream), "cudaEventRecord"));
    RETURN_IF_ERROR(hooks_.wait());
    float dispatch_ms = 0;
    float combine_ms = 0;
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventElapsedTime(&dispatch_ms, events_[0], events_[1]),
                                        "cudaEventElapsedTime"));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaEventElapsedTime(&combine_ms, events_[2], events_[3]),
                                        "cudaEventElapsedTime"));
    PhaseTimes times;
    times.dispatch_us = dispatch_ms * 1000.0;
    times.combine_us = combine_ms * 1000.0;
    return times;
  }
  absl::StatusOr<int64_t> TokensSent() override { return hooks_.tokens_sent(); }
  absl::Status Finish() override { return hooks_.finish ? hooks_.finish() : absl::OkStatus(); }

 private:
  std::unique_ptr<kernels::onesided::PeerWindows> windows_;
  std::unique_ptr<Dispatcher> dispatcher_;
  std::unique_ptr<kernels::DeviceExpertSet> identity_;
  std::unique_ptr<StepStaging> buffers_;
  int64_t tokens_;
  cudaEvent_t* events_;
  GpuBenchmarkHooks hooks_;
};

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
