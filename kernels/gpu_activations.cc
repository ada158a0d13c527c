#include "kernels/gpu_activations.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {
namespace {

constexpr int64_t kFloatBytes = static_cast<int64_t>(sizeof(float));

absl::Status CheckDevice(int device) {
  int n = 0;
  RETURN_IF_ERROR(internal::CudaStatus(cudaGetDeviceCount(&n), "cudaGetDeviceCount"));
  if (device < 0 || device >= n) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected in [0, ", n, "), got ", device));
  }
  return internal::CudaStatus(cudaSetDevice(device), "cudaSetDevice");
}

// Synchronous copy of `count` floats; nothing for zero.
absl::Status CopySync(float* dst, const float* src, size_t count, cudaMemcpyKind kind,
                      const char* what) {
  if (count == 0) return absl::OkStatus();
  return internal::CudaStatus(cudaMemcpy(dst, src, count * sizeof(float), kind), what);
}

}  // namespace

// ---------------------------------------------------------------------------
// DeviceRmsNorm

absl::StatusOr<std::unique_ptr<DeviceRmsNorm>> DeviceRmsNorm::Upload(const core::RmsNorm& norm,
                                                                     int device) {
  RETURN_IF_ERROR(CheckDevice(device));
  std::unique_ptr<DeviceRmsNorm> d(new DeviceRmsNorm());
  d->device_ = device;
  d->hidden_ = norm.hidden();
  d->eps_ = norm.eps();
  const int64_t bytes = d->hidden_ * kFloatBytes;
  RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(&d->weight_, bytes), "cudaMalloc(norm weight)"));
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMemcpy(d->weight_, norm.weight().data(), bytes, cudaMemcpyHostToDevice),
      "cudaMemcpy(norm weight)"));
  // Land the copy before any non-blocking stream reads the weight.
  RETURN_IF_ERROR(internal::CudaStatus(cudaStreamSynchronize(cudaStreamLegacy),
                                       "cudaStreamSynchronize(norm weight)"));
  return d;
}

DeviceRmsNorm::~DeviceRmsNorm() {
  if (weight_ != nullptr) {
    cudaSetDevice(device_);
    cudaFree(weight_);
  }
}

// ---------------------------------------------------------------------------
// GpuLayerActivations

absl::StatusOr<std::unique_ptr<GpuLayerActivations>> GpuLayerActivations::Create(
    int device, int64_t capacity_rows, int64_t hidden) {
  if (capacity_rows < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("capacity_rows: expected >= 0, got ", capacity_rows));
  }
  if (hidden < 1)
    return absl::InvalidArgumentError(absl::StrCat("hidden: expected >= 1, got ", hidden));
  RETURN_IF_ERROR(CheckDevice(device));
  std::unique_ptr<GpuLayerActivations> a(new GpuLayerActivations());
  a->device_ = device;
  a->capacity_rows_ = capacity_rows;
  a->hidden_size_ = hidden;
  // At least one row, so every buffer is a real device pointer even for a
  // rank with zero tokens (collectives tell device from host memory by it).
  const int64_t bytes = std::max<int64_t>(capacity_rows, 1) * hidden * kFloatBytes;
  for (float** p : {&a->hidden_, &a->residual_, &a->scratch_}) {
    RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(p, bytes),
                                         absl::StrCat("cudaMalloc(activations, ", bytes, " B)")));
  }
  return a;
}

GpuLayerActivations::~GpuLayerActivations() {
  cudaSetDevice(device_);
  cudaFree(hidden_);
  cudaFree(residual_);
  cudaFree(scratch_);
}

absl::Status GpuLayerActivations::SetRows(int64_t hidden_rows, int64_t residual_rows) {
  if (hidden_rows < 0 || hidden_rows > capacity_rows_ || residual_rows > capacity_rows_) {
    return absl::InvalidArgumentError(
        absl::StrCat("SetRows: hidden_rows ", hidden_rows, " and residual_rows ", residual_rows,
                     " must be in [0, capacity_rows ", capacity_rows_, "] (residual < 0 = none)"));
  }
  hidden_rows_ = hidden_rows;
  has_residual_ = residual_rows >= 0;
  residual_rows_ = has_residual_ ? residual_rows : 0;
  return absl::OkStatus();
}

absl::Status GpuLayerActivations::Upload(const core::LayerActivations& host) {
  const int64_t h = hidden_size_;
  auto rows_of = [&](const std::vector<float>& v, const char* name) -> absl::StatusOr<int64_t> {
    const int64_t n = static_cast<int64_t>(v.size());
    if (n % h != 0 || n / h > capacity_rows_) {
      return absl::InvalidArgumentError(absl::StrCat("Upload: ", name, " has ", n,
                                                     " floats: expected a multiple of H ", h,
                                                     " and at most ", capacity_rows_, " rows"));
    }
    return n / h;
  };
  ASSIGN_OR_RETURN(const int64_t hidden_rows, rows_of(host.hidden, "hidden"));
  int64_t residual_rows = -1;
  if (host.residual.has_value()) {
    ASSIGN_OR_RETURN(residual_rows, rows_of(*host.residual, "residual"));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  RETURN_IF_ERROR(CopySync(hidden_, host.hidden.data(), host.hidden.size(), cudaMemcpyHostToDevice,
                           "cudaMemcpy(upload hidden)"));
  if (residual_rows >= 0) {
    RETURN_IF_ERROR(CopySync(residual_, host.residual->data(), host.residual->size(),
                             cudaMemcpyHostToDevice, "cudaMemcpy(upload residual)"));
  }
  // cudaMemcpy from pageable memory may return before its DMA lands, ordered
  // only on the legacy stream; the steps run on non-blocking streams.
  RETURN_IF_ERROR(internal::CudaStatus(cudaStreamSynchronize(cudaStreamLegacy),
                                       "cudaStreamSynchronize(upload)"));
  return SetRows(hidden_rows, residual_rows);
}

absl::StatusOr<core::LayerActivations> GpuLayerActivations::Download() const {
  RETURN_IF_ERROR(internal::CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  core::LayerActivations out;
  out.hidden.resize(hidden_rows_ * hidden_size_);
  RETURN_IF_ERROR(CopySync(out.hidden.data(), hidden_, out.hidden.size(), cudaMemcpyDeviceToHost,
                           "cudaMemcpy(download hidden)"));
  if (has_residual_) {
    out.residual.emplace(residual_rows_ * hidden_size_);
    RETURN_IF_ERROR(CopySync(out.residual->data(), residual_, out.residual->size(),
                             cudaMemcpyDeviceToHost, "cudaMemcpy(download residual)"));
  }
  return out;
}

}  // namespace moe_ep::kernels
