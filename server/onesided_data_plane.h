#pragma once

// The one-sided GPU data plane of the worker service (server/data_plane.h;
// DESIGN §13; issue 15 item 5): kernels::onesided::OneSidedDispatcher over
// CUDA IPC peer windows (kernels/onesided/peer_window.h
// CreateIpcPeerWindows), so the worker processes of a group may share one
// GPU (NCCL refuses two ranks on one device) or sit on distinct GPUs of one
// host that can reach each other peer to peer. The host-side collective
// (SyncTokenCounts, votes, Benchmark gates, the IPC handles' all-gather) is
// Gloo over TCP, formed through the generation's Rendezvous store under
// "gen<generation>/gpu".
//
// Forward (the gRPC path, a correctness path: processes without MPS
// time-slice a shared GPU): the default ForwardBytes decodes the message
// into host vectors; Forward all-gathers every rank's {epoch, R, ready} on
// the host first (so that a rank whose step cannot start makes every rank
// fail at once with kAborted, and no kernel waits for it), copies the
// inputs to device staging, runs Dispatch -> ComputeExperts -> Combine on
// the dispatcher's stream with CUDA events between the phases, and waits
// with the dispatcher's CheckStep (bounded by the group timeout: a dead
// peer is kDeadlineExceeded naming it, and the plane is broken). Counters
// come from the dispatcher's device counts; load statistics are counted on
// the host from the request's ids (core::CountExpertTokens).
//
// What it does not do (refused by name): placement tables other than the
// contiguous one (kFailedPrecondition: use gpu_data_plane "nccl"), the
// engine's in-process calls (kUnimplemented), rank masks.
// Benchmark: scratch windows and a dispatcher of the benchmark's size,
// identity experts, as the NCCL plane (server/gpu_step_buffers.h).
// Every call makes the group's device current. Not thread-safe.
// Source: DESIGN §6-§8, §13; issue 15.

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/gloo_collective.h"
#include "kernels/device_experts.h"
#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/onesided/peer_window.h"
#include "server/data_plane.h"
#include "server/gpu_shared_experts.h"
#include "server/gpu_step_buffers.h"
#include "server/placement_book.h"

namespace moe_ep::server {

// ProbeOneSidedPlane()
//
// Whether the one-sided plane works for the group of `control` (a
// collective: every rank calls it): every rank all-gathers its host (the
// kernel's boot id and the host name), its process id and its device's PCI
// bus id; true when every rank is a distinct process on this host and each
// rank's device can access every other rank's distinct device peer to peer. Every rank returns the
// same answer and, when false, the same reason in *why. Errors: the collective's, kInternal (CUDA).
absl::StatusOr<bool> ProbeOneSidedPlane(core::ControlCollective& control, int device,
                                        std::string* why);

class OneSidedDataPlane final : public DataPlane {
 public:
  // Forms the plane of `group` on group.device over `control` (the group's
  // Gloo collective; ProbeOneSidedPlane said true). No window exists until
  // Allocate. Errors: kInternal (CUDA).
  static absl::StatusOr<std::unique_ptr<OneSidedDataPlane>> Form(
      const DataPlaneGroup& group, std::unique_ptr<core::GlooCollective> control);
  ~OneSidedDataPlane() override;

  // The GPU backend ("nccl" in Join's terms); its data plane is one-sided.
  std::string backend() const override { return "nccl"; }
  std::string data_plane() const override { return "one-sided"; }
  const core::BackendLimits& limits() const override {
    return kernels::onesided::OneSidedDispatcher::kLimits;
  }
  core::ControlCollective& collective() override { return *control_; }
  void SetCall(const CallBound& call) override {
    call_ = call;
    control_->SetCallDeadline(CollectiveDeadline(call));
  }
  int cuda_device() const override { return device_; }

  // Collective: a barrier (no peer still uses the old windows), then new
  // windows (IPC handles all-gathered) and a dispatcher. The options are
  // checked (and the cap) before anything is dropped; after a failure past
  // that point the plane has no workspace (Allocate again).
  absl::StatusOr<DataPlaneAllocation> Allocate(const core::EpDispatcherOptions& options,
                                               int64_t max_intermediate,
                                               int64_t memory_cap_bytes) override;
  int64_t allocated_bytes() const override;
  absl::StatusOr<int64_t> LoadExperts(int layer, const core::ExpertSource& source,
                                      int64_t memory_cap_bytes) override;
  bool HasExperts(int layer) const override { return experts_.contains(layer); }
  int64_t ExpertBytes(int layer) const override;
  absl::StatusOr<int64_t> LoadSharedExpert(int layer, std::optional<core::SharedExpert> shared,
                                           int64_t memory_cap_bytes) override;
  int64_t SharedExpertBytes(int layer) const override { return shared_.Bytes(layer); }
  // Only the contiguous table (a no-op); any other is kFailedPrecondition.
  absl::Status InstallPlacement(int layer,
                                std::shared_ptr<const core::PlacementTable> table) override;
  std::shared_ptr<const core::PlacementTable> Placement(int layer) const override {
    return book_.Placement(layer);
  }
  absl::StatusOr<core::ExpertLoadCounts> ReadExpertLoad(int layer, bool reset) override {
    return book_.ReadExpertLoad(layer, reset);
  }
  std::vector<int64_t> ExpertTokenTotals(int layer) const override {
    return book_.ExpertTokenTotals(layer);
  }
  absl::StatusOr<std::vector<int64_t>> SyncTokenCounts(int64_t local_tokens) override;
  absl::Status CommitGeometry(int64_t epoch, int64_t runtime_max_tokens_per_rank,
                              int64_t local_tokens) override;
  int64_t epoch() const override { return dispatcher_ ? dispatcher_->epoch() : -1; }
  absl::StatusOr<core::StepStats> Forward(int layer, absl::Span<const core::bf16_t> hidden,
                                          absl::Span<const int32_t> topk_ids,
                                          absl::Span<const float> topk_weights, int64_t num_tokens,
                                          absl::Span<core::bf16_t> output) override;
  // data_plane "" or "one-sided" only.
  absl::StatusOr<BenchmarkTimes> Benchmark(const core::EpDispatcherOptions& options,
                                           const BenchmarkInputs& inputs, int warmup,
                                           int iterations, int64_t memory_cap_bytes,
                                           const std::string& data_plane) override;

 private:
  OneSidedDataPlane() = default;
  absl::Status MakeDeviceCurrent() const;
  kernels::onesided::OneSidedDispatcherOptions DispatcherOptions(
      const core::EpDispatcherOptions& options, int64_t max_intermediate) const;
  // The host agreement before a step's kernels (see the header comment).
  absl::Status AgreeOnStep(const absl::Status& local);
  int64_t TotalExpertBytes() const;

  // Declared first: everything below uses the collective.
  std::unique_ptr<core::GlooCollective> control_;
  CallBound call_;  // the call now running (SetCall; Benchmark's gates read it)
  int device_ = 0;
  int rank_ = 0;
  int world_ = 1;
  absl::Duration timeout_ = absl::Seconds(30);
  core::EpDispatcherOptions options_;
  int64_t max_intermediate_ = 0;
  bool geometry_committed_ = false;
  std::unique_ptr<kernels::onesided::PeerWindows> windows_;
  std::unique_ptr<kernels::onesided::OneSidedDispatcher> dispatcher_;
  std::unique_ptr<DeviceStepBuffers> staging_;
  int32_t* host_counts_ = nullptr;  // pinned [2, E]: send, receive counts of a step
  std::map<int, std::unique_ptr<kernels::DeviceExpertSet>> experts_;
  cudaEvent_t events_[4] = {nullptr, nullptr, nullptr, nullptr};
  PlacementBook book_;
  GpuSharedExperts shared_;  // last: destroyed first, on the current device
};

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
