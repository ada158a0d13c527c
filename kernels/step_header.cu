#include "absl/strings/str_format.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/route.cuh"
#include "kernels/step_header.cuh"

namespace moe_ep::kernels {
namespace {

__global__ void VerifyStepHeaderKernel(const int64_t* gathered, int ep_size, int64_t* header,
                                       int32_t* error_rank) {
  for (int r = 0; r < ep_size; ++r) {
    if (gathered[3 * r] != header[0] || gathered[3 * r + 1] != header[1]) {
      *error_rank = r + 1;
      header[2] = 0;
      return;
    }
  }
}

}  // namespace

absl::Status LaunchVerifyStepHeader(const int64_t* gathered, int ep_size, int64_t* header,
                                    int32_t* error_rank, cudaStream_t stream) {
  if (gathered == nullptr || header == nullptr || error_rank == nullptr) {
    return absl::InvalidArgumentError("LaunchVerifyStepHeader: null device pointer");
  }
  if (ep_size < 1 || ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchVerifyStepHeader: ep_size expected in [1, %d], got %d", kMaxEpSize, ep_size));
  }
  VerifyStepHeaderKernel<<<1, 1, 0, stream>>>(gathered, ep_size, header, error_rank);
  return internal::LaunchStatus("VerifyStepHeaderKernel");
}

}  // namespace moe_ep::kernels
