#pragma once

// One GPU step's device buffers and the device count a Benchmark step reads
// (DESIGN §17: CUDA calls live in kernels/; issue 34 items 1 and 3). Both
// GPU transports stage Forward through StepStaging (server/gpu_data_plane.h,
// server/onesided_data_plane.h) and time Benchmark steps over it. Only on a
// CUDA build. Source: DESIGN §10, §13, §17.

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe_ep::kernels {

// StepStaging
//
// One step's inputs and output on the device, for N rows: Forward's staging
// on both GPU transports and the Benchmark step's buffers (one class, DESIGN
// §17; issue 34 item 1). One device block of four 128-byte-aligned parts:
// hidden [N, H] bf16, topk_ids [N, K] int32, topk_weights [N, K] fp32,
// output [N, H] bf16; allocated here, or bound to device memory the caller
// owns (the NCCL dispatcher's tail, so its workspace is one allocation).
// Optionally a pinned host mirror of the same four parts followed by a
// step's counts [2, kMaxEpSize] int32 (the NCCL plane's host copies, DESIGN
// §10). Frees what it allocated on destruction. Not thread-safe.
class StepStaging {
 public:
  struct Options {
    // Null: allocate the device block here (cudaMalloc on the current
    // device). Else Bytes() bytes of 128-byte-aligned device memory that
    // outlives this object (Rebind moves it).
    void* device = nullptr;
    bool pinned_host = false;  // also the pinned host mirror and counts
  };
  // Errors: kResourceExhausted (cudaMalloc / cudaMallocHost, with the
  // bytes), kInternal.
  static absl::StatusOr<std::unique_ptr<StepStaging>> Create(int64_t capacity, int64_t hidden,
                                                             int top_k, Options options);
  static absl::StatusOr<std::unique_ptr<StepStaging>> Create(int64_t capacity, int64_t hidden,
                                                             int top_k) {
    return Create(capacity, hidden, top_k, Options());
  }
  // The device block's bytes for these sizes:
  // 2 * AlignTo128(N * H * 2) + 2 * AlignTo128(N * K * 4).
  static int64_t Bytes(int64_t capacity, int64_t hidden, int top_k);
  ~StepStaging();
  StepStaging(const StepStaging&) = delete;
  StepStaging& operator=(const StepStaging&) = delete;

  // The device parts.
  uint16_t* hidden() const { return Part<uint16_t>(device_, 0); }
  int32_t* topk_ids() const { return Part<int32_t>(device_, 1); }
  float* topk_weights() const { return Part<float>(device_, 2); }
  uint16_t* output() const { return Part<uint16_t>(device_, 3); }
  // The pinned mirror's parts (null without Options::pinned_host).
  void* host_hidden() const { return Part<char>(host_, 0); }
  void* host_topk_ids() const { return Part<char>(host_, 1); }
  void* host_topk_weights() const { return Part<char>(host_, 2); }
  void* host_output() const { return Part<char>(host_, 3); }
  // Pinned [2, kMaxEpSize] int32 for a step's counts (null without the mirror).
  int32_t* host_counts() const;
  // Bytes() for this object's sizes (the device block, allocated here or not).
  int64_t bytes() const { return bytes_; }
  // Moves a bound device block to `device` (a grown dispatcher's tail);
  // nothing when the block was allocated here.
  void Rebind(void* device) {
    if (owned_device_ == nullptr) device_ = device;
  }

  // Enqueues on `stream` the copies of `num_tokens` rows of host inputs
  // ([T, H] bf16, [T, K] int32, [T, K] fp32; pageable: each call returns once
  // its bytes are staged). Errors: kInternal (CUDA), naming the tensor.
  absl::Status Upload(const uint16_t* hidden, const int32_t* topk_ids, const float* topk_weights,
                      int64_t num_tokens, cudaStream_t stream) const;

 private:
  StepStaging() = default;
  template <typename T>
  T* Part(void* base, int i) const {
    return base == nullptr ? nullptr : reinterpret_cast<T*>(static_cast<char*>(base) + offsets_[i]);
  }
  std::array<int64_t, 4> offsets_ = {0, 0, 0, 0};
  int64_t bytes_ = 0;
  int64_t host_bytes_ = 0;
  int64_t hidden_size_ = 0;
  int top_k_ = 0;
  void* device_ = nullptr;
  void* owned_device_ = nullptr;  // device_ when Create allocated it
  void* host_ = nullptr;
};

// DeviceTokensSent()
//
// The token copies the last step on `stream` sent, summed from a
// dispatcher's device send counts `send_counts` [members] int32 (each token
// once per distinct destination rank, as core::ComputeDispatchRoute counts
// it): Benchmark reads the route the device took, as Forward does, instead
// of routing again on the host (issue 32 item 2). Waits for `stream`.
// Errors: kInternal (CUDA).
absl::StatusOr<int64_t> DeviceTokensSent(const int32_t* send_counts, int members,
                                         cudaStream_t stream);

}  // namespace moe_ep::kernels
