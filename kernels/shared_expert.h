#pragma once

// The shared expert on the GPU (DESIGN §7 "Shared experts"; issue 18): the
// replica of core::SharedExpert on the device, and the runner that computes
// bf16(g[t] * shared(x[t])) for this rank's own tokens on a stream of its
// own, so the data plane overlaps it with the dispatch and adds it at
// combine (kernels/combine_reduce.cuh, CombineReduceParams::shared).
//
// The runner packs the tokens as one-expert dispatch rows ([T, 2H + 8]:
// hidden, id 0, weight g[t] with g = sigmoid(gate . x) in fp32 or 1) and
// runs kernels::ExpertCompute with K = 1 on them, so the shared SwiGLU uses
// the same GEMMs (and rounding: act in bf16, fp32 accumulation) as the
// routed experts. Not thread-safe; owns its device memory.

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "core/shared_expert.h"
#include "kernels/device_experts.h"
#include "kernels/expert_compute.h"

namespace moe_ep::kernels {

class DeviceSharedExpert {
 public:
  // Copies `shared` (SwiGLU or identity, with its gate) to the current CUDA
  // device. Synchronous; not a step-path call.
  // Errors: kResourceExhausted (cudaMalloc), kInternal (copy).
  static absl::StatusOr<std::unique_ptr<DeviceSharedExpert>> Upload(
      const core::SharedExpert& shared);
  ~DeviceSharedExpert();
  DeviceSharedExpert(const DeviceSharedExpert&) = delete;
  DeviceSharedExpert& operator=(const DeviceSharedExpert&) = delete;

  const DeviceExpertSet& experts() const { return *experts_; }
  // Device [H] bf16, or null without a gate.
  const uint16_t* gate() const { return gate_; }
  int64_t hidden() const { return experts_->hidden(); }
  int64_t intermediate() const { return experts_->intermediate(); }
  // Device bytes held (weights and gate).
  int64_t weight_bytes() const;

 private:
  DeviceSharedExpert() = default;
  std::unique_ptr<DeviceExpertSet> experts_;
  uint16_t* gate_ = nullptr;
};

class SharedExpertRunner {
 public:
  // Scratch for up to `max_tokens` tokens of hidden size `hidden` and shared
  // SwiGLUs of I <= `max_intermediate` (0: identity only), on the current
  // device. Errors: kInvalidArgument (sizes < 0, H not a multiple of 4),
  // kResourceExhausted (cudaMalloc), kInternal.
  static absl::StatusOr<std::unique_ptr<SharedExpertRunner>> Create(int64_t max_tokens,
                                                                    int64_t hidden,
                                                                    int64_t max_intermediate);
  ~SharedExpertRunner();
  SharedExpertRunner(const SharedExpertRunner&) = delete;
  SharedExpertRunner& operator=(const SharedExpertRunner&) = delete;

  // Enqueues on `stream`: output()[t] = bf16(g[t] * shared(x[t])) for the
  // `num_tokens` rows of device `hidden` [T, H] bf16. Never synchronises.
  // Errors: kInvalidArgument (T outside [0, max_tokens], H differs, I >
  // max_intermediate), kInternal (launch).
  absl::Status Enqueue(const DeviceSharedExpert& shared, const uint16_t* hidden, int64_t num_tokens,
                       cudaStream_t stream);
  // Device [max_tokens, H] bf16; rows [0, T) hold the last Enqueue's result
  // once it has run.
  const uint16_t* output() const { return output_; }
  int64_t max_tokens() const { return max_tokens_; }
  int64_t max_intermediate() const { return max_intermediate_; }
  // Device bytes of scratch held.
  int64_t allocated_bytes() const;

 private:
  SharedExpertRunner() = default;
  int64_t max_tokens_ = 0;
  int64_t hidden_ = 0;
  int64_t max_intermediate_ = 0;
  std::unique_ptr<ExpertCompute> compute_;
  uint8_t* rows_ = nullptr;     // [max_tokens, 2H + 8]
  uint16_t* output_ = nullptr;  // [max_tokens, H]
};

// Enqueues the packing of SharedExpertRunner: rows[t] = (x[t] bf16 [H],
// id 0 int32, g[t] fp32) for t < T, g[t] = sigmoid(sum_h gate[h] * x[t, h])
// (fp32, block reduction) or 1 when `gate` is null. Errors: kInternal
// (launch). Exposed for tests.
absl::Status LaunchPackSharedRows(const uint16_t* hidden, const uint16_t* gate, int64_t num_tokens,
                                  int64_t hidden_size, uint8_t* rows, cudaStream_t stream);

}  // namespace moe_ep::kernels
