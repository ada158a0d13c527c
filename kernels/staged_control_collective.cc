#include "kernels/staged_control_collective.h"

#include <cstring>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {

using internal::CudaStatus;

StagedControlCollective::StagedControlCollective(StreamCollective* stream) : stream_(stream) {}

StagedControlCollective::StagedControlCollective(std::unique_ptr<StreamCollective> owned)
    : owned_(std::move(owned)), stream_(owned_.get()) {}

StagedControlCollective::~StagedControlCollective() {
  cudaSetDevice(stream_->device());
  cudaFree(staging_);
  cudaFreeHost(host_staging_);
}

absl::Status StagedControlCollective::EnsureStaging(int64_t bytes) {
  RETURN_IF_ERROR(CudaStatus(cudaSetDevice(stream_->device()), "cudaSetDevice"));
  if (bytes <= staging_bytes_) return absl::OkStatus();
  cudaFree(staging_);
  cudaFreeHost(host_staging_);
  staging_ = nullptr;
  host_staging_ = nullptr;
  staging_bytes_ = 0;
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(&staging_, bytes), "cudaMalloc(control staging)"));
  RETURN_IF_ERROR(CudaStatus(cudaMallocHost(&host_staging_, bytes), "cudaMallocHost(staging)"));
  staging_bytes_ = bytes;
  return absl::OkStatus();
}

absl::Status StagedControlCollective::CopyIn(const void* host_src, int64_t bytes) {
  if (bytes == 0) return absl::OkStatus();
  return CudaStatus(
      cudaMemcpyAsync(staging_, host_src, bytes, cudaMemcpyHostToDevice, stream_->stream()),
      "cudaMemcpyAsync(host to control staging)");
}

absl::Status StagedControlCollective::CopyOutAndWait(void* host_dst, int64_t offset,
                                                     int64_t bytes) {
  // A device-to-pageable copy would block the host until the collective
  // finished (a hang if a peer is gone); pinned staging keeps the wait in
  // Synchronize(), which has the deadline.
  if (bytes > 0) {
    RETURN_IF_ERROR(CudaStatus(cudaMemcpyAsync(host_staging_, staging_ + offset, bytes,
                                               cudaMemcpyDeviceToHost, stream_->stream()),
                               "cudaMemcpyAsync(control staging to pinned)"));
  }
  RETURN_IF_ERROR(stream_->Synchronize());
  if (bytes > 0) std::memcpy(host_dst, host_staging_, bytes);
  return absl::OkStatus();
}

absl::Status StagedControlCollective::AllToAllV(const void* send,
                                                absl::Span<const int64_t> send_bytes, void* recv,
                                                absl::Span<const int64_t> recv_bytes) {
  int64_t send_total = 0;
  int64_t recv_total = 0;
  for (int64_t b : send_bytes) send_total += b > 0 ? b : 0;
  for (int64_t b : recv_bytes) recv_total += b > 0 ? b : 0;
  RETURN_IF_ERROR(EnsureStaging(send_total + recv_total));
  RETURN_IF_ERROR(CopyIn(send, send_total));
  RETURN_IF_ERROR(stream_->AllToAllV(staging_, send_bytes, staging_ + send_total, recv_bytes));
  return CopyOutAndWait(recv, send_total, recv_total);
}

absl::Status StagedControlCollective::AllGather(const void* send, int64_t bytes_per_rank,
                                                void* recv) {
  if (bytes_per_rank < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "AllGather on rank %d: bytes_per_rank expected >= 0, got %d", rank(), bytes_per_rank));
  }
  if (bytes_per_rank == 0) return absl::OkStatus();
  const int64_t recv_total = bytes_per_rank * size();
  RETURN_IF_ERROR(EnsureStaging(bytes_per_rank + recv_total));
  RETURN_IF_ERROR(CopyIn(send, bytes_per_rank));
  RETURN_IF_ERROR(stream_->AllGather(staging_, bytes_per_rank, staging_ + bytes_per_rank));
  return CopyOutAndWait(recv, bytes_per_rank, recv_total);
}

absl::Status StagedControlCollective::AllReduceSum(float* data, int64_t count) {
  if (count < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("AllReduceSum on rank %d: count expected >= 0, got %d", rank(), count));
  }
  if (count == 0) return absl::OkStatus();
  const int64_t bytes = count * static_cast<int64_t>(sizeof(float));
  RETURN_IF_ERROR(EnsureStaging(bytes));
  RETURN_IF_ERROR(CopyIn(data, bytes));
  RETURN_IF_ERROR(stream_->AllReduceSum(reinterpret_cast<float*>(staging_), count));
  return CopyOutAndWait(data, 0, bytes);
}

absl::Status StagedControlCollective::Barrier() {
  float one = 1.0f;
  return AllReduceSum(&one, 1);
}

absl::StatusOr<std::unique_ptr<core::ControlCollective>> StagedControlCollective::Split(
    absl::Span<const int> ranks, const std::string& tag) {
  ASSIGN_OR_RETURN(std::unique_ptr<StreamCollective> sub, stream_->Split(ranks, tag));
  return std::unique_ptr<core::ControlCollective>(new StagedControlCollective(std::move(sub)));
}

}  // namespace moe_ep::kernels
