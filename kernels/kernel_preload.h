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

#include "absl/status/status.h"
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

// LazyModuleLoading()
//
// Whether this process loads modules lazily (cuModuleGetLoadingMode: the
// CUDA_MODULE_LOADING environment variable, LAZY by default). Errors as
// PreloadModulesOf. Thread-safe.
absl::StatusOr<bool> LazyModuleLoading();

// StepKernelModules()
//
// One kernel (host stub) of each translation unit of kernels/ and
// kernels/onesided/ that a worker launches once it has a dispatcher: the
// step path and LoadExperts' seeded weights (kernels/internal/kernel_modules.h;
// every .cu file with a __global__ kernel). Static storage; thread-safe.
absl::Span<const void* const> StepKernelModules();

// PreloadStepKernels()
//
// PreloadModulesOf(StepKernelModules()) on the calling thread's current
// device (cudaGetDevice), once per device and process: later calls on a
// device that succeeded return at once. Every GEMM variant is loaded, used
// or not (a few MB of device code). Not the cuBLAS kernels of
// ExpertGemm::kCublasHostCounts (a comparison path, not capturable): cuBLAS
// still loads those at their first call. Errors: kInternal
// ("cudaGetDevice: ..." without a device or driver; a failed driver call,
// named), kResourceExhausted (out of memory while loading), and
// kFailedPrecondition as PreloadModulesOf (not with the CUDA 13 runtime,
// which needs a 13.x driver). A failure is not remembered: the next call
// tries again. Thread-safe (one lock; ranks on different devices preload one
// after another). Source: CUDA programming guide, "Lazy Loading".
absl::Status PreloadStepKernels();

}  // namespace moe_ep::kernels
