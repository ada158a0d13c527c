#pragma once

// Conversions of CUDA and NCCL return codes to absl::Status, shared by
// the files of kernels/ (STYLE §3: every CUDA/NCCL return is checked and its
// text carried in the Status). Header-only; not part of the public API.

#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"
#include "kernels/cuda_status.h"

namespace moe_ep::kernels::internal {

// kernels/cuda_status.h's rule (kResourceExhausted for allocation, else
// kInternal, with the runtime's text).
using kernels::CudaStatus;

// The status of the last kernel launch on this thread; the message is
// built only on failure (a launch on the step path allocates nothing here).
inline absl::Status LaunchStatus(absl::string_view kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return absl::OkStatus();
  return CudaStatus(err, absl::StrCat("launch of ", kernel));
}

}  // namespace moe_ep::kernels::internal
