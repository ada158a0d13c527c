#include "kernels/step_staging.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "core/workspace.h"
#include "kernels/cuda_status.h"
#include "kernels/gpu_ep_dispatcher.h"

namespace moe_ep::kernels {
namespace {
// The pinned mirror's tail: a step's counts, [2, kMaxEpSize] int32.
constexpr int64_t kCountsBytes = 2 * kMaxEpSize * sizeof(int32_t);
}  // namespace

int64_t StepStaging::Bytes(int64_t capacity, int64_t hidden, int top_k) {
  return 2 * core::AlignTo128(capacity * hidden * 2) + 2 * core::AlignTo128(capacity * top_k * 4);
}

absl::StatusOr<std::unique_ptr<StepStaging>> StepStaging::Create(int64_t capacity, int64_t hidden,
                                                                 int top_k, Options options) {
  std::unique_ptr<StepStaging> s(new StepStaging());
  const int64_t hidden_bytes = core::AlignTo128(capacity * hidden * 2);
  const int64_t k_bytes = core::AlignTo128(capacity * top_k * 4);
  s->offsets_ = {0, hidden_bytes, hidden_bytes + k_bytes, hidden_bytes + 2 * k_bytes};
  s->bytes_ = Bytes(capacity, hidden, top_k);
  s->hidden_size_ = hidden;
  s->top_k_ = top_k;
  s->device_ = options.device;
  if (s->device_ == nullptr) {
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(&s->owned_device_, s->bytes_),
                               absl::StrCat("cudaMalloc(step staging, ", s->bytes_, " bytes)")));
    s->device_ = s->owned_device_;
  }
  if (options.pinned_host) {
    s->host_bytes_ = s->bytes_ + kCountsBytes;
    RETURN_IF_ERROR(
        CudaStatus(cudaMallocHost(&s->host_, s->host_bytes_),
                   absl::StrCat("cudaMallocHost(step staging, ", s->host_bytes_, " bytes)")));
  }
  return s;
}

StepStaging::~StepStaging() {
  cudaFree(owned_device_);
  cudaFreeHost(host_);
}

int32_t* StepStaging::host_counts() const {
  if (host_ == nullptr) return nullptr;
  return reinterpret_cast<int32_t*>(static_cast<char*>(host_) + host_bytes_ - kCountsBytes);
}

absl::Status StepStaging::Upload(const uint16_t* hidden, const int32_t* topk_ids,
                                 const float* topk_weights, int64_t num_tokens,
                                 cudaStream_t stream) const {
  if (num_tokens <= 0) return absl::OkStatus();
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(this->hidden(), hidden, num_tokens * hidden_size_ * 2,
                                             cudaMemcpyHostToDevice, stream),
                             "cudaMemcpyAsync(hidden to device)"));
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(this->topk_ids(), topk_ids, num_tokens * top_k_ * 4,
                                             cudaMemcpyHostToDevice, stream),
                             "cudaMemcpyAsync(topk_ids to device)"));
  return CudaStatus(cudaMemcpyAsync(this->topk_weights(), topk_weights, num_tokens * top_k_ * 4,
                                    cudaMemcpyHostToDevice, stream),
                    "cudaMemcpyAsync(topk_weights to device)");
}

absl::StatusOr<int64_t> DeviceTokensSent(const int32_t* send_counts, int members,
                                         cudaStream_t stream) {
  std::vector<int32_t> counts(members);
  RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(counts.data(), send_counts, members * sizeof(int32_t),
                                             cudaMemcpyDeviceToHost, stream),
                             "cudaMemcpyAsync(send counts to host)"));
  RETURN_IF_ERROR(CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));
  int64_t sent = 0;
  for (const int32_t c : counts) sent += c;
  return sent;
}

}  // namespace moe_ep::kernels
