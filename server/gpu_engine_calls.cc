// The in-process data calls of the GPU data plane (server/gpu_data_plane.h,
// GpuDataPlane::Engine*; DESIGN §14, issue 16): kernels::GpuEpDispatcher on
// the engine's device buffers and stream. Nothing here synchronises with the
// host, allocates or copies through host memory, so every call can be
// captured in the engine's CUDA graph:
//   dispatch: the dispatcher's route, pack and all-to-all (inputs read in
//     place), then one kernel unpacks the receive region into the caller's
//     [E, rows, ...] buffers and counts rows per source and per local expert
//     on the device (kernels/engine_rows.cuh);
//   combine: the caller's expert outputs are sent as they are when rows = R,
//     else one strided device copy packs them to [E, R, H] first;
//   forward: dispatch, the loaded experts (grouped GEMM reading counts on
//     the device), the shared expert on its own stream, combine.
// The (epoch, R) agreement is the device-side one (GeometryCheck::kDevice);
// EngineCheckStep is the sync point that reports it. A dispatch whose
// arguments fail this rank's checks enqueues a refusal in place of the step
// (GpuEpDispatcher::RefuseStep: the same transfers, a header the peers read
// as refused), so the peers' step ends without output instead of waiting
// out the group's timeout (issue 30 item 1); so does a forward, and a
// combine refuses in place (GpuEpDispatcher::RefuseCombine).

#ifdef MOE_EP_HAVE_CUDA

#include <string>

#include "absl/strings/str_cat.h"
#include "core/placement_table.h"
#include "core/status_macros.h"
#include "kernels/cuda_status.h"
#include "kernels/engine_rows.cuh"
#include "server/engine_call_checks.h"
#include "server/gpu_data_plane.h"
#include "server/gpu_engine_args.h"

namespace moe_ep::server {
namespace {

// Restores the dispatcher's host-side geometry check (the Forward RPC's)
// when an engine call returns.
class DeviceGeometryCheck {
 public:
  explicit DeviceGeometryCheck(kernels::GpuEpDispatcher* d) : d_(d), saved_(d->geometry_check()) {
    d_->set_geometry_check(kernels::GeometryCheck::kDevice);
  }
  ~DeviceGeometryCheck() { d_->set_geometry_check(saved_); }
  DeviceGeometryCheck(const DeviceGeometryCheck&) = delete;
  DeviceGeometryCheck& operator=(const DeviceGeometryCheck&) = delete;

 private:
  kernels::GpuEpDispatcher* d_;
  kernels::GeometryCheck saved_;
};

}  // namespace

absl::Status GpuDataPlane::RequireEngineCall(
    const char* call, std::initializer_list<std::pair<const char*, const void*>> ptrs) {
  if (dispatcher_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat(call, ": no workspace; AllocateWorkspace first"));
  }
  RETURN_IF_ERROR(MakeDeviceCurrent());
  return CheckEngineDevicePointers(call, data_plane(), group_.device, device_pointers_, ptrs);
}

absl::Status GpuDataPlane::OnCallerStream(cudaStream_t caller,
                                          const std::function<absl::Status()>& enqueue) {
  return events_->OnCallerStream(caller, dispatcher_->stream(), [&]() -> absl::Status {
    DeviceGeometryCheck device_check(dispatcher_.get());
    return enqueue();
  });
}

absl::StatusOr<core::StepStats> GpuDataPlane::EngineDispatch(
    const void* hidden, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
    const EngineRecvBuffers& out, void* stream) {
  RETURN_IF_ERROR(RequireEngineCall("dispatch", {}));
  if (!dispatcher_->geometry_committed()) {
    // No R, so no step to refuse either: kFailedPrecondition naming
    // CommitGeometry.
    return dispatcher_->CheckStep("dispatch", num_tokens);
  }
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  const int rank = view_->rank();
  // Engine-run experts are the contiguous placement's: the core's book
  // holds it (every rank owns at least one expert: num_experts >= E).
  const core::PlacementTable& contiguous = *book_.contiguous();
  const int local_experts = contiguous.NumSlots(rank);
  const absl::Status args =
      CheckEngineDispatchArgs(data_plane(), group_.device, device_pointers_, rank,
                              dispatcher_->CheckStep("dispatch", num_tokens), r, local_experts,
                              hidden, topk_ids, topk_weights, num_tokens, out);
  if (!args.ok()) {
    // The peers' NCCL transfers of this step would wait for this rank's
    // until the group's timeout and break the group: run the step's
    // transfers as a refusal instead (issue 30 item 1), so the peers' step
    // ends at once without output and their check_step names this rank.
    // The caller gets its own error either way, told when the refusal
    // itself failed.
    return RefusedDispatchError(args, OnCallerStream(static_cast<cudaStream_t>(stream),
                                                     [&]() { return dispatcher_->RefuseStep(); }));
  }
  const auto* in_hidden = static_cast<const uint16_t*>(hidden);
  RETURN_IF_ERROR(OnCallerStream(static_cast<cudaStream_t>(stream), [&]() -> absl::Status {
    RETURN_IF_ERROR(dispatcher_->Dispatch(in_hidden, topk_ids, topk_weights, num_tokens));
    return kernels::LaunchUnpackReceived(
        EngineUnpackParams(options_, out, dispatcher_->received_rows(), r,
                           contiguous.SlotExperts(rank).front(), local_experts),
        dispatcher_->stream());
  }));
  engine_tokens_ = num_tokens;
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = r;
  return stats;
}

absl::StatusOr<core::StepStats> GpuDataPlane::EngineCombine(const void* expert_out, int64_t rows,
                                                            void* output, void* stream) {
  RETURN_IF_ERROR(RequireEngineCall("combine", {}));
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  const int64_t h = options_.workspace.hidden;
  const int64_t e = options_.workspace.ep_size;
  if (const absl::Status args =
          CheckGpuEngineCombineArgs(data_plane(), group_.device, device_pointers_, view_->rank(),
                                    rows, r, expert_out, output, engine_tokens_);
      !args.ok()) {
    // The peers' combine transfers wait for this rank's: run them as a
    // refused combine (the header among them says so), so the peers' step
    // ends at once without output (issue 30 item 1). Without a dispatched
    // step no peer waits on this rank's combine.
    if (!dispatcher_->in_step()) return args;
    return RefusedCombineError(args, OnCallerStream(static_cast<cudaStream_t>(stream), [&]() {
                                 return dispatcher_->RefuseCombine();
                               }));
  }
  const auto* in = static_cast<const uint16_t*>(expert_out);
  RETURN_IF_ERROR(OnCallerStream(static_cast<cudaStream_t>(stream), [&]() -> absl::Status {
    const uint16_t* send = in;
    if (rows != r && r > 0) {
      // [E, rows, H] -> [E, R, H]: the rows the all-to-all sends.
      const absl::Status packed = kernels::EnqueueExpertOutputsPack(
          in, rows, dispatcher_->expert_output(), r, h, static_cast<int>(e), dispatcher_->stream());
      if (!packed.ok()) return RefusedCombineError(packed, dispatcher_->RefuseCombine());
      send = nullptr;
    }
    return dispatcher_->Combine(static_cast<uint16_t*>(output), nullptr, send);
  }));
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = r;
  return stats;
}

absl::StatusOr<core::StepStats> GpuDataPlane::EngineForward(int layer, const void* hidden,
                                                            const int32_t* topk_ids,
                                                            const float* topk_weights,
                                                            int64_t num_tokens, void* output,
                                                            void* stream) {
  RETURN_IF_ERROR(RequireEngineCall("forward", {}));
  if (!dispatcher_->geometry_committed()) {
    return dispatcher_->CheckStep("forward", num_tokens);  // no R: nothing to refuse
  }
  kernels::DeviceExpertSet* experts = experts_.Find<kernels::DeviceExpertSet>(layer);
  const absl::Status args = CheckEngineForwardArgs(
      data_plane(), group_.device, device_pointers_, view_->rank(),
      experts == nullptr ? ExpertsNotLoaded("forward", layer) : absl::OkStatus(),
      dispatcher_->CheckStep("forward", num_tokens), hidden, topk_ids, topk_weights, num_tokens,
      output);
  if (!args.ok()) {
    // As a refused dispatch: the peers' forward ends at once without output
    // and their check_step names this rank (issue 30 item 1).
    return RefusedDispatchError(args, OnCallerStream(static_cast<cudaStream_t>(stream),
                                                     [&]() { return dispatcher_->RefuseStep(); }));
  }
  const auto* in = static_cast<const uint16_t*>(hidden);
  const kernels::DeviceExpertSet& set = *experts;
  const bool has_shared = shared_.Has(layer);
  RETURN_IF_ERROR(OnCallerStream(static_cast<cudaStream_t>(stream), [&]() -> absl::Status {
    cudaStream_t own = dispatcher_->stream();
    if (has_shared) RETURN_IF_ERROR(shared_.Begin(layer, in, num_tokens, own));
    RETURN_IF_ERROR(dispatcher_->Dispatch(in, topk_ids, topk_weights, num_tokens));
    absl::Status computed = dispatcher_->ComputeExperts(set);
    if (computed.ok() && has_shared) computed = shared_.JoinInto(own);
    if (!computed.ok()) {
      // The peers' combine waits for this rank's, and its expert outputs
      // are not this step's: refuse the combine, so the peers write no
      // output and their check_step names this rank (issue 30 item 1).
      return RefusedCombineError(computed, dispatcher_->RefuseCombine());
    }
    return dispatcher_->Combine(static_cast<uint16_t*>(output),
                                has_shared ? shared_.output() : nullptr);
  }));
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = dispatcher_->runtime_max_tokens_per_rank();
  return stats;
}

absl::Status GpuDataPlane::EngineSyncTokenCounts(const int64_t* local_tokens, int64_t* counts,
                                                 void* stream) {
  RETURN_IF_ERROR(
      RequireEngineCall("sync_token_counts", {{"local_tokens", local_tokens}, {"counts", counts}}));
  if (local_tokens == nullptr || counts == nullptr) {
    return absl::InvalidArgumentError(
        "sync_token_counts: local_tokens and counts must not be null (device int64 and [E])");
  }
  return OnCallerStream(static_cast<cudaStream_t>(stream),
                        [&]() { return view_->AllGather(local_tokens, sizeof(int64_t), counts); });
}

}  // namespace moe_ep::server

#endif  // MOE_EP_HAVE_CUDA
