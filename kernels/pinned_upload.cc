#include "kernels/pinned_upload.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/types/span.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {

using internal::CudaStatus;

absl::StatusOr<std::unique_ptr<PinnedUpload>> PinnedUpload::Create(int64_t slot_elements) {
  if (slot_elements < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("PinnedUpload: slot_elements: expected >= 1, got ", slot_elements));
  }
  std::unique_ptr<PinnedUpload> u(new PinnedUpload());
  u->slot_elements_ = slot_elements;
  RETURN_IF_ERROR(CudaStatus(
      cudaMallocHost(reinterpret_cast<void**>(&u->host_), 2 * slot_elements * sizeof(uint16_t)),
      absl::StrCat("cudaMallocHost(expert staging, ", 2 * slot_elements * sizeof(uint16_t),
                   " bytes)")));
  RETURN_IF_ERROR(CudaStatus(cudaStreamCreateWithFlags(&u->stream_, cudaStreamNonBlocking),
                             "cudaStreamCreateWithFlags(expert staging)"));
  for (cudaEvent_t& event : u->done_) {
    RETURN_IF_ERROR(CudaStatus(cudaEventCreateWithFlags(&event, cudaEventDisableTiming),
                               "cudaEventCreate(expert staging)"));
  }
  return u;
}

PinnedUpload::~PinnedUpload() {
  // The slots must not be freed under a copy still reading them.
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);
  for (cudaEvent_t event : done_) {
    if (event != nullptr) cudaEventDestroy(event);
  }
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (host_ != nullptr) cudaFreeHost(host_);
}

absl::Status PinnedUpload::Copy(const core::SafetensorsTensorView& view, int64_t elements,
                                uint16_t* dst) {
  const int64_t held =
      static_cast<int64_t>(view.data.size()) / core::SafetensorsDTypeSize(view.dtype);
  if (held != elements) {
    return absl::InvalidArgumentError(
        absl::StrCat("PinnedUpload: expected a tensor of ", elements, " elements, got ", held));
  }
  // Pieces of whole bf16 values: byte offsets and sizes are even.
  return Enqueue(elements * 2, reinterpret_cast<uint8_t*>(dst),
                 [&](int64_t begin, int64_t bytes, uint8_t* host) {
                   return core::SafetensorsToBf16(
                       view, begin / 2,
                       absl::MakeSpan(reinterpret_cast<uint16_t*>(host), bytes / 2));
                 });
}

absl::Status PinnedUpload::CopyBytes(absl::Span<const uint8_t> bytes, void* dst) {
  return Enqueue(static_cast<int64_t>(bytes.size()), static_cast<uint8_t*>(dst),
                 [&](int64_t begin, int64_t count, uint8_t* host) {
                   std::memcpy(host, bytes.data() + begin, count);
                   return absl::OkStatus();
                 });
}

absl::Status PinnedUpload::Enqueue(
    int64_t total, uint8_t* dst, absl::FunctionRef<absl::Status(int64_t, int64_t, uint8_t*)> fill) {
  const int64_t slot_bytes = slot_elements_ * static_cast<int64_t>(sizeof(uint16_t));
  for (int64_t begin = 0; begin < total; begin += slot_bytes) {
    const int slot = next_slot_;
    next_slot_ ^= 1;
    const int64_t count = std::min(slot_bytes, total - begin);
    auto* host = reinterpret_cast<uint8_t*>(host_ + slot * slot_elements_);
    // A never-recorded event is complete, so the first use of a slot does not wait.
    RETURN_IF_ERROR(CudaStatus(cudaEventSynchronize(done_[slot]), "cudaEventSynchronize"));
    RETURN_IF_ERROR(fill(begin, count, host));
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpyAsync(dst + begin, host, count, cudaMemcpyHostToDevice, stream_),
                   "cudaMemcpyAsync(expert weights to device)"));
    RETURN_IF_ERROR(CudaStatus(cudaEventRecord(done_[slot], stream_), "cudaEventRecord"));
  }
  return absl::OkStatus();
}

absl::Status PinnedUpload::Finish() {
  return CudaStatus(cudaStreamSynchronize(stream_), "cudaStreamSynchronize(expert staging)");
}

}  // namespace moe_ep::kernels
