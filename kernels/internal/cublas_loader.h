#pragma once

// cuBLAS opened on first use (dlopen of libcublas.so.<major>) instead of
// linked. Only ExpertGemm::kCublasHostCounts calls it, yet a linked cuBLAS
// runs cublasLt's static initialisers in every process that loads
// moe_ep_kernels: 0.38 s of CPU per start (moe-ep-worker 0.42 s against 0.04 s
// for the CLI, measured with /usr/bin/time; issue 34 item 5: each test
// process and each worker a test starts paid it). Not part of the public API.

#include <cublas_v2.h>

#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moe_ep::kernels::internal {

// The cuBLAS entry points moe-ep calls, with the library's own signatures.
struct CublasApi {
  decltype(&cublasCreate_v2) create = nullptr;
  decltype(&cublasDestroy_v2) destroy = nullptr;
  decltype(&cublasSetStream_v2) set_stream = nullptr;
  decltype(&cublasSetWorkspace_v2) set_workspace = nullptr;
  // cublas_api.h also declares a C++ overload (a cudaDataType compute type).
  cublasStatus_t (*gemm_ex)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int,
                            const void*, const void*, cudaDataType, int, const void*, cudaDataType,
                            int, const void*, void*, cudaDataType, int, cublasComputeType_t,
                            cublasGemmAlgo_t) = nullptr;
  decltype(&cublasGetStatusString) status_string = nullptr;
};

// The process's cuBLAS, opened once (the first call; thread-safe) and kept
// for the life of the process. Errors: kFailedPrecondition naming the
// library and dlerror()'s text when it cannot be opened or lacks one of
// the symbols (the same error on every later call).
absl::StatusOr<const CublasApi*> LoadCublas();

// OK for CUBLAS_STATUS_SUCCESS, else kInternal "`what`: <cuBLAS's text>".
absl::Status CublasStatus(const CublasApi& api, cublasStatus_t err, const std::string& what);

}  // namespace moe_ep::kernels::internal
