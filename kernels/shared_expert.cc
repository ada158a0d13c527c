#include "kernels/shared_expert.h"

#include <algorithm>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels {

using internal::CudaStatus;

absl::StatusOr<std::unique_ptr<DeviceSharedExpert>> DeviceSharedExpert::Upload(
    const core::SharedExpert& shared) {
  std::unique_ptr<DeviceSharedExpert> d(new DeviceSharedExpert());
  ASSIGN_OR_RETURN(d->experts_, DeviceExpertSet::Upload(shared.experts()));
  if (shared.has_gate()) {
    const size_t bytes = shared.gate().size() * sizeof(uint16_t);
    RETURN_IF_ERROR(CudaStatus(cudaMalloc(reinterpret_cast<void**>(&d->gate_), bytes),
                               "cudaMalloc(shared expert gate)"));
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy(d->gate_, shared.gate().data(), bytes, cudaMemcpyHostToDevice),
                   "cudaMemcpy(shared expert gate)"));
  }
  return d;
}

DeviceSharedExpert::~DeviceSharedExpert() {
  if (gate_ != nullptr) cudaFree(gate_);
}

int64_t DeviceSharedExpert::weight_bytes() const {
  return experts_->weight_bytes() + (gate_ != nullptr ? hidden() * 2 : 0);
}

absl::StatusOr<std::unique_ptr<SharedExpertRunner>> SharedExpertRunner::Create(
    int64_t max_tokens, int64_t hidden, int64_t max_intermediate) {
  if (max_tokens < 0 || hidden < 4 || hidden % 4 != 0 || max_intermediate < 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "SharedExpertRunner: expected max_tokens >= 0, hidden a positive multiple of 4, "
        "max_intermediate >= 0; got %d, %d, %d",
        max_tokens, hidden, max_intermediate));
  }
  std::unique_ptr<SharedExpertRunner> r(new SharedExpertRunner());
  r->max_tokens_ = max_tokens;
  r->hidden_ = hidden;
  r->max_intermediate_ = max_intermediate;
  const int64_t rows = std::max<int64_t>(max_tokens, 1);
  ASSIGN_OR_RETURN(r->compute_, ExpertCompute::Create(rows, 1, hidden, max_intermediate, 1));
  RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(reinterpret_cast<void**>(&r->rows_), rows * (2 * hidden + 8)),
                 "cudaMalloc(shared expert rows)"));
  RETURN_IF_ERROR(CudaStatus(cudaMalloc(reinterpret_cast<void**>(&r->output_), rows * hidden * 2),
                             "cudaMalloc(shared expert output)"));
  return r;
}

SharedExpertRunner::~SharedExpertRunner() {
  if (rows_ != nullptr) cudaFree(rows_);
  if (output_ != nullptr) cudaFree(output_);
}

int64_t SharedExpertRunner::allocated_bytes() const {
  const int64_t rows = std::max<int64_t>(max_tokens_, 1);
  return compute_->allocated_bytes() + rows * (2 * hidden_ + 8) + rows * hidden_ * 2;
}

absl::Status SharedExpertRunner::Enqueue(const DeviceSharedExpert& shared, const uint16_t* hidden,
                                         int64_t num_tokens, cudaStream_t stream) {
  if (num_tokens < 0 || num_tokens > max_tokens_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shared expert: num_tokens expected in [0, %d], got %d", max_tokens_, num_tokens));
  }
  if (shared.hidden() != hidden_ || shared.intermediate() > max_intermediate_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("shared expert: H %d and I %d, the runner holds H %d and I <= %d",
                        shared.hidden(), shared.intermediate(), hidden_, max_intermediate_));
  }
  if (num_tokens == 0) return absl::OkStatus();
  RETURN_IF_ERROR(LaunchPackSharedRows(hidden, shared.gate(), num_tokens, hidden_, rows_, stream));
  return compute_->Run(rows_, num_tokens, shared.experts(), output_, stream);
}

}  // namespace moe_ep::kernels
