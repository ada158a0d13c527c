#include "server/cpu_data_plane.h"

#include <chrono>
#include <memory>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/expert_placement.h"
#include "core/masked_collective.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "server/call_gate.h"
#include "server/host_forward.h"
#include "server/rank_mask.h"

namespace moe_ep::server {
namespace {

absl::Status CheckSharedHidden(const core::SharedExpert& shared,
                               const core::EpDispatcher* dispatcher, int64_t hidden) {
  if (dispatcher == nullptr) {
    return absl::FailedPreconditionError("LoadSharedExpert: no workspace; call Allocate first");
  }
  if (shared.hidden() != hidden) {
    return absl::InvalidArgumentError(absl::StrCat("LoadSharedExpert: shared expert H ",
                                                   shared.hidden(),
                                                   " differs from the workspace's ", hidden));
  }
  return absl::OkStatus();
}

}  // namespace

CpuDataPlane::CpuDataPlane(std::unique_ptr<core::ControlCollective> collective,
                           DataPlaneGroup group, std::vector<bool> live)
    : DataPlane(PlaneKind::kGloo, core::EpDispatcher::kCpuLimits) {
  control_ = std::move(collective);
  group_ = std::move(group);
  mask_.live = std::move(live);
}

absl::StatusOr<std::unique_ptr<CpuDataPlane>> CpuDataPlane::Form(
    const DataPlaneGroup& group, std::shared_ptr<gloo::rendezvous::Store> store) {
  const bool alone = group.rejoin && group.world_size > 1;
  // A returning rank: a Gloo group of itself, seen in the original numbering
  // with every other rank masked (core/masked_collective.h).
  absl::StatusOr<std::unique_ptr<core::GlooCollective>> collective = core::GlooCollective::Create(
      std::move(store), absl::StrCat("gen", group.generation, alone ? "/alone" : ""),
      alone ? 0 : group.rank, alone ? 1 : group.world_size, group.data_plane_host, group.timeout);
  if (!collective.ok()) {
    return absl::Status(
        collective.status().code(),
        absl::StrCat("Join (rank ", group.rank, " of ", group.world_size, ", generation ",
                     group.generation, "): ", collective.status().message()));
  }
  if (!alone) {
    return std::unique_ptr<CpuDataPlane>(
        new CpuDataPlane(std::move(*collective), group, std::vector<bool>(group.world_size, true)));
  }
  std::vector<bool> live(group.world_size, false);
  live[group.rank] = true;
  ASSIGN_OR_RETURN(std::unique_ptr<core::MaskedCollective> masked,
                   core::MaskedCollective::Create(std::move(*collective), group.rank, live));
  return std::unique_ptr<CpuDataPlane>(new CpuDataPlane(std::move(masked), group, std::move(live)));
}

absl::Status CpuDataPlane::UseAgreement(MaskAgreement agreed, int /*agreed_round*/) {
  ASSIGN_OR_RETURN(
      std::unique_ptr<core::MaskedCollective> masked,
      core::MaskedCollective::Create(std::move(agreed.group), group_.rank, agreed.live));
  std::unique_ptr<core::EpDispatcher> dispatcher;
  if (dispatcher_ != nullptr) {
    // The same buffers' shapes on the survivors' group; the geometry stays.
    ASSIGN_OR_RETURN(dispatcher, core::EpDispatcher::Create(masked.get(), options_, 0));
    if (geometry_.committed) {
      RETURN_IF_ERROR(
          dispatcher->CommitGeometry(geometry_.epoch, geometry_.runtime_max_tokens_per_rank, 0));
    }
  }
  // The old dispatcher points into the old group: it goes first; closing
  // the old group fails any laggard of it at once.
  dispatcher_ = std::move(dispatcher);
  UseDispatcher(dispatcher_.get(), 0);
  control_ = std::move(masked);
  // Every member adopts the agreement in the same call: the engine calls
  // are numbered afresh on the new group (a returning rank has counted none).
  engine_round_.Reset();
  return absl::OkStatus();
}

absl::StatusOr<DataPlaneAllocation> CpuDataPlane::Allocate(const core::EpDispatcherOptions& options,
                                                           int64_t /*max_intermediate*/,
                                                           int64_t memory_cap_bytes) {
  ASSIGN_OR_RETURN(std::unique_ptr<core::EpDispatcher> dispatcher,
                   core::EpDispatcher::Create(control_.get(), options, memory_cap_bytes));
  DataPlaneAllocation allocation;
  allocation.allocated_bytes = dispatcher->allocated_bytes();
  allocation.regions = dispatcher->layout().Regions();
  ForgetExperts();
  shared_.clear();
  book_.Reset(dispatcher->placement());
  book_.SetLive(mask_.live);
  options_ = options;
  dispatcher_ = std::move(dispatcher);
  UseDispatcher(dispatcher_.get(), 0);
  geometry_ = {};
  NewWorkspaceToken();
  return allocation;
}

absl::StatusOr<int64_t> CpuDataPlane::LoadExperts(int layer, const core::ExpertSource& source,
                                                  int64_t /*memory_cap_bytes*/) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("LoadExperts: no workspace; call Allocate first");
  }
  // An installed table is checked slot by slot; without one, the range of
  // the contiguous placement (and its message).
  RETURN_IF_ERROR(
      CheckExpertSourceForWorkspace(source, options_, group_.rank, book_.Installed(layer)));
  ASSIGN_OR_RETURN(core::ExpertSet experts, core::MakeHostExperts(source));
  const int64_t bytes = experts.weight_bytes();
  experts_.Put(layer, std::make_unique<core::ExpertSet>(std::move(experts)));
  return bytes;
}

absl::StatusOr<int64_t> CpuDataPlane::HoldSharedExpert(int layer,
                                                       std::optional<core::SharedExpert> shared,
                                                       int64_t /*others_bytes*/,
                                                       int64_t /*memory_cap_bytes*/) {
  if (!shared.has_value()) {
    shared_.erase(layer);
    return 0;
  }
  RETURN_IF_ERROR(CheckSharedHidden(*shared, dispatcher_.get(), options_.workspace.hidden));
  const int64_t bytes = shared->weight_bytes();
  shared_.insert_or_assign(layer, std::move(*shared));
  return bytes;
}

absl::Status CpuDataPlane::InstallPlacement(int layer,
                                            std::shared_ptr<const core::PlacementTable> table) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError("InstallPlacement: no workspace; call Allocate first");
  }
  if (table == nullptr) return absl::InvalidArgumentError("InstallPlacement: null table");
  RETURN_IF_ERROR(core::ValidatePlacement(*table, options_));
  const int rank = group_.rank;
  experts_.KeepIfSlotsOf(layer, *table, rank);
  book_.Install(layer, std::move(table));
  return absl::OkStatus();
}

absl::StatusOr<core::StepStats> CpuDataPlane::RunForward(int layer, const HostForward& io,
                                                         int64_t num_tokens) {
  return RunOnHostTensors(io, [&](auto hidden, auto topk_ids, auto topk_weights, auto output) {
    return StepOnHost(layer, hidden, topk_ids, topk_weights, num_tokens, output);
  });
}

absl::StatusOr<core::StepStats> CpuDataPlane::StepOnHost(
    int layer, absl::Span<const core::bf16_t> hidden, absl::Span<const int32_t> topk_ids,
    absl::Span<const float> topk_weights, int64_t num_tokens, absl::Span<core::bf16_t> output) {
  const core::ExpertSet* experts = experts_.Find<core::ExpertSet>(layer);
  if (experts == nullptr) {
    return ExpertsNotLoaded("Forward", layer);
  }
  const std::string call = absl::StrCat("Forward (layer ", layer, ")");
  RETURN_IF_ERROR(
      CallGate(*control_, call_, absl::StrCat(call, ": before dispatch"), kForwardStopHint));
  // This rank's shared-expert term, added at combine. A size error here is
  // reported through the dispatcher's agreement round (an output-size
  // mismatch), so peers abort instead of waiting.
  std::vector<core::bf16_t> shared_out;
  int64_t shared_us = 0;
  auto shared = shared_.find(layer);
  if (shared != shared_.end() &&
      static_cast<int64_t>(hidden.size()) == num_tokens * shared->second.hidden()) {
    const auto start = std::chrono::steady_clock::now();
    shared_out.resize(hidden.size());
    absl::Status computed = shared->second.Compute(hidden, num_tokens, absl::MakeSpan(shared_out));
    if (!computed.ok()) shared_out.assign(1, 0);  // mismatched: Forward rejects it collectively
    shared_us = std::chrono::duration_cast<std::chrono::microseconds>(
                    std::chrono::steady_clock::now() - start)
                    .count();
  }
  RETURN_IF_ERROR(dispatcher_->SetPlacement(Placement(layer)));
  // The expert compute stops early once the call is past its deadline or
  // cancelled (call_.Expired latches it), and the gate after it then stops
  // every rank (server/call_gate.h).
  const absl::Status forwarded = dispatcher_->Forward(
      hidden, topk_ids, topk_weights, num_tokens, *experts, output, shared_out,
      [&] {
        return CallGate(*control_, call_,
                        absl::StrCat(call, ": between expert compute and combine"),
                        kForwardStopHint);
      },
      call_.StopCheck());
  // This step's counts go to the layer's counters, keyed by its routing (a
  // step resent after a mask counts once: core/expert_load_book.h); those
  // of a step that did not complete are dropped.
  const core::ExpertLoadCounts step = dispatcher_->ReadExpertLoad(/*reset=*/true);
  RETURN_IF_ERROR(forwarded);
  book_.AddLoad(
      layer, step,
      core::LoadStepKey{dispatcher_->epoch(), mask_.round, core::RoutingFingerprint(topk_ids)});
  core::StepStats stats = dispatcher_->last_step();
  stats.shared_us = shared_us;
  return stats;
}

namespace {

// Benchmark's scratch step on the CPU plane: a dispatcher of the
// benchmark's size over the plane's collective, the contiguous placement's
// identity experts, timed by the host clock.
class CpuBenchmarkRun final : public BenchmarkRun {
 public:
  CpuBenchmarkRun(std::unique_ptr<core::EpDispatcher> bench, core::ExpertSet identity,
                  const BenchmarkInputs& inputs)
      : bench_(std::move(bench)),
        identity_(std::move(identity)),
        inputs_(inputs),
        output_(inputs.hidden.size()) {}

  absl::StatusOr<PhaseTimes> Step() override {
    const auto t0 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(bench_->Dispatch(inputs_.hidden, inputs_.topk_ids, inputs_.topk_weights,
                                     inputs_.num_tokens));
    const auto t1 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(bench_->ComputeExperts(identity_));
    const auto t2 = std::chrono::steady_clock::now();
    RETURN_IF_ERROR(bench_->Combine(absl::MakeSpan(output_)));
    const auto t3 = std::chrono::steady_clock::now();
    PhaseTimes times;
    times.dispatch_us = std::chrono::duration<double, std::micro>(t1 - t0).count();
    times.combine_us = std::chrono::duration<double, std::micro>(t3 - t2).count();
    return times;
  }
  absl::StatusOr<int64_t> TokensSent() override { return bench_->last_step().tokens_sent; }

 private:
  std::unique_ptr<core::EpDispatcher> bench_;
  core::ExpertSet identity_;
  const BenchmarkInputs& inputs_;
  std::vector<core::bf16_t> output_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<BenchmarkRun>> CpuDataPlane::MakeBenchmarkRun(
    const core::EpDispatcherOptions& options, const BenchmarkInputs& inputs,
    int64_t /*memory_cap_bytes*/, const std::string& /*plane*/) {
  // The caller checked the cap against core::CpuWorkspaceLayout, which is
  // exactly what this dispatcher allocates.
  ASSIGN_OR_RETURN(std::unique_ptr<core::EpDispatcher> bench,
                   core::EpDispatcher::Create(control_.get(), options, 0));
  const int rank = control_->rank();
  ASSIGN_OR_RETURN(core::ExpertPlacement placement,
                   core::ExpertPlacement::Contiguous(options.num_experts, control_->size()));
  core::ExpertSet identity = core::ExpertSet::Identity(
      placement.FirstExpert(rank), placement.NumLocalExperts(rank), options.workspace.hidden);
  RETURN_IF_ERROR(bench->CommitGeometry(1, inputs.num_tokens, inputs.num_tokens));
  return std::make_unique<CpuBenchmarkRun>(std::move(bench), std::move(identity), inputs);
}

}  // namespace moe_ep::server
