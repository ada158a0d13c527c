#pragma once

// Which data-plane backend a worker uses, and on which CUDA device
// (DESIGN §1, §8; issue 3: "--backend auto picks NCCL when the worker sees a
// GPU; --device selects it").
//
//   requested  build without CUDA        CUDA build, 0 GPUs visible   CUDA build, >= 1 GPU
//   "gloo"     gloo                      gloo                         gloo
//   "auto"     gloo                      gloo                         nccl
//   "nccl"     FAILED_PRECONDITION       FAILED_PRECONDITION          nccl
// An empty request means the worker's default (its --backend flag).
//
// Pure functions of their arguments except the overloads that ask the CUDA
// runtime how many devices it sees (server/device_info.h). Thread-safe.
// Source: DESIGN §1 (CUDA optional at build time), §8; issue 3.

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe_ep::server {

// Returns "gloo" or "nccl" for `requested` (or `default_backend` when
// `requested` is empty) on this build with `visible_gpus` CUDA devices.
// Errors:
//   kInvalidArgument    a name other than "auto", "gloo", "nccl" (named).
//   kFailedPrecondition "nccl" on a build without CUDA ("NCCL backend needs a
//                       CUDA build"), or with no visible CUDA device
//                       ("no CUDA device is visible").
absl::StatusOr<std::string> ResolveBackend(const std::string& requested,
                                           const std::string& default_backend, int visible_gpus);

// As above with visible_gpus = VisibleGpuCount() (0 on a build without CUDA).
absl::StatusOr<std::string> ResolveBackend(const std::string& requested,
                                           const std::string& default_backend);

// Checks the worker's --device flag for `backend` (a resolved name).
// Errors: kInvalidArgument for device < 0; kFailedPrecondition when backend
// is "nccl" and device >= visible_gpus (the message gives both and says to
// pick --device in [0, visible_gpus)). Gloo ignores the device.
absl::Status CheckDevice(int device, int visible_gpus, const std::string& backend);

}  // namespace moe_ep::server
