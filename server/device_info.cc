#include "server/device_info.h"

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "core/host_memory.h"
#include "server/backend_selection.h"

#ifdef MOE_EP_HAVE_CUDA
#include "kernels/device_calls.h"
#endif

namespace moe_ep::server {

bool BuiltWithCuda() {
#ifdef MOE_EP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int VisibleGpuCount() {
#ifdef MOE_EP_HAVE_CUDA
  return kernels::VisibleDeviceCount();
#else
  return 0;
#endif
}

absl::StatusOr<DeviceInfo> DescribeGpu(int device) {
#ifdef MOE_EP_HAVE_CUDA
  const int count = VisibleGpuCount();
  if (device < 0 || device >= count) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected in [0, ", count, ") (visible CUDA devices), got ", device));
  }
  absl::StatusOr<kernels::DeviceProperties> props = kernels::QueryDevice(device);
  if (!props.ok()) return props.status();
  return DeviceInfo{props->name, props->total_memory_bytes};
#else
  return absl::FailedPreconditionError(
      absl::StrCat("device ", device, ": this worker was built without CUDA"));
#endif
}

DeviceInfo DescribeHost() {
  // In a pod the cgroup's limit, not the node's memory (issue 12 item 8).
  return DeviceInfo{"cpu",
                    core::TotalMemoryBytes(core::kDefaultCgroupRoot, core::PhysicalMemoryBytes())};
}

DeviceInfo DescribeBackendDevice(const std::string& backend, int device) {
  absl::StatusOr<std::string> resolved = ResolveBackend(backend, "auto");
  if (resolved.ok() && *resolved == "nccl") {
    absl::StatusOr<DeviceInfo> gpu = DescribeGpu(device);
    if (gpu.ok()) return *gpu;
  }
  return DescribeHost();
}

}  // namespace moe_ep::server
