#pragma once

// Loading every step-path kernel before the first step (DESIGN §13: ranks as
// threads share one GPU).
//
// CUDA loads a kernel lazily, at its first launch (CUDA_MODULE_LOADING=LAZY,
// the default since CUDA 12.2), and that load may synchronise the context.
// Where ranks run as threads of one process, one rank's first launch of an
// expert or combine kernel can then wait for a peer's kernel that spins on
// this rank's flags: a stall until the spin's timeout aborts the step (CUDA
// programming guide, "Lazy Loading", concurrent execution). The dispatchers
// and ExpertCompute call PreloadStepKernels in Create, so no launch on the
// step path loads anything.

#include <cstdint>

#include "absl/status/statusor.h"
#include "absl/types/span.h"

namespace moe_ep::kernels {

// PreloadModulesOf()
//
// Loads, into the current device's context, every kernel of the CUDA module
// (one per .cu translation unit) that holds each of `kernels` (host stubs of
// __global__ functions, e.g. reinterpret_cast<const void*>(&SomeKernel)).
// Returns how many kernels the modules hold, all now loaded. Uses the
// driver's cuFuncGetModule, cuModuleEnumerateFunctions and cuFuncLoad
// (CUDA 12.4 and later), looked up at run time (no libcuda link).
// Errors: kFailedPrecondition (the driver lacks those entry points),
// kInternal (a CUDA or driver call failed; the message names it).
// Thread-safe.
absl::StatusOr<int> PreloadModulesOf(absl::Span<const void* const> kernels);

// UnloadedKernelsOf()
//
// How many kernels of the modules holding `kernels` the current context has
// not loaded yet (cuFuncIsLoaded). For tests and logs. Errors as above.
absl::StatusOr<int> UnloadedKernelsOf(absl::Span<const void* const> kernels);

// The step path's modules: one kernel of each translation unit of kernels/
// and kernels/onesided/ that a step launches (kernels/internal/kernel_modules.h).
absl::Span<const void* const> StepKernelModules();

// PreloadStepKernels()
//
// PreloadModulesOf(StepKernelModules()) once per device and process (later
// calls on a device that succeeded return at once). Errors: as
// PreloadModulesOf; a failure is not remembered, the next call tries again.
// Thread-safe.
absl::Status PreloadStepKernels();

}  // namespace moe_ep::kernels
