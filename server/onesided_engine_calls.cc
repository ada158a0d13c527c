// The in-process data calls of the one-sided GPU data plane
// (server/onesided_data_plane.h, OneSidedDataPlane::Engine*; DESIGN §14,
// issue 34 item 2): kernels::onesided::OneSidedDispatcher on the engine's
// device buffers and stream, the counterpart of the NCCL plane's
// server/gpu_engine_calls.cc. Nothing here synchronises with the host,
// allocates or copies through host memory (sync_token_counts aside, which
// agrees on the host), so dispatch, combine and forward can be captured:
//   dispatch: the dispatcher's route and pushes into the peers' windows
//     (inputs read in place; the SM path at any R, whose slots are packed),
//     then one kernel unpacks this rank's window
//     into the caller's [E, rows, ...] buffers and counts rows per source
//     and per local expert on the device (kernels/engine_rows.cuh, the NCCL
//     plane's unpack: the window holds the same packed rows);
//   combine: the combine kernel pushes the caller's expert outputs back,
//     read in place (packed into the dispatcher's expert output first only
//     when not 16-byte aligned);
//   forward: dispatch, the layer's loaded experts, the shared expert, combine.
// The (epoch, R) agreement rides in the dispatch flags; EngineCheckStep is
// the sync point that reports it and a peer that never came.

#ifdef MOE_EP_HAVE_CUDA

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/status_macros.h"
#include "kernels/device_calls.h"
#include "kernels/engine_rows.cuh"
#include "kernels/nccl_collective.h"
#include "server/engine_call_checks.h"
#include "server/gpu_engine_args.h"
#include "server/onesided_data_plane.h"

namespace moe_ep::server {
namespace {}  // namespace

absl::Status OneSidedDataPlane::RequireEngineCall(
    const char* call, std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  RETURN_IF_ERROR(RequireEnginePlane(call));
  return CheckEngineDevicePointers(call, data_plane(), group_.device, device_pointers_, ptrs);
}

absl::Status OneSidedDataPlane::RequireEnginePlane(const char* call) {
  if (staging_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": no workspace; AllocateWorkspace first"));
  }
  if (const std::vector<int> masked = mask_.MaskedRanks(); !masked.empty() || windows_dropped_) {
    return absl::FailedPreconditionError(absl::StrCat(
        call, " on rank ", group_.rank, ": rank mask round ", mask_.round, " masks ranks [",
        absl::StrJoin(masked, ", "),
        "]; the one-sided plane's engine calls route by the contiguous placement of all ranks "
        "(the Forward RPC serves a masked group; re-admit the ranks first)"));
  }
  RETURN_IF_ERROR(MakeDeviceCurrent());
  // A Forward RPC under another table may have left another id space: the
  // engine's ids are the contiguous placement's (a new dispatcher then;
  // graphs captured before must be captured again: NewWorkspaceToken).
  return UseRouteMap(EngineMap());
}

absl::Status OneSidedDataPlane::OnEngineStream(
    void* stream, const std::function<absl::Status(cudaStream_t)>& enqueue) {
  ASSIGN_OR_RETURN(cudaStream_t on,
                   dispatcher_->BeginEngineCall(static_cast<cudaStream_t>(stream)));
  absl::Status status = enqueue(on);
  absl::Status ended = dispatcher_->EndEngineCall();
  return status.ok() ? ended : status;
}

absl::StatusOr<EngineRecvBuffers> OneSidedDataPlane::EngineReceiveBuffers() {
  RETURN_IF_ERROR(RequireEnginePlane("receive_buffers"));
  const kernels::onesided::OsReceiveBuffers b = dispatcher_ != nullptr
                                                    ? dispatcher_->receive_buffers()
                                                    : kernels::onesided::OsReceiveBuffers{};
  if (b.hidden == nullptr) {
    return absl::UnimplementedError(
        absl::StrCat("receive_buffers: rank ", group_.rank,
                     "'s one-sided windows hold no receive buffers; start every worker with "
                     "--onesided-receive-buffers"));
  }
  EngineRecvBuffers out;
  out.rows = b.rows;
  out.hidden = reinterpret_cast<core::bf16_t*>(b.hidden);
  out.topk_ids = b.topk_ids;
  out.topk_weights = b.topk_weights;
  return out;
}

const OneSidedRouteMap& OneSidedDataPlane::EngineMap() {
  if (engine_map_table_ != book_.contiguous()) {
    engine_map_ = MakeOneSidedRouteMap(*book_.contiguous());
    engine_map_table_ = book_.contiguous();
  }
  return engine_map_;
}

absl::StatusOr<core::StepStats> OneSidedDataPlane::EngineDispatch(
    const void* hidden, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
    const EngineRecvBuffers& out, void* stream) {
  RETURN_IF_ERROR(RequireEnginePlane("dispatch"));
  if (out.end_step) {
    return absl::UnimplementedError(
        "dispatch: the one-sided plane runs dispatch + combine steps only; moe_ep_dispatch_only "
        "is the gloo plane's");
  }
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  if (r < 1) {
    return absl::FailedPreconditionError(absl::StrCat(
        "dispatch on rank ", group_.rank, ": no geometry committed; call CommitGeometry"));
  }
  const OneSidedRouteMap& map = EngineMap();
  const int local_experts = map.num_local[group_.rank];
  const absl::Status args =
      CheckEngineDispatchArgs(data_plane(), group_.device, device_pointers_, group_.rank,
                              dispatcher_->CheckStep("dispatch", num_tokens), r, local_experts,
                              hidden, topk_ids, topk_weights, num_tokens, out);
  if (!args.ok()) {
    // The peers' kernels would wait out the timeout for this rank's flags:
    // publish a refusal in their place (issue 30 item 1). The caller gets
    // its own error either way.
    return RefusedDispatchError(
        args, OnEngineStream(stream, [&](cudaStream_t) { return dispatcher_->RefuseStep(); }));
  }
  const auto* in_hidden = static_cast<const uint16_t*>(hidden);
  RETURN_IF_ERROR(OnEngineStream(stream, [&](cudaStream_t) -> absl::Status {
    // The send kernel zeroes the counts the unpack adds into.
    kernels::onesided::OsZeroCounts zero;
    zero.ptr[0] = out.source_counts;
    zero.n[0] = out.source_counts != nullptr ? static_cast<int>(options_.workspace.ep_size) : 0;
    zero.ptr[1] = out.expert_counts;
    zero.n[1] = out.expert_counts != nullptr ? local_experts : 0;
    // The unpack into the caller's buffers: in the send kernel's tail on its
    // fused path (one launch; issue 30 item 3), else after it.
    kernels::UnpackReceivedParams unpack =
        EngineUnpackParams(options_, out, dispatcher_->received_rows(), r,
                           map.dispatch_base[group_.rank], local_experts);
    unpack.counts_zeroed = true;
    return dispatcher_->Dispatch(in_hidden, topk_ids, topk_weights, num_tokens, zero, &unpack);
  }));
  engine_tokens_ = num_tokens;
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = r;
  return stats;
}

absl::StatusOr<core::StepStats> OneSidedDataPlane::EngineCombine(const void* expert_out,
                                                                 int64_t rows, void* output,
                                                                 void* stream) {
  RETURN_IF_ERROR(RequireEnginePlane("combine"));
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  if (const absl::Status args =
          CheckGpuEngineCombineArgs(data_plane(), group_.device, device_pointers_, group_.rank,
                                    rows, r, expert_out, output, engine_tokens_);
      !args.ok()) {
    // The peers' combine kernels wait for this rank's flags: publish a
    // refusal in their place (issue 30 item 1). Without a dispatched step
    // there is nothing to refuse (no peer waits on this rank's combine).
    if (!dispatcher_->in_step()) return args;
    return RefusedCombineError(
        args, OnEngineStream(stream, [&](cudaStream_t) { return dispatcher_->RefuseCombine(); }));
  }
  RETURN_IF_ERROR(OnEngineStream(stream, [&](cudaStream_t) -> absl::Status {
    // The combine kernel reads the caller's [E, rows, H] rows in place.
    return dispatcher_->CombineFrom(static_cast<const uint16_t*>(expert_out), rows,
                                    static_cast<uint16_t*>(output));
  }));
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = r;
  return stats;
}

absl::StatusOr<core::StepStats> OneSidedDataPlane::EngineForward(int layer, const void* hidden,
                                                                 const int32_t* topk_ids,
                                                                 const float* topk_weights,
                                                                 int64_t num_tokens, void* output,
                                                                 void* stream) {
  RETURN_IF_ERROR(RequireEnginePlane("forward"));
  // No committed geometry: no step to refuse (R = 0 is a step: it runs).
  RETURN_IF_ERROR(dispatcher_->CheckStep("forward", 0));
  kernels::DeviceExpertSet* experts = experts_.Find<kernels::DeviceExpertSet>(layer);
  absl::Status loaded = experts == nullptr ? ExpertsNotLoaded("forward", layer) : absl::OkStatus();
  if (loaded.ok()) {
    const std::shared_ptr<const core::PlacementTable> table = Placement(layer);
    // (A pointer compare first: Fingerprint() hashes the table's text.)
    if (table != book_.contiguous() && table->Fingerprint() != book_.contiguous()->Fingerprint()) {
      loaded = absl::FailedPreconditionError(absl::StrCat(
          "forward: layer ", layer,
          " has an installed placement table other than the contiguous one; the one-sided "
          "plane's engine calls route by the contiguous placement (the Forward RPC serves any "
          "table)"));
    }
  }
  const absl::Status args =
      CheckEngineForwardArgs(data_plane(), group_.device, device_pointers_, group_.rank, loaded,
                             dispatcher_->CheckStep("forward", num_tokens), hidden, topk_ids,
                             topk_weights, num_tokens, output);
  if (!args.ok()) {
    // As a refused dispatch: the peers' forward ends at once without output
    // and their check_step names this rank (issue 30 item 1).
    return RefusedDispatchError(
        args, OnEngineStream(stream, [&](cudaStream_t) { return dispatcher_->RefuseStep(); }));
  }
  // The experts answer to the contiguous map's ids (a no-op unless a
  // Forward RPC under another table renumbered them).
  RETURN_IF_ERROR(
      experts->Renumber(OneSidedSlotIds(EngineMap(), group_.rank), dispatcher_->stream()));
  const auto* in = static_cast<const uint16_t*>(hidden);
  const kernels::DeviceExpertSet& set = *experts;
  const bool has_shared = shared_.Has(layer);
  RETURN_IF_ERROR(events_->OnCallerStream(
      static_cast<cudaStream_t>(stream), dispatcher_->stream(), [&]() -> absl::Status {
        cudaStream_t own = dispatcher_->stream();
        if (has_shared) RETURN_IF_ERROR(shared_.Begin(layer, in, num_tokens, own));
        RETURN_IF_ERROR(dispatcher_->Dispatch(in, topk_ids, topk_weights, num_tokens));
        absl::Status computed = dispatcher_->ComputeExperts(set);
        if (computed.ok() && has_shared) computed = shared_.JoinInto(own);
        if (!computed.ok()) {
          // The peers wait for this rank's combine flags, and its expert
          // outputs are not this step's: refuse the combine, so the peers
          // write no output and their check_step names this rank.
          return RefusedCombineError(computed, dispatcher_->RefuseCombine());
        }
        return dispatcher_->Combine(static_cast<uint16_t*>(output),
                                    has_shared ? shared_.output() : nullptr);
      }));
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = dispatcher_->runtime_max_tokens_per_rank();
  return stats;
}

absl::Status OneSidedDataPlane::EngineSyncTokenCounts(const int64_t* local_tokens, int64_t* counts,
                                                      void* stream) {
  RETURN_IF_ERROR(
      RequireEngineCall("sync_token_counts", {{"local_tokens", local_tokens}, {"counts", counts}}));
  if (local_tokens == nullptr || counts == nullptr) {
    return absl::InvalidArgumentError(
        "sync_token_counts: local_tokens and counts must not be null (device int64 and [E])");
  }
  auto caller = static_cast<cudaStream_t>(stream);
  ASSIGN_OR_RETURN(const bool capturing, kernels::StreamIsCapturing(caller));
  if (capturing) {
    return absl::FailedPreconditionError(
        "sync_token_counts: the one-sided plane agrees token counts on the host (Gloo), which a "
        "CUDA graph cannot capture; call it before the capture, or use moe_ep_sync_token_counts");
  }
  int64_t mine = 0;
  RETURN_IF_ERROR(
      kernels::CopyToHostAsync(&mine, local_tokens, sizeof(mine), caller, "local_tokens to host"));
  RETURN_IF_ERROR(kernels::SynchronizeStream(caller, "stream"));
  ASSIGN_OR_RETURN(const std::vector<int64_t> all, SyncTokenCounts(mine));
  RETURN_IF_ERROR(kernels::CopyToDeviceAsync(counts, all.data(), all.size() * sizeof(int64_t),
                                             caller, "counts to device"));
  // `all` is a local: the copy must have read it before it goes.
  return kernels::SynchronizeStream(caller, "stream");
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
