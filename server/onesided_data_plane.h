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
// time-slice a shared GPU): the message's bytes are read in place where
// aligned (server/host_forward.h); Forward all-gathers every rank's {epoch, R, ready} on
// the host first (so that a rank whose step cannot start makes every rank
// fail at once with kAborted, and no kernel waits for it), copies the
// inputs to device staging, runs Dispatch -> ComputeExperts -> Combine on
// the dispatcher's stream with CUDA events between the phases, and waits
// with the dispatcher's CheckStep (bounded by the group timeout: a dead
// peer is kDeadlineExceeded naming it). Counters come from the
// dispatcher's device counts; load statistics are counted on the host from
// the request's ids (core::CountExpertTokens), keyed by (epoch, mask round)
// like the CPU plane's (PlacementBook::AddLoad: a step resent after a mask
// counts once).
//
// Placement tables and rank masks (DESIGN §15; issue 17 item 5): the
// dispatcher routes by the contiguous placement, so Forward maps every
// choice on the host to the replica the CPU reference picks and that
// replica to the dispatcher's id space (server/onesided_route_map.h: a
// dispatch id names a rank's local slot, so any table is served, EPLB's
// output included; DESIGN §17), and the layer's expert set answers to its
// slots' dispatch ids (kernels::DeviceExpertSet::Renumber); the dispatcher
// is made again (over the same windows) when a table or a mask changes
// that space.
// After a group error the survivors agree on a mask exactly as the CPU
// plane does (server/rank_mask.h: the round over every rank's Rendezvous
// service, a fresh Gloo context of the members); the old dispatcher and
// windows are dropped then (the dead peer's window is unmapped, never
// touched again: no kernel of this plane runs while the mask is agreed),
// and the members' windows are made at their next Forward or Allocate (an
// all-gather of IPC handles over the members' group, which every member
// enters in the same call: WorkerService aligns calls after a round).
// Choices of experts with no live replica are sent nowhere and reported.
// A restarted rank forms a plane of itself alone and Readmit takes it back,
// as on the CPU plane.
//
// The engine's in-process calls (server/moe_ep.h, DESIGN §14; issue 34
// item 2): dispatch, combine and forward on the engine's device buffers and
// stream, with no host agreement and nothing that syncs the host, so they
// can be captured in the engine's CUDA graph (the (epoch, R) agreement rides
// in the dispatch flags; EngineCheckStep reports it). They route by the
// contiguous placement of all ranks (the engine's ids are the dispatcher's):
// under a rank mask, or for a layer whose installed table is another one,
// they fail with kFailedPrecondition naming it (the Forward RPC serves any
// table). sync_token_counts agrees on the host (the group's Gloo
// collective): it syncs the caller's stream and cannot be captured.
// Benchmark: scratch windows and a dispatcher of the benchmark's size,
// identity experts, as the NCCL plane (server/gpu_step_buffers.h).
// Every call makes the group's device current. Not thread-safe.
// Source: DESIGN §6-§8, §13; issue 15.

#ifdef MOE_EP_HAVE_CUDA

#include <cuda_runtime.h>

#include <functional>
#include <initializer_list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/gloo_collective.h"
#include "kernels/device_calls.h"
#include "kernels/device_experts.h"
#include "kernels/gpu_shared_experts.h"
#include "kernels/onesided/onesided_dispatcher.h"
#include "kernels/onesided/peer_window.h"
#include "kernels/plane_events.h"
#include "server/data_plane.h"
#include "server/gpu_step_buffers.h"
#include "server/onesided_route_map.h"
#include "server/rank_mask.h"

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
  // Gloo collective; ProbeOneSidedPlane said true). With group.rejoin (and
  // world > 1) `control` is a group of this rank alone and every other rank
  // is masked until Readmit. No window exists until Allocate. Errors:
  // kInternal (CUDA), kInvalidArgument (control's size does not fit).
  static absl::StatusOr<std::unique_ptr<OneSidedDataPlane>> Form(
      const DataPlaneGroup& group, std::unique_ptr<core::GlooCollective> control);
  ~OneSidedDataPlane() override;

  // The GPU backend ("nccl" in Join's terms); its data plane is one-sided
  // (PlaneKind::kOneSided).
  // collective(): the group as formed, or after a mask the members' group
  // in the original numbering (core/masked_collective.h).
  // Rank masks (server/data_plane.h), as CpuDataPlane: with every rank's
  // Rendezvous address and more than one rank; FinishMaskRound and Readmit
  // drop the dispatcher and the windows on the caller's thread and mask
  // every layer's table (UseAgreement).

  // Collective: a barrier (no peer still uses the old windows), then new
  // windows (IPC handles all-gathered) and a dispatcher. The options are
  // checked (and the cap) before anything is dropped; after a failure past
  // that point the plane has no workspace (Allocate again).
  absl::StatusOr<DataPlaneAllocation> Allocate(const core::EpDispatcherOptions& options,
                                               int64_t max_intermediate,
                                               int64_t memory_cap_bytes) override;
  absl::StatusOr<int64_t> LoadExperts(int layer, const core::ExpertSource& source,
                                      int64_t memory_cap_bytes) override;
  // Checks `table` (core::ValidatePlacement; any set of experts a rank)
  // and installs it; a layer's experts that are not this rank's new
  // distinct slot experts are dropped (LoadExperts again), as on the CPU
  // plane.
  absl::Status InstallPlacement(int layer,
                                std::shared_ptr<const core::PlacementTable> table) override;
  // The engine's calls (see the header comment; server/data_plane.h for
  // shapes). Errors as the NCCL plane's (server/gpu_engine_calls.cc), and
  // kFailedPrecondition under a rank mask or another layer table.
  absl::StatusOr<core::StepStats> EngineDispatch(const void* hidden, const int32_t* topk_ids,
                                                 const float* topk_weights, int64_t num_tokens,
                                                 const EngineRecvBuffers& out,
                                                 void* stream) override;
  absl::StatusOr<core::StepStats> EngineCombine(const void* expert_out, int64_t rows, void* output,
                                                void* stream) override;
  absl::StatusOr<core::StepStats> EngineForward(int layer, const void* hidden,
                                                const int32_t* topk_ids, const float* topk_weights,
                                                int64_t num_tokens, void* output,
                                                void* stream) override;
  absl::StatusOr<EngineRecvBuffers> EngineReceiveBuffers() override;
  absl::Status EngineSyncTokenCounts(const int64_t* local_tokens, int64_t* counts,
                                     void* stream) override;

 private:
  OneSidedDataPlane();
  absl::Status MakeDeviceCurrent() const;
  // Forward (server/data_plane.h): the host tensors of `io`
  // (server/host_forward.h), uploaded by StepOnHost; a rank whose checks
  // fail still reaches the step agreement, so no peer waits on it.
  absl::StatusOr<core::StepStats> RunForward(int layer, const HostForward& io,
                                             int64_t num_tokens) override;
  absl::StatusOr<core::StepStats> StepOnHost(int layer, absl::Span<const core::bf16_t> hidden,
                                             absl::Span<const int32_t> topk_ids,
                                             absl::Span<const float> topk_weights,
                                             int64_t num_tokens, absl::Span<core::bf16_t> output);
  kernels::onesided::OneSidedDispatcherOptions DispatcherOptions(
      const core::EpDispatcherOptions& options, int64_t max_intermediate) const;
  // The host agreement before a step's kernels (see the header comment):
  // every member's {epoch, R, ready, route map fingerprint}.
  absl::Status AgreeOnStep(const absl::Status& local, uint64_t route);
  // Windows for the members (a collective over compact_) when a mask or
  // Readmit dropped them; a no-op otherwise.
  absl::Status MakeWindowsIfDropped();
  // A dispatcher over windows_ whose id space is `map`'s (a new one when it
  // differs; the committed geometry carried over).
  absl::Status UseRouteMap(const OneSidedRouteMap& map);
  // The engine calls' checks: a workspace, no rank mask, the dispatcher on
  // the contiguous placement of all ranks (made again when a Forward RPC
  // left another id space), the device current, and every non-null pointer
  // in `ptrs` device memory (kInvalidArgument naming it).
  // Runs an engine call's `enqueue` with the dispatcher's engine-call
  // window open on the caller's `stream` (OneSidedDispatcher::
  // BeginEngineCall: no fork and join per call); `enqueue` gets the stream
  // to put its own kernels on. The window closes on error too.
  absl::Status OnEngineStream(void* stream,
                              const std::function<absl::Status(cudaStream_t)>& enqueue);
  // RequireEngineCall less the device-pointer check: the plane can serve
  // an engine call (workspace, no mask, device current, the engine's route
  // map). Dispatch checks its pointers itself, so it can refuse the step.
  absl::Status RequireEnginePlane(const char* call);
  absl::Status RequireEngineCall(const char* call,
                                 std::initializer_list<std::pair<const char*, const void*>> ptrs);
  // The route map of the contiguous placement of all ranks (the engine
  // calls' ids), made once for each allocation's table.
  const OneSidedRouteMap& EngineMap();
  // Benchmark's scratch step (DataPlane::MakeBenchmarkRun): identity
  // experts, scratch device buffers and a dispatcher of the benchmark's
  // size over scratch IPC windows; every rank (kFailedPrecondition
  // under a rank mask).
  absl::StatusOr<std::unique_ptr<BenchmarkRun>> MakeBenchmarkRun(
      const core::EpDispatcherOptions& options, const BenchmarkInputs& inputs,
      int64_t memory_cap_bytes, const std::string& plane) override;
  absl::StatusOr<int64_t> HoldSharedExpert(int layer, std::optional<core::SharedExpert> shared,
                                           int64_t others_bytes, int64_t memory_cap_bytes) override;
  // Serves on the members of `agreed` (round `agreed_round`).
  absl::Status UseAgreement(MaskAgreement agreed, int agreed_round) override;
  // Gives the core dispatcher_ and the staging's bytes (UseDispatcher):
  // called after either changes.
  void ServeDispatcher();

  // The core's control_ (destroyed after everything here) owns compact_
  // (the members' Gloo group, numbered among the members).
  core::GlooCollective* compact_ = nullptr;
  int64_t dispatcher_cap_ = 0;    // the memory cap the dispatcher was made under (0 none)
  bool windows_dropped_ = false;  // a mask dropped them: made at the next Forward
  int dispatch_ep_ = 0;           // the dispatcher's ranks and ids (UseRouteMap)
  int dispatch_experts_ = 0;
  std::unique_ptr<kernels::onesided::PeerWindows> windows_;
  std::unique_ptr<kernels::onesided::OneSidedDispatcher> dispatcher_;
  std::unique_ptr<kernels::StepStaging> staging_;
  kernels::PinnedHostMemory host_counts_;            // int32 [2, E]: send, receive counts of a step
  std::unique_ptr<kernels::GpuPlaneEvents> events_;  // step timing, engine stream fork / join
  kernels::DevicePointerCache device_pointers_;      // the engine calls' checked buffers
  std::shared_ptr<const core::PlacementTable> engine_map_table_;  // EngineMap()'s table
  OneSidedRouteMap engine_map_;
  kernels::GpuSharedExperts shared_;  // last: destroyed first, on the current device
};

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
