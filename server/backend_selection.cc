#include "server/backend_selection.h"

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "server/device_info.h"

namespace moe_ep::server {

absl::StatusOr<std::string> ResolveBackend(const std::string& requested,
                                           const std::string& default_backend, int visible_gpus) {
  const std::string name = requested.empty() ? default_backend : requested;
  if (name == "gloo") return std::string("gloo");
  if (name == "auto") {
    return std::string(BuiltWithCuda() && visible_gpus > 0 ? "nccl" : "gloo");
  }
  if (name == "nccl") {
    if (!BuiltWithCuda()) {
      return absl::FailedPreconditionError(
          "backend \"nccl\": NCCL backend needs a CUDA build; this worker was built without CUDA "
          "(use \"gloo\" or \"auto\")");
    }
    if (visible_gpus < 1) {
      return absl::FailedPreconditionError(
          "backend \"nccl\": no CUDA device is visible to this worker (cudaGetDeviceCount = 0; "
          "check the driver, CUDA_VISIBLE_DEVICES and the container's GPU request), or use "
          "\"gloo\" or \"auto\"");
    }
    return std::string("nccl");
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend: expected \"auto\", \"gloo\" or \"nccl\", got \"", name, "\""));
}

absl::StatusOr<std::string> ResolveBackend(const std::string& requested,
                                           const std::string& default_backend) {
  return ResolveBackend(requested, default_backend, VisibleGpuCount());
}

absl::Status CheckDevice(int device, int visible_gpus, const std::string& backend) {
  if (device < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("device: expected a CUDA device ordinal >= 0, got ", device));
  }
  if (backend == "nccl" && device >= visible_gpus) {
    return absl::FailedPreconditionError(absl::StrCat(
        "device: CUDA device ", device, " is not visible to this worker (", visible_gpus,
        " visible); start the worker with --device in [0, ", visible_gpus, ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> ResolveGpuDataPlane(const std::string& requested,
                                                const std::string& default_plane) {
  const std::string name = requested.empty() ? default_plane : requested;
  if (name == "auto" || name == "one-sided" || name == "nccl") return name;
  return absl::InvalidArgumentError(absl::StrCat(
      "gpu_data_plane: expected \"auto\", \"one-sided\" or \"nccl\", got \"", name, "\""));
}

const char* PlaneRequestName(PlaneRequest plane) {
  switch (plane) {
    case PlaneRequest::kGloo:
      return "gloo";
    case PlaneRequest::kNccl:
      return "nccl";
    case PlaneRequest::kOneSided:
      return "one-sided";
    case PlaneRequest::kGpuAuto:
      return "auto";
  }
  return "unknown";
}

absl::StatusOr<PlaneRequest> PlaneRequestOf(const std::string& backend,
                                            const std::string& gpu_data_plane) {
  if (backend == "gloo") return PlaneRequest::kGloo;
  if (backend != "nccl") {
    return absl::InvalidArgumentError(
        absl::StrCat("backend: expected \"gloo\" or \"nccl\", got \"", backend, "\""));
  }
  ASSIGN_OR_RETURN(const std::string name, ResolveGpuDataPlane(gpu_data_plane, "nccl"));
  if (name == "one-sided") return PlaneRequest::kOneSided;
  if (name == "auto") return PlaneRequest::kGpuAuto;
  return PlaneRequest::kNccl;
}

}  // namespace moe_ep::server
