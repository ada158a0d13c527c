#pragma once

// The driver's cuTensorMapEncodeTiled, looked up once through
// cudaGetDriverEntryPointByVersion (DESIGN §13: no libcuda link, so binaries
// still load where no driver is installed). Shared by the TMA-fed kernels of
// kernels/ (kernels/fp8_grouped_gemm.cu). Header-only; not part of the
// public API.

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

namespace moe_ep::kernels::internal {

// The entry point, or null when the driver has none (or there is no
// driver). Thread-safe (a function-local static).
inline PFN_cuTensorMapEncodeTiled_v12000 TensorMapEncodeTiled() {
  static const PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult q = cudaDriverEntryPointSymbolNotFound;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) != cudaSuccess ||
        q != cudaDriverEntryPointSuccess) {
      cudaGetLastError();
      return static_cast<PFN_cuTensorMapEncodeTiled_v12000>(nullptr);
    }
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

}  // namespace moe_ep::kernels::internal
