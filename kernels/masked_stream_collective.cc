#include "kernels/masked_stream_collective.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {

MaskedStreamCollective::MaskedStreamCollective(std::unique_ptr<StreamCollective> inner, int rank,
                                               std::vector<bool> live)
    : inner_(std::move(inner)), rank_(rank), live_(std::move(live)) {
  for (int r = 0; r < static_cast<int>(live_.size()); ++r) {
    if (live_[r]) live_ranks_.push_back(r);
  }
}

MaskedStreamCollective::~MaskedStreamCollective() {
  if (capture_scratch_ != nullptr || grown_scratch_ != nullptr) {
    cudaSetDevice(inner_->device());
    cudaFree(capture_scratch_);
    cudaFree(grown_scratch_);
  }
}

absl::StatusOr<std::unique_ptr<MaskedStreamCollective>> MaskedStreamCollective::Create(
    std::unique_ptr<StreamCollective> inner, int rank, std::vector<bool> live,
    int64_t capture_gather_bytes) {
  if (inner == nullptr) return absl::InvalidArgumentError("MaskedStreamCollective: inner is null");
  if (capture_gather_bytes < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("MaskedStreamCollective: capture_gather_bytes expected >= 0, got %d",
                        capture_gather_bytes));
  }
  const int world = static_cast<int>(live.size());
  if (rank < 0 || rank >= world || !live[rank]) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "MaskedStreamCollective: rank %d must be live and in [0, %d)", rank, world));
  }
  const int live_count = static_cast<int>(std::count(live.begin(), live.end(), true));
  const int index = static_cast<int>(std::count(live.begin(), live.begin() + rank, true));
  if (inner->size() != live_count || inner->rank() != index) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "MaskedStreamCollective: the survivors' communicator has rank %d of %d, expected rank %d "
        "of %d (rank %d among the live ranks)",
        inner->rank(), inner->size(), index, live_count, rank));
  }
  std::unique_ptr<MaskedStreamCollective> masked(
      new MaskedStreamCollective(std::move(inner), rank, std::move(live)));
  const int64_t scratch = capture_gather_bytes * live_count;
  if (scratch > 0) {
    RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(masked->device()), "cudaSetDevice"));
    RETURN_IF_ERROR(internal::CudaStatus(
        cudaMalloc(&masked->capture_scratch_, scratch),
        absl::StrFormat("cudaMalloc(masked all-gather scratch, %d bytes)", scratch)));
    masked->capture_scratch_bytes_ = scratch;
  }
  return masked;
}

absl::Status MaskedStreamCollective::CheckPart(const char* call,
                                               absl::Span<const int64_t> send_bytes,
                                               absl::Span<const int64_t> recv_bytes) const {
  if (static_cast<int>(send_bytes.size()) != size() ||
      static_cast<int>(recv_bytes.size()) != size()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s on rank %d: expected %d send and receive counts, got %d and %d", call,
                        rank_, size(), send_bytes.size(), recv_bytes.size()));
  }
  for (int p = 0; p < size(); ++p) {
    if (send_bytes[p] < 0 || recv_bytes[p] < 0) {
      return absl::InvalidArgumentError(
          absl::StrFormat("%s on rank %d: negative count for peer %d (send %d, receive %d)", call,
                          rank_, p, send_bytes[p], recv_bytes[p]));
    }
  }
  return absl::OkStatus();
}

absl::Status MaskedStreamCollective::EchoMasked(const void* send,
                                                absl::Span<const int64_t> send_bytes, void* recv,
                                                absl::Span<const int64_t> recv_bytes) {
  int64_t send_off = 0;
  int64_t recv_off = 0;
  for (int p = 0; p < size(); ++p) {
    if (!live_[p] && recv_bytes[p] > 0) {
      char* dst = static_cast<char*>(recv) + recv_off;
      const int64_t copied = std::min(send_bytes[p], recv_bytes[p]);
      if (copied > 0) {
        RETURN_IF_ERROR(
            internal::CudaStatus(cudaMemcpyAsync(dst, static_cast<const char*>(send) + send_off,
                                                 copied, cudaMemcpyDeviceToDevice, stream()),
                                 "cudaMemcpyAsync(masked peer echo)"));
      }
      if (recv_bytes[p] > copied) {
        RETURN_IF_ERROR(
            internal::CudaStatus(cudaMemsetAsync(dst + copied, 0, recv_bytes[p] - copied, stream()),
                                 "cudaMemsetAsync(masked peer rows)"));
      }
    }
    send_off += send_bytes[p];
    recv_off += recv_bytes[p];
  }
  return absl::OkStatus();
}

absl::Status MaskedStreamCollective::GroupedAllToAllV(absl::Span<const AllToAllVPart> parts) {
  if (parts.empty()) {
    return absl::InvalidArgumentError(
        absl::StrFormat("GroupedAllToAllV on rank %d: no parts", rank_));
  }
  for (const AllToAllVPart& part : parts) {
    RETURN_IF_ERROR(CheckPart("GroupedAllToAllV", part.send_bytes, part.recv_bytes));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device()), "cudaSetDevice"));
  // A masked peer's bytes sit between live peers' in the caller's buffers,
  // while the inner all-to-all-v takes its peers' bytes back to back. So
  // each (part, live peer j) becomes an inner part with only entry j
  // non-zero, its pointers at peer j's bytes. The inner collective posts
  // non-zero counts only and matches a pair's parts in order, so the
  // transfers between two live ranks keep the caller's part order.
  const int live_count = static_cast<int>(live_ranks_.size());
  const size_t n = parts.size() * live_count;
  inner_send_.assign(n, std::vector<int64_t>(live_count, 0));
  inner_recv_.assign(n, std::vector<int64_t>(live_count, 0));
  std::vector<AllToAllVPart> inner_parts;
  inner_parts.reserve(n);
  for (size_t i = 0; i < parts.size(); ++i) {
    const AllToAllVPart& part = parts[i];
    int64_t send_off = 0;
    int64_t recv_off = 0;
    int j = 0;
    for (int p = 0; p < size(); ++p) {
      if (live_[p]) {
        const size_t k = i * live_count + j;
        inner_send_[k][j] = part.send_bytes[p];
        inner_recv_[k][j] = part.recv_bytes[p];
        inner_parts.push_back({static_cast<const char*>(part.send) + send_off, inner_send_[k],
                               static_cast<char*>(part.recv) + recv_off, inner_recv_[k]});
        ++j;
      }
      send_off += part.send_bytes[p];
      recv_off += part.recv_bytes[p];
    }
  }
  RETURN_IF_ERROR(inner_->GroupedAllToAllV(inner_parts));
  for (const AllToAllVPart& part : parts) {
    RETURN_IF_ERROR(EchoMasked(part.send, part.send_bytes, part.recv, part.recv_bytes));
  }
  return absl::OkStatus();
}

absl::Status MaskedStreamCollective::AllToAllV(const void* send,
                                               absl::Span<const int64_t> send_bytes, void* recv,
                                               absl::Span<const int64_t> recv_bytes) {
  const AllToAllVPart part{send, send_bytes, recv, recv_bytes};
  return GroupedAllToAllV(absl::MakeConstSpan(&part, 1));
}

absl::Status MaskedStreamCollective::AllGather(const void* send, int64_t bytes_per_rank,
                                               void* recv) {
  if (bytes_per_rank < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("AllGather on rank %d: bytes_per_rank %d < 0", rank_, bytes_per_rank));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device()), "cudaSetDevice"));
  const int64_t need = bytes_per_rank * static_cast<int64_t>(live_ranks_.size());
  void* scratch = capture_scratch_;
  if (need > capture_scratch_bytes_) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    RETURN_IF_ERROR(
        internal::CudaStatus(cudaStreamIsCapturing(stream(), &capture), "cudaStreamIsCapturing"));
    if (capture != cudaStreamCaptureStatusNone) {
      return absl::FailedPreconditionError(absl::StrFormat(
          "AllGather on rank %d: %d bytes per rank inside a CUDA graph capture, more than the %d "
          "the masked collective was created for (capture_gather_bytes); a capture cannot "
          "allocate",
          rank_, bytes_per_rank,
          capture_scratch_bytes_ / static_cast<int64_t>(live_ranks_.size())));
    }
    if (need > grown_scratch_bytes_) {
      // A step-boundary growth, never freeing the scratch a graph captured.
      RETURN_IF_ERROR(inner_->Synchronize());
      cudaFree(grown_scratch_);
      grown_scratch_ = nullptr;
      grown_scratch_bytes_ = 0;
      RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(&grown_scratch_, need),
                                           "cudaMalloc(masked all-gather scratch)"));
      grown_scratch_bytes_ = need;
    }
    scratch = grown_scratch_;
  }
  RETURN_IF_ERROR(inner_->AllGather(send, bytes_per_rank, scratch));
  RETURN_IF_ERROR(internal::CudaStatus(cudaMemsetAsync(recv, 0, bytes_per_rank * size(), stream()),
                                       "cudaMemsetAsync(gather)"));
  for (int j = 0; j < static_cast<int>(live_ranks_.size()); ++j) {
    RETURN_IF_ERROR(internal::CudaStatus(
        cudaMemcpyAsync(static_cast<char*>(recv) + live_ranks_[j] * bytes_per_rank,
                        static_cast<const char*>(scratch) + j * bytes_per_rank, bytes_per_rank,
                        cudaMemcpyDeviceToDevice, stream()),
        "cudaMemcpyAsync(gather row)"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<StreamCollective>> MaskedStreamCollective::Split(
    absl::Span<const int> ranks, const std::string& tag) {
  std::vector<int> inner_ranks;
  inner_ranks.reserve(ranks.size());
  for (const int r : ranks) {
    if (!IsLive(r)) {
      return absl::InvalidArgumentError(absl::StrFormat(
          "Split '%s' on rank %d: rank %d is masked (lost); split the live ranks only", tag, rank_,
          r));
    }
    inner_ranks.push_back(static_cast<int>(
        std::lower_bound(live_ranks_.begin(), live_ranks_.end(), r) - live_ranks_.begin()));
  }
  return inner_->Split(inner_ranks, tag);
}

}  // namespace moe_ep::kernels
