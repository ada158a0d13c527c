#pragma once

// What both GPU data planes' Benchmark and Forward share
// (server/gpu_data_plane.h, server/onesided_data_plane.h; issue 15 item 5),
// above kernels/step_staging.h (the step's device buffers): the timed
// Benchmark step over a dispatcher with identity experts (the loop is the
// core's: DataPlane::Benchmark), and the tail of a Forward step: its
// counters and phase times. Only on a CUDA build (MOE_EP_HAVE_CUDA). Not
// thread-safe. Source: DESIGN §10, §13.

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
#include "kernels/gpu_shared_experts.h"
#include "kernels/onesided/peer_window.h"
#include "kernels/plane_events.h"
#include "kernels/step_staging.h"
#include "server/data_plane.h"

namespace moe_ep::server {

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

// AddStepTimes()
//
// After the step's stream synchronised: the phase times of `stats` in whole
// microseconds (truncated) from `events`' four step events, recorded on the main stream
// before Dispatch, after Dispatch, before and after Combine: dispatch_us
// [0, 1], expert_us [1, 2], combine_us [2, 3]. With `shared` (not null: the
// layer has a shared expert) also shared_us and shared_overlap_us
// (kernels::GpuSharedExperts::Times against the dispatch events). Errors: kInternal
// (cudaEventElapsedTime), those of kernels::GpuSharedExperts::Times; `stats` may then
// be partly written.
absl::Status AddStepTimes(const kernels::GpuPlaneEvents& events,
                          const kernels::GpuSharedExperts* shared, core::StepStats* stats);

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
// NCCL dispatcher), identity experts, the plane's step events (`events`)
// around Dispatch and Combine, then `hooks.wait` (the plane's
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
                  std::unique_ptr<kernels::StepStaging> buffers, int64_t tokens,
                  kernels::GpuPlaneEvents* events, GpuBenchmarkHooks hooks)
      : windows_(std::move(windows)),
        dispatcher_(std::move(dispatcher)),
        identity_(std::move(identity)),
        buffers_(std::move(buffers)),
        tokens_(tokens),
        events_(events),
        hooks_(std::move(hooks)) {}

  absl::StatusOr<PhaseTimes> Step() override {
    cudaStream_t stream = dispatcher_->stream();
    const kernels::StepStaging& in = *buffers_;
    RETURN_IF_ERROR(events_->Record(0, stream));
    RETURN_IF_ERROR(dispatcher_->Dispatch(in.hidden(), in.topk_ids(), in.topk_weights(), tokens_));
    RETURN_IF_ERROR(events_->Record(1, stream));
    RETURN_IF_ERROR(dispatcher_->ComputeExperts(*identity_));
    RETURN_IF_ERROR(events_->Record(2, stream));
    RETURN_IF_ERROR(dispatcher_->Combine(in.output()));
    RETURN_IF_ERROR(events_->Record(3, stream));
    RETURN_IF_ERROR(hooks_.wait());
    ASSIGN_OR_RETURN(const float dispatch_ms, events_->ElapsedMs(0, 1));
    ASSIGN_OR_RETURN(const float combine_ms, events_->ElapsedMs(2, 3));
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
  std::unique_ptr<kernels::StepStaging> buffers_;
  int64_t tokens_;
  kernels::GpuPlaneEvents* events_;  // the plane's
  GpuBenchmarkHooks hooks_;
};

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
