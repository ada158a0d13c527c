#pragma once

// What this worker computes on, as GetStatus reports it (DESIGN §8: device
// name and memory): the CUDA devices the runtime sees, or the host.
//
// On a build without CUDA (no MOE_EP_HAVE_CUDA) there are no GPUs: the count
// is 0 and DescribeGpu fails. Thread-safe. Source: DESIGN §8; issue 3.

#include <cstdint>
#include <string>

#include "absl/status/statusor.h"

namespace moe_ep::server {

struct DeviceInfo {
  std::string name;          // "cpu" or the GPU's name, e.g. "NVIDIA H200"
  int64_t memory_bytes = 0;  // physical memory of the host, or the GPU's global memory
};

// True when this binary was built with the CUDA data plane (kernels/).
bool BuiltWithCuda();

// Number of CUDA devices the runtime sees (cudaGetDeviceCount); 0 without a
// driver or device, and on a build without CUDA. Never fails.
int VisibleGpuCount();

// Name and global memory of CUDA device `device` (cudaGetDeviceProperties).
// Errors: kFailedPrecondition on a build without CUDA; kInvalidArgument when
// `device` is not in [0, VisibleGpuCount()); kUnavailable when the runtime
// call fails (its error string).
absl::StatusOr<DeviceInfo> DescribeGpu(int device);

// "cpu" and the memory this process may use: the smaller of the host's
// physical memory and its cgroup's limit (a pod's), 0 if unknown.
DeviceInfo DescribeHost();

// What GetStatus reports for `backend` ("auto" resolved as Join would):
// DescribeGpu(device) for NCCL, the host for Gloo (and when the device
// cannot be read).
DeviceInfo DescribeBackendDevice(const std::string& backend, int device);

}  // namespace moe_ep::server
