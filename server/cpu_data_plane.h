#pragma once

// The CPU data plane (server/data_plane.h): Gloo over TCP and
// core::EpDispatcher on host memory, experts as core::ExpertSet
// (materialised from LoadExperts' core::ExpertSource). The backend
// of CPU-only machines, CI and the embedded default (DESIGN §1, §8).
// Not thread-safe. Source: DESIGN §6, §7; issue 2.

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/engine_call_round.h"
#include "core/ep_dispatcher.h"
#include "core/expert_source.h"
#include "core/experts.h"
#include "core/gloo_collective.h"
#include "server/call_gate.h"
#include "server/data_plane.h"
#include "server/rank_mask.h"

namespace moe_ep::server {

class CpuDataPlane final : public DataPlane {
 public:
  // Forms the Gloo group (group.plane must be kGloo; group.device is
  // ignored); with group.rejoin, a group of this rank alone on `store` (an
  // in-process one), every other rank masked, until Readmit. Errors: those
  // of core::GlooCollective::Create, prefixed with "Join (rank r of n,
  // generation g)".
  static absl::StatusOr<std::unique_ptr<CpuDataPlane>> Form(
      const DataPlaneGroup& group, std::shared_ptr<gloo::rendezvous::Store> store);

  // collective(): the Gloo group as formed, or after a rank mask the
  // survivors' group in the original numbering (core/masked_collective.h).
  // Rank masks (server/data_plane.h): with every rank's Rendezvous address
  // and more than one rank.
  absl::StatusOr<DataPlaneAllocation> Allocate(const core::EpDispatcherOptions& options,
                                               int64_t max_intermediate,
                                               int64_t memory_cap_bytes) override;
  absl::StatusOr<int64_t> LoadExperts(int layer, const core::ExpertSource& source,
                                      int64_t memory_cap_bytes) override;
  absl::Status InstallPlacement(int layer,
                                std::shared_ptr<const core::PlacementTable> table) override;
  // Host pointers; `stream` must be null (server/cpu_engine_calls.cc).
  // Each opens with the engine call round (core/engine_call_round.h):
  // the call's own checks go into it, so a rank that refuses its call
  // (kInvalidArgument, kFailedPrecondition: "a dispatch is in flight: call
  // combine first", "combine needs a dispatch first", no committed
  // geometry, a layer without experts) returns that error and its peers
  // kAborted naming it, with nothing moved on any rank; so do ranks in
  // different calls. EngineSyncTokenCounts here takes host pointers:
  // *local_tokens -> counts[E] (may be null), the agreement of
  // moe_ep_sync_token_counts on this plane in that one round.
  absl::Status EngineSyncTokenCounts(const int64_t* local_tokens, int64_t* counts,
                                     void* stream) override;
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

 private:
  // Benchmark's scratch step: a dispatcher of the benchmark's size over
  // this group, identity experts, the host clock (the "gloo" plane only).
  absl::StatusOr<std::unique_ptr<BenchmarkRun>> MakeBenchmarkRun(
      const core::EpDispatcherOptions& options, const BenchmarkInputs& inputs,
      int64_t memory_cap_bytes, const std::string& plane) override;
  CpuDataPlane(std::unique_ptr<core::ControlCollective> collective, DataPlaneGroup group,
               std::vector<bool> live);
  // Forward on the host tensors of `io` (in place where aligned:
  // server/host_forward.h). Sizes are checked in the dispatcher's agreement
  // round, so a rank with a bad size aborts its peers instead of stalling them.
  absl::StatusOr<core::StepStats> RunForward(int layer, const HostForward& io,
                                             int64_t num_tokens) override;
  absl::StatusOr<core::StepStats> StepOnHost(int layer, absl::Span<const core::bf16_t> hidden,
                                             absl::Span<const int32_t> topk_ids,
                                             absl::Span<const float> topk_weights,
                                             int64_t num_tokens, absl::Span<core::bf16_t> output);
  // The shared expert runs on this thread before dispatch (BLAS uses every
  // core already, so nothing overlaps it on the CPU).
  absl::StatusOr<int64_t> HoldSharedExpert(int layer, std::optional<core::SharedExpert> shared,
                                           int64_t others_bytes, int64_t memory_cap_bytes) override;
  // Serves on the members' group of `agreed` (round `agreed_round`), on the
  // caller's thread: a new dispatcher on it (the same buffers' shapes, the
  // committed geometry carried over), every table under its mask
  // (PlacementBook::SetLive).
  absl::Status UseAgreement(MaskAgreement agreed, int agreed_round) override;

  // Points into control_ (the core's, destroyed after it); the core's
  // UseDispatcher view of it is set whenever it changes.
  std::unique_ptr<core::EpDispatcher> dispatcher_;
  std::map<int, core::SharedExpert> shared_;  // layer -> its shared expert (replica)
  core::EngineCallRound engine_round_;        // opens every Engine* call
};

}  // namespace moe_ep::server
