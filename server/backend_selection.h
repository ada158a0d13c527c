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

// The GPU data plane a Join asks for (DESIGN §13; issue 15 item 5), for the
// "nccl" backend: "one-sided" (kernels storing into CUDA IPC peer windows,
// server/onesided_data_plane.h), "nccl" (NCCL grouped send/recv,
// server/gpu_data_plane.h) or "auto" (one-sided where every rank can map
// every peer's window, else nccl: decided when the group forms, the same on
// every rank). Returns `requested`, or `default_plane` when it is empty.
// Errors: kInvalidArgument for another name (named, with the three
// accepted). Pure.
absl::StatusOr<std::string> ResolveGpuDataPlane(const std::string& requested,
                                                const std::string& default_plane);

// The data plane a group asks for (DESIGN §13, §17; issue 34 item 1): one
// field of server::DataPlaneGroup, as NCCL EP takes the kind in its one
// config struct, instead of Join's two names. kGpuAuto: the one-sided plane
// where every rank can map every peer's window, else the NCCL plane
// (FormDataPlane decides when the group forms, alike on every rank).
enum class PlaneRequest { kGloo, kNccl, kOneSided, kGpuAuto };

// "gloo", "nccl", "one-sided" or "auto" (messages, logs). Pure.
const char* PlaneRequestName(PlaneRequest plane);

// PlaneRequestOf()
//
// Join's resolved `backend` ("gloo" or "nccl": ResolveBackend) and, for
// "nccl", its `gpu_data_plane` ("auto", "one-sided", "nccl"; empty = "nccl";
// ignored for "gloo") as the one request. Errors: kInvalidArgument naming
// the field for another backend ("backend: expected \"gloo\" or \"nccl\"")
// or GPU plane name (as ResolveGpuDataPlane). Pure.
// Example: ("nccl", "") -> kNccl; ("gloo", "one-sided") -> kGloo.
absl::StatusOr<PlaneRequest> PlaneRequestOf(const std::string& backend,
                                            const std::string& gpu_data_plane);

}  // namespace moe_ep::server
