#include "kernels/kernel_preload.h"

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <vector>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/internal/tensor_map.h"

namespace moe_ep::kernels {
namespace {

// The driver entry points, looked up once; any null when the driver lacks it.
struct DriverCalls {
  PFN_cuFuncGetModule_v11000 get_module = nullptr;
  PFN_cuModuleGetFunctionCount_v12040 function_count = nullptr;
  PFN_cuModuleEnumerateFunctions_v12040 enumerate = nullptr;
  PFN_cuFuncLoad_v12040 load = nullptr;
  PFN_cuFuncIsLoaded_v12040 is_loaded = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  PFN_cuModuleGetLoadingMode_v11070 loading_mode = nullptr;
};

absl::StatusOr<const DriverCalls*> Driver() {
  static const DriverCalls calls = [] {
    DriverCalls c;
    c.get_module = internal::DriverEntryPoint<PFN_cuFuncGetModule_v11000>("cuFuncGetModule", 11000);
    c.function_count = internal::DriverEntryPoint<PFN_cuModuleGetFunctionCount_v12040>(
        "cuModuleGetFunctionCount", 12040);
    c.enumerate = internal::DriverEntryPoint<PFN_cuModuleEnumerateFunctions_v12040>(
        "cuModuleEnumerateFunctions", 12040);
    c.load = internal::DriverEntryPoint<PFN_cuFuncLoad_v12040>("cuFuncLoad", 12040);
    c.is_loaded = internal::DriverEntryPoint<PFN_cuFuncIsLoaded_v12040>("cuFuncIsLoaded", 12040);
    c.error_name = internal::DriverEntryPoint<PFN_cuGetErrorName_v6000>("cuGetErrorName", 6000);
    c.loading_mode = internal::DriverEntryPoint<PFN_cuModuleGetLoadingMode_v11070>(
        "cuModuleGetLoadingMode", 11070);
    return c;
  }();
  if (calls.get_module == nullptr || calls.function_count == nullptr ||
      calls.enumerate == nullptr || calls.load == nullptr || calls.is_loaded == nullptr ||
      calls.error_name == nullptr || calls.loading_mode == nullptr) {
    return absl::FailedPreconditionError(
        "kernel preload: the CUDA driver lacks cuFuncGetModule, cuModuleEnumerateFunctions, "
        "cuFuncLoad, cuFuncIsLoaded, cuGetErrorName or cuModuleGetLoadingMode (driver API 12.4 "
        "or later is needed)");
  }
  return &calls;
}

absl::Status DriverStatus(const DriverCalls& d, CUresult r, const char* call) {
  if (r == CUDA_SUCCESS) return absl::OkStatus();
  const char* name = nullptr;
  if (d.error_name(r, &name) != CUDA_SUCCESS || name == nullptr) name = "an unknown CUresult";
  return absl::InternalError(
      absl::StrFormat("kernel preload: %s failed with %s (%d)", call, name, static_cast<int>(r)));
}

// Every function of the distinct modules holding `kernels`, in the current
// context.
absl::StatusOr<std::vector<CUfunction>> FunctionsOf(const DriverCalls& d,
                                                    absl::Span<const void* const> kernels) {
  std::set<CUmodule> modules;
  for (const void* k : kernels) {
    cudaFunction_t f = nullptr;
    RETURN_IF_ERROR(internal::CudaStatus(cudaGetFuncBySymbol(&f, k), "cudaGetFuncBySymbol"));
    CUmodule m = nullptr;
    RETURN_IF_ERROR(DriverStatus(d, d.get_module(&m, f), "cuFuncGetModule"));
    modules.insert(m);
  }
  std::vector<CUfunction> all;
  for (CUmodule m : modules) {
    unsigned int n = 0;
    RETURN_IF_ERROR(DriverStatus(d, d.function_count(&n, m), "cuModuleGetFunctionCount"));
    std::vector<CUfunction> fns(n);
    RETURN_IF_ERROR(DriverStatus(d, d.enumerate(fns.data(), n, m), "cuModuleEnumerateFunctions"));
    all.insert(all.end(), fns.begin(), fns.end());
  }
  return all;
}

}  // namespace

absl::StatusOr<int> PreloadModulesOf(absl::Span<const void* const> kernels) {
  ASSIGN_OR_RETURN(const DriverCalls* d, Driver());
  ASSIGN_OR_RETURN(std::vector<CUfunction> fns, FunctionsOf(*d, kernels));
  for (CUfunction f : fns) RETURN_IF_ERROR(DriverStatus(*d, d->load(f), "cuFuncLoad"));
  return static_cast<int>(fns.size());
}

absl::StatusOr<int> UnloadedKernelsOf(absl::Span<const void* const> kernels) {
  ASSIGN_OR_RETURN(const DriverCalls* d, Driver());
  ASSIGN_OR_RETURN(std::vector<CUfunction> fns, FunctionsOf(*d, kernels));
  int unloaded = 0;
  for (CUfunction f : fns) {
    CUfunctionLoadingState state = CU_FUNCTION_LOADING_STATE_UNLOADED;
    RETURN_IF_ERROR(DriverStatus(*d, d->is_loaded(&state, f), "cuFuncIsLoaded"));
    if (state != CU_FUNCTION_LOADING_STATE_LOADED) ++unloaded;
  }
  return unloaded;
}

absl::StatusOr<bool> LazyModuleLoading() {
  ASSIGN_OR_RETURN(const DriverCalls* d, Driver());
  CUmoduleLoadingMode mode = CU_MODULE_EAGER_LOADING;
  RETURN_IF_ERROR(DriverStatus(*d, d->loading_mode(&mode), "cuModuleGetLoadingMode"));
  return mode == CU_MODULE_LAZY_LOADING;
}

absl::Span<const void* const> StepKernelModules() {
  static const void* const kModules[] = {
      internal::CombineReduceModule(),     internal::DispatchPackModule(),
      internal::EngineRowsModule(),        internal::ExpertKernelsModule(),
      internal::Fp8DispatchModule(),       internal::Fp8ExpertKernelsModule(),
      internal::Fp8GroupedGemmModule(),    internal::GroupedGemmModule(),
      internal::HopperGroupedGemmModule(), internal::Mxfp4GroupedGemmModule(),
      internal::RmsNormModule(),           internal::RouteModule(),
      internal::SeededWeightsModule(),     internal::SharedExpertPackModule(),
      internal::StepHeaderModule(),        internal::OneSidedKernelsModule(),
      internal::NcclPeerWindowModule(),
  };
  return kModules;
}

absl::Status PreloadStepKernels() {
  int device = 0;
  RETURN_IF_ERROR(internal::CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  static std::mutex mu;
  static std::set<int>* done = new std::set<int>();
  std::lock_guard<std::mutex> lock(mu);
  if (done->count(device) > 0) return absl::OkStatus();
  RETURN_IF_ERROR(PreloadModulesOf(StepKernelModules()).status());
  done->insert(device);
  return absl::OkStatus();
}

}  // namespace moe_ep::kernels
