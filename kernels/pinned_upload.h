#pragma once

// Host-to-device copy of safetensors tensors through a bounded pinned buffer
// (issue 10 item 6): each tensor is decoded to bf16 (core::SafetensorsToBf16)
// in pieces into one of two pinned slots and copied from there on a stream of
// this object's own while the other slot fills, so a loader never holds more
// host memory than the two slots, whatever it uploads. Used by
// kernels::DeviceExpertSet::Load. Not thread-safe; owns its pinned memory,
// stream and events (freed on destruction, after the stream drained).

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/functional/function_ref.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/safetensors.h"

namespace moe_ep::kernels {

class PinnedUpload {
 public:
  // Two pinned slots of `slot_elements` bf16 each (2 * slot_elements * 2
  // bytes) and a non-blocking stream on the current device.
  // Errors: kInvalidArgument (slot_elements < 1), kResourceExhausted
  // (cudaMallocHost), kInternal (stream or event creation).
  static absl::StatusOr<std::unique_ptr<PinnedUpload>> Create(int64_t slot_elements);
  ~PinnedUpload();
  PinnedUpload(const PinnedUpload&) = delete;
  PinnedUpload& operator=(const PinnedUpload&) = delete;

  // Enqueues the copy of `view` as bf16 into device `dst` [elements]: for
  // each piece of at most slot_elements, waits until the slot's previous copy
  // is done, decodes the piece into it and enqueues its cudaMemcpyAsync.
  // The view's bytes are all read when this returns (its file pages may be
  // released); the device copy may still run (Finish waits).
  // Errors: kInvalidArgument (the view does not hold `elements` elements),
  // kInternal (copy or event).
  absl::Status Copy(const core::SafetensorsTensorView& view, int64_t elements, uint16_t* dst);
  // Enqueues the copy of `bytes` unchanged to device `dst` in pieces of at
  // most one slot (2 * slot_elements bytes), as Copy: fp8 codes and their
  // F32 scales go to the GPU as the file stores them (issue 35 item 2; a
  // little-endian host). `bytes` is all read when this returns.
  // Errors: kInternal (copy or event).
  absl::Status CopyBytes(absl::Span<const uint8_t> bytes, void* dst);
  // Waits for every copy enqueued. Errors: kInternal (a copy failed).
  absl::Status Finish();
  // Pinned bytes held (both slots).
  int64_t pinned_bytes() const { return 2 * slot_elements_ * 2; }

 private:
  PinnedUpload() = default;
  // The loop of Copy and CopyBytes: `total` bytes to device `dst` in pieces
  // of at most one slot, each filled by fill(first byte, bytes, slot) once the
  // slot's previous copy is done, then copied on the stream.
  absl::Status Enqueue(int64_t total, uint8_t* dst,
                       absl::FunctionRef<absl::Status(int64_t, int64_t, uint8_t*)> fill);
  int64_t slot_elements_ = 0;
  uint16_t* host_ = nullptr;  // [2, slot_elements] pinned
  cudaStream_t stream_ = nullptr;
  cudaEvent_t done_[2] = {nullptr, nullptr};  // recorded after each slot's last copy
  int next_slot_ = 0;
};

}  // namespace moe_ep::kernels
