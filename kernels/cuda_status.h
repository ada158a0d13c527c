#pragma once

// A CUDA runtime return code as an absl::Status, for every layer that calls
// the runtime (kernels/, and server/'s GPU planes): one rule for the code
// and the text (STYLE §3, issue 34 item 1). Header-only.

#include <cuda_runtime.h>

#include <string>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/string_view.h"

namespace moe_ep::kernels {

// CudaStatus()
//
// OK for cudaSuccess; else "<what>: <cudaGetErrorString>" as
// kResourceExhausted for cudaErrorMemoryAllocation and kInternal for the
// rest. A failure also clears the thread's last error (cudaGetLastError), so
// a later launch check does not report this call's error again (a sticky
// error stays: the runtime keeps it). Thread-safe. `what` is a view: a
// success, every call on the step path, builds no string (issue 30's host
// time).
inline absl::Status CudaStatus(cudaError_t err, absl::string_view what) {
  if (err == cudaSuccess) return absl::OkStatus();
  cudaGetLastError();
  const std::string msg = absl::StrCat(what, ": ", cudaGetErrorString(err));
  if (err == cudaErrorMemoryAllocation) return absl::ResourceExhaustedError(msg);
  return absl::InternalError(msg);
}

}  // namespace moe_ep::kernels
