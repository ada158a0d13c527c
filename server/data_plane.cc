#include "server/data_plane.h"

#include "absl/strings/str_cat.h"
#include "server/cpu_data_plane.h"
#include "server/gpu_data_plane.h"

namespace moe_ep::server {

std::string NcclUniqueIdKey(int64_t generation) {
  return absl::StrCat("gen", generation, "/nccl_unique_id");
}

absl::StatusOr<std::unique_ptr<DataPlane>> FormDataPlane(
    const DataPlaneGroup& group, std::shared_ptr<gloo::rendezvous::Store> store) {
  if (group.backend == "gloo") {
    absl::StatusOr<std::unique_ptr<CpuDataPlane>> plane = CpuDataPlane::Form(group, store);
    if (!plane.ok()) return plane.status();
    return std::unique_ptr<DataPlane>(std::move(*plane));
  }
  if (group.backend == "nccl") {
#ifdef MOE_EP_HAVE_CUDA
    absl::StatusOr<std::unique_ptr<GpuDataPlane>> plane = GpuDataPlane::Form(group, store);
    if (!plane.ok()) return plane.status();
    return std::unique_ptr<DataPlane>(std::move(*plane));
#else
    return absl::FailedPreconditionError(
        "backend \"nccl\": NCCL backend needs a CUDA build; this worker was built without CUDA "
        "(use \"gloo\" or \"auto\")");
#endif
  }
  return absl::InvalidArgumentError(
      absl::StrCat("backend: expected \"gloo\" or \"nccl\", got \"", group.backend, "\""));
}

}  // namespace moe_ep::server
