#pragma once

// Device tensors of the layer communicator (DESIGN §3; issue 4, issue 11):
// the RMSNorm parameters on a device and one rank's token tensors between
// steps (core::LayerActivations on a device). kernels::DeviceStepExecutor
// (kernels/device_step_executor.h) runs step programs on them.

#include <cstdint>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/rms_norm.h"
#include "core/step_executor.h"

namespace moe_ep::kernels {

// The RMSNorm parameters on a device: weight [H] fp32 and eps.
class DeviceRmsNorm {
 public:
  // Copies `norm`'s weight to `device` (synchronous; setup time).
  // Errors: kInvalidArgument for a bad device; kResourceExhausted / kInternal
  // from CUDA.
  static absl::StatusOr<std::unique_ptr<DeviceRmsNorm>> Upload(const core::RmsNorm& norm,
                                                               int device);
  ~DeviceRmsNorm();
  DeviceRmsNorm(const DeviceRmsNorm&) = delete;
  DeviceRmsNorm& operator=(const DeviceRmsNorm&) = delete;

  const float* weight() const { return weight_; }
  float eps() const { return eps_; }
  int64_t hidden() const { return hidden_; }
  int device() const { return device_; }

 private:
  DeviceRmsNorm() = default;
  float* weight_ = nullptr;
  float eps_ = 0.0f;
  int64_t hidden_ = 0;
  int device_ = 0;
};

// The token tensors of one rank between steps (core::LayerActivations on a
// device): hidden [hidden_rows, H], an optional residual [residual_rows, H],
// and a scratch buffer the steps use, each with room for capacity_rows rows.
// The steps swap buffers, so hidden() and residual() may change after a step.
class GpuLayerActivations {
 public:
  // Allocates three buffers of max(capacity_rows, 1) * H floats on `device`.
  // capacity_rows must cover the most rows any step of the plans used with it
  // touches: dp.global_rows when a plan has a FULL mode, else dp.local_rows.
  // Starts with hidden_rows 0 and no residual.
  // Errors: kInvalidArgument for capacity_rows < 0, H < 1, a bad device;
  // kResourceExhausted when cudaMalloc fails.
  static absl::StatusOr<std::unique_ptr<GpuLayerActivations>> Create(int device,
                                                                     int64_t capacity_rows,
                                                                     int64_t hidden);
  ~GpuLayerActivations();
  GpuLayerActivations(const GpuLayerActivations&) = delete;
  GpuLayerActivations& operator=(const GpuLayerActivations&) = delete;

  int device() const { return device_; }
  int64_t capacity_rows() const { return capacity_rows_; }
  int64_t hidden_size() const { return hidden_size_; }
  float* hidden() const { return hidden_; }
  int64_t hidden_rows() const { return hidden_rows_; }
  // Null when there is no residual.
  float* residual() const { return has_residual_ ? residual_ : nullptr; }
  bool has_residual() const { return has_residual_; }
  int64_t residual_rows() const { return has_residual_ ? residual_rows_ : 0; }

  // Declares what the buffers hold after the caller wrote them on a stream
  // (e.g. the attention output into hidden()). residual_rows < 0 = none.
  // Errors: kInvalidArgument when a count is < 0 (hidden) or > capacity.
  absl::Status SetRows(int64_t hidden_rows, int64_t residual_rows);

  // Synchronous copies between `host` and the buffers (cudaMemcpy), for setup
  // and checks. REQUIRES: the stream that last wrote the buffers has finished
  // (the executor's stream). Rows = vector size / H.
  // Errors: kInvalidArgument when a size is not a multiple of H or exceeds
  // the capacity; kInternal from CUDA.
  absl::Status Upload(const core::LayerActivations& host);
  absl::StatusOr<core::LayerActivations> Download() const;

 private:
  friend class DeviceStepExecutor;
  GpuLayerActivations() = default;

  int device_ = 0;
  int64_t capacity_rows_ = 0;
  int64_t hidden_size_ = 0;
  float* hidden_ = nullptr;
  float* residual_ = nullptr;
  float* scratch_ = nullptr;
  int64_t hidden_rows_ = 0;
  int64_t residual_rows_ = 0;
  bool has_residual_ = false;
};

}  // namespace moe_ep::kernels
