#pragma once

// The shared experts of the GPU data plane (DESIGN §7; issue 18): one
// device replica per layer, one SharedExpertRunner sized for the
// workspace's capacity and the largest shared I, and a CUDA stream of their
// own. Per Forward: Begin() makes the shared stream wait for the inputs on
// the main stream, then enqueues the shared expert there (events around
// it), so it runs while the dispatch does; JoinInto() makes the main stream
// wait for it before the combine, which adds output(). Times() measures the
// overlap after the step has synchronised.
// Not thread-safe; the owner makes the device current.

#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>

#include "absl/status/statusor.h"
#include "core/shared_expert.h"
#include "kernels/shared_expert.h"

namespace moe_ep::kernels {

class GpuSharedExperts {
 public:
  GpuSharedExperts() = default;
  ~GpuSharedExperts();
  GpuSharedExperts(const GpuSharedExperts&) = delete;
  GpuSharedExperts& operator=(const GpuSharedExperts&) = delete;

  // Drops every layer's shared expert and the runner; later Loads size the
  // runner for `max_tokens` tokens of hidden size `hidden`.
  void Reset(int64_t max_tokens, int64_t hidden);
  // Uploads `shared` for `layer` (nullopt drops it), growing the runner when
  // its I is larger. `other_bytes`: device bytes the plane holds besides the
  // shared experts; `memory_cap_bytes` (0 = none) bounds the total.
  // Errors: kInvalidArgument (H differs), kResourceExhausted, kInternal.
  // On error the layer keeps its previous shared expert.
  absl::StatusOr<int64_t> Load(int layer, std::optional<core::SharedExpert> shared,
                               int64_t other_bytes, int64_t memory_cap_bytes);
  bool Has(int layer) const { return layers_.contains(layer); }
  // The runner's scratch (the weights' bytes are the plane core's ledger,
  // DataPlane::SharedExpertBytes).
  int64_t ScratchBytes() const;

  // Enqueues `layer`'s shared expert for device `hidden` [T, H] after the
  // work already on `main` (REQUIRES: Has(layer)).
  absl::Status Begin(int layer, const uint16_t* hidden, int64_t num_tokens, cudaStream_t main);
  // Makes `main` wait for the last Begin's work.
  absl::Status JoinInto(cudaStream_t main);
  // Device [T, H] bf16 result of the last Begin.
  const uint16_t* output() const { return runner_->output(); }
  // After the step synchronised: {shared_us, overlap_us} where overlap is the
  // intersection of the shared expert's interval with [dispatch_start,
  // dispatch_end] (events on the main stream).
  absl::StatusOr<std::pair<int64_t, int64_t>> Times(cudaEvent_t dispatch_start,
                                                    cudaEvent_t dispatch_end) const;

 private:
  absl::Status EnsureStream();

  int64_t max_tokens_ = 0;
  int64_t hidden_ = 0;
  std::map<int, std::unique_ptr<DeviceSharedExpert>> layers_;
  std::unique_ptr<SharedExpertRunner> runner_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t ready_ = nullptr, start_ = nullptr, end_ = nullptr;
};

}  // namespace moe_ep::kernels
