#include "kernels/gpu_shared_experts.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/cuda_status.h"

namespace moe_ep::kernels {
GpuSharedExperts::~GpuSharedExperts() {
  layers_.clear();
  runner_.reset();
  for (cudaEvent_t e : {ready_, start_, end_}) {
    if (e != nullptr) cudaEventDestroy(e);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void GpuSharedExperts::Reset(int64_t max_tokens, int64_t hidden) {
  layers_.clear();
  runner_.reset();
  max_tokens_ = max_tokens;
  hidden_ = hidden;
}

absl::Status GpuSharedExperts::EnsureStream() {
  if (stream_ != nullptr) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                             "shared expert: cudaStreamCreateWithFlags"));
  for (cudaEvent_t* e : {&ready_, &start_, &end_}) {
    RETURN_IF_ERROR(CudaStatus(cudaEventCreate(e), "shared expert: cudaEventCreate"));
  }
  return absl::OkStatus();
}

absl::StatusOr<int64_t> GpuSharedExperts::Load(int layer, std::optional<core::SharedExpert> shared,
                                               int64_t other_bytes, int64_t memory_cap_bytes) {
  if (!shared.has_value()) {
    layers_.erase(layer);
    return 0;
  }
  if (shared->hidden() != hidden_) {
    return absl::InvalidArgumentError(absl::StrCat("LoadSharedExpert: shared expert H ",
                                                   shared->hidden(),
                                                   " differs from the workspace's ", hidden_));
  }
  RETURN_IF_ERROR(EnsureStream());
  // Weights of the other layers, plus the scratch the runner will hold.
  int64_t others = other_bytes;
  for (const auto& [l, s] : layers_) {
    if (l != layer) others += s->weight_bytes();
  }
  const int64_t inter = shared->intermediate();
  std::unique_ptr<SharedExpertRunner> grown;
  if (runner_ == nullptr || inter > runner_->max_intermediate()) {
    const int64_t max_i = std::max(inter, runner_ ? runner_->max_intermediate() : int64_t{0});
    ASSIGN_OR_RETURN(grown, SharedExpertRunner::Create(max_tokens_, hidden_, max_i));
  }
  const int64_t scratch = grown ? grown->allocated_bytes() : runner_->allocated_bytes();
  const int64_t bytes = shared->weight_bytes();
  if (memory_cap_bytes > 0 && others + scratch + bytes > memory_cap_bytes) {
    return absl::ResourceExhaustedError(
        absl::StrCat("LoadExperts: layer ", layer, "'s shared expert needs ", bytes, " bytes and ",
                     scratch, " of scratch; with ", others, " held that exceeds the memory cap of ",
                     memory_cap_bytes, " bytes (--memory-cap-bytes)"));
  }
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceSharedExpert> device, DeviceSharedExpert::Upload(*shared));
  if (grown) runner_ = std::move(grown);
  layers_.insert_or_assign(layer, std::move(device));
  return bytes;
}

int64_t GpuSharedExperts::ScratchBytes() const { return runner_ ? runner_->allocated_bytes() : 0; }

absl::Status GpuSharedExperts::Begin(int layer, const uint16_t* hidden, int64_t num_tokens,
                                     cudaStream_t main) {
  auto it = layers_.find(layer);
  if (it == layers_.end() || runner_ == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("shared expert: layer ", layer, " has none loaded"));
  }
  RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(ready_, main), "shared expert: cudaEventRecord(inputs ready)"));
  RETURN_IF_ERROR(
      CudaStatus(cudaStreamWaitEvent(stream_, ready_, 0), "shared expert: cudaStreamWaitEvent"));
  RETURN_IF_ERROR(
      CudaStatus(cudaEventRecord(start_, stream_), "shared expert: cudaEventRecord(shared start)"));
  RETURN_IF_ERROR(runner_->Enqueue(*it->second, hidden, num_tokens, stream_));
  return CudaStatus(cudaEventRecord(end_, stream_), "shared expert: cudaEventRecord(shared end)");
}

absl::Status GpuSharedExperts::JoinInto(cudaStream_t main) {
  return CudaStatus(cudaStreamWaitEvent(main, end_, 0),
                    "shared expert: cudaStreamWaitEvent(shared end)");
}

absl::StatusOr<std::pair<int64_t, int64_t>> GpuSharedExperts::Times(
    cudaEvent_t dispatch_start, cudaEvent_t dispatch_end) const {
  float d_end = 0, s_start = 0, s_end = 0;  // ms after dispatch_start (may be negative)
  RETURN_IF_ERROR(CudaStatus(cudaEventElapsedTime(&d_end, dispatch_start, dispatch_end),
                             "shared expert: cudaEventElapsedTime"));
  RETURN_IF_ERROR(CudaStatus(cudaEventElapsedTime(&s_start, dispatch_start, start_),
                             "shared expert: cudaEventElapsedTime"));
  RETURN_IF_ERROR(CudaStatus(cudaEventElapsedTime(&s_end, dispatch_start, end_),
                             "shared expert: cudaEventElapsedTime"));
  const float overlap = std::max(0.0f, std::min(d_end, s_end) - std::max(0.0f, s_start));
  return std::make_pair(static_cast<int64_t>((s_end - s_start) * 1000.0f),
                        static_cast<int64_t>(overlap * 1000.0f));
}

}  // namespace moe_ep::kernels
