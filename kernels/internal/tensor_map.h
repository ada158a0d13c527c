#pragma once

// Driver entry points looked up through cudaGetDriverEntryPointByVersion
// (DESIGN §13: no libcuda link, so binaries still load where no driver is
// installed), and the one the TMA-fed kernels of kernels/ share
// (kernels/hopper_grouped_gemm.cu, kernels/fp8_grouped_gemm.cu). Header-only;
// not part of the public API.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace moe_ep::kernels::internal {

// The driver's `name` at API `version` as a Fn (a PFN_ typedef of
// cudaTypedefs.h), or null when the driver has none (or there is no driver);
// a failed lookup's error is cleared so that no later launch check sees it.
// Thread-safe.
template <typename Fn>
Fn DriverEntryPoint(const char* name, int version) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
  if (cudaGetDriverEntryPointByVersion(name, &p, version, cudaEnableDefault, &q) != cudaSuccess ||
      q != cudaDriverEntryPointSuccess) {
    cudaGetLastError();
    return nullptr;
  }
  return reinterpret_cast<Fn>(p);
}

// cuTensorMapEncodeTiled, looked up once; null when the driver has none.
// Thread-safe (a function-local static).
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncodeTiled() {
  static const auto fn =
      DriverEntryPoint<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled", 12000);
  return fn;
}

}  // namespace moe_ep::kernels::internal
