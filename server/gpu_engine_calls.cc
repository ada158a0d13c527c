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
// EngineCheckStep is the sync point that reports it.

#ifdef MOE_EP_HAVE_CUDA

#include <string>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda_status.h"
#include "kernels/engine_rows.cuh"
#include "server/gpu_data_plane.h"

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
  for (const auto& [name, ptr] : ptrs) {
    if (ptr != nullptr && !kernels::IsDevicePointer(ptr)) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": ", name,
                       " is not device memory; the nccl data plane takes device pointers "
                       "(CUDA device ",
                       group_.device, ")"));
    }
  }
  return absl::OkStatus();
}

absl::Status GpuDataPlane::OnCallerStream(cudaStream_t caller,
                                          const std::function<absl::Status()>& enqueue) {
  cudaStream_t own = dispatcher_->stream();
  const bool fork = caller != own;
  if (fork) {
    RETURN_IF_ERROR(
        kernels::CudaStatus(cudaEventRecord(fork_, caller), "cudaEventRecord(caller stream)"));
    RETURN_IF_ERROR(kernels::CudaStatus(cudaStreamWaitEvent(own, fork_, 0), "cudaStreamWaitEvent"));
  }
  DeviceGeometryCheck device_check(dispatcher_.get());
  absl::Status status = enqueue();
  if (fork) {
    // Joined on error too: a capture of `caller` then still ends cleanly.
    absl::Status joined =
        kernels::CudaStatus(cudaEventRecord(join_, own), "cudaEventRecord(worker stream)");
    if (joined.ok())
      joined = kernels::CudaStatus(cudaStreamWaitEvent(caller, join_, 0), "cudaStreamWaitEvent");
    if (status.ok()) status = joined;
  }
  return status;
}

absl::StatusOr<core::StepStats> GpuDataPlane::EngineDispatch(
    const void* hidden, const int32_t* topk_ids, const float* topk_weights, int64_t num_tokens,
    const EngineRecvBuffers& out, void* stream) {
  RETURN_IF_ERROR(RequireEngineCall("dispatch", {{"hidden", hidden},
                                                 {"topk_ids", topk_ids},
                                                 {"topk_weights", topk_weights},
                                                 {"recv_hidden", out.hidden},
                                                 {"recv_topk_ids", out.topk_ids},
                                                 {"recv_topk_weights", out.topk_weights},
                                                 {"source_counts", out.source_counts},
                                                 {"expert_counts", out.expert_counts}}));
  RETURN_IF_ERROR(dispatcher_->CheckStep("dispatch", num_tokens));
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  const int rank = view_->rank();
  if (out.rows < r) {
    return absl::InvalidArgumentError(absl::StrCat("dispatch on rank ", rank, ": recv_rows ",
                                                   out.rows, " < the committed R ", r));
  }
  const int local_experts = placement_->NumLocalExperts(rank);
  if (out.source_counts == nullptr || (out.expert_counts == nullptr && local_experts > 0)) {
    return absl::InvalidArgumentError("dispatch: source_counts and expert_counts must not be null");
  }
  if (out.rows > 0 &&
      (out.hidden == nullptr || out.topk_ids == nullptr || out.topk_weights == nullptr)) {
    return absl::InvalidArgumentError(
        "dispatch: recv_hidden, recv_topk_ids and recv_topk_weights must not be null when "
        "recv_rows > 0");
  }
  const auto* in_hidden = static_cast<const uint16_t*>(hidden);
  RETURN_IF_ERROR(OnCallerStream(static_cast<cudaStream_t>(stream), [&]() -> absl::Status {
    RETURN_IF_ERROR(dispatcher_->Dispatch(in_hidden, topk_ids, topk_weights, num_tokens));
    kernels::UnpackReceivedParams p;
    p.recv = dispatcher_->received_rows();
    p.runtime_max = r;
    p.rows = out.rows;
    p.hidden_size = options_.workspace.hidden;
    p.top_k = options_.workspace.top_k;
    p.ep_size = options_.workspace.ep_size;
    p.first_expert = placement_->FirstExpert(rank);
    p.num_local_experts = local_experts;
    p.invalid_expert_id = options_.invalid_expert_id;
    p.hidden = reinterpret_cast<uint16_t*>(out.hidden);
    p.topk_ids = out.topk_ids;
    p.topk_weights = out.topk_weights;
    p.source_counts = out.source_counts;
    p.expert_counts = out.expert_counts;
    return kernels::LaunchUnpackReceived(p, dispatcher_->stream());
  }));
  engine_tokens_ = num_tokens;
  core::StepStats stats;
  stats.runtime_max_tokens_per_rank = r;
  return stats;
}

absl::StatusOr<core::StepStats> GpuDataPlane::EngineCombine(const void* expert_out, int64_t rows,
                                                            void* output, void* stream) {
  RETURN_IF_ERROR(RequireEngineCall("combine", {{"expert_out", expert_out}, {"output", output}}));
  const int64_t r = dispatcher_->runtime_max_tokens_per_rank();
  const int64_t h = options_.workspace.hidden;
  const int64_t e = options_.workspace.ep_size;
  if (rows < r) {
    return absl::InvalidArgumentError(
        absl::StrCat("combine: recv_rows ", rows, " < the committed R ", r));
  }
  if ((expert_out == nullptr && rows > 0) || (output == nullptr && engine_tokens_ > 0)) {
    return absl::InvalidArgumentError(
        "combine: expert_out must not be null when recv_rows > 0, output not when the step "
        "has tokens");
  }
  const auto* in = static_cast<const uint16_t*>(expert_out);
  RETURN_IF_ERROR(OnCallerStream(static_cast<cudaStream_t>(stream), [&]() -> absl::Status {
    const uint16_t* send = in;
    if (rows != r && r > 0) {
      // [E, rows, H] -> [E, R, H]: the rows the all-to-all sends.
      RETURN_IF_ERROR(kernels::CudaStatus(
          cudaMemcpy2DAsync(dispatcher_->expert_output(), r * h * 2, in, rows * h * 2, r * h * 2, e,
                            cudaMemcpyDeviceToDevice, dispatcher_->stream()),
          "cudaMemcpy2DAsync(expert outputs)"));
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
  RETURN_IF_ERROR(RequireEngineCall("forward", {{"hidden", hidden},
                                                {"topk_ids", topk_ids},
                                                {"topk_weights", topk_weights},
                                                {"output", output}}));
  kernels::DeviceExpertSet* experts = experts_.Find<kernels::DeviceExpertSet>(layer);
  if (experts == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("forward: layer ", layer, " has no loaded experts; call LoadExperts first"));
  }
  RETURN_IF_ERROR(dispatcher_->CheckStep("forward", num_tokens));
  if (num_tokens > 0 && output == nullptr) {
    return absl::InvalidArgumentError("forward: output must not be null when num_tokens > 0");
  }
  const auto* in = static_cast<const uint16_t*>(hidden);
  const kernels::DeviceExpertSet& set = *experts;
  const bool has_shared = shared_.Has(layer);
  RETURN_IF_ERROR(OnCallerStream(static_cast<cudaStream_t>(stream), [&]() -> absl::Status {
    cudaStream_t own = dispatcher_->stream();
    if (has_shared) RETURN_IF_ERROR(shared_.Begin(layer, in, num_tokens, own));
    RETURN_IF_ERROR(dispatcher_->Dispatch(in, topk_ids, topk_weights, num_tokens));
    absl::Status computed = dispatcher_->ComputeExperts(set);
    if (!computed.ok()) {
      // Keep the ranks' collective sequence aligned, then report.
      (void)dispatcher_->Combine(static_cast<uint16_t*>(output));
      return computed;
    }
    if (has_shared) RETURN_IF_ERROR(shared_.JoinInto(own));
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
