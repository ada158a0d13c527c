#include "kernels/internal/cublas_loader.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace moe_ep::kernels::internal {
namespace {

// dlsym's result as the entry point's own type.
template <typename Fn>
absl::Status Resolve(void* library, const char* soname, const char* symbol, Fn* out) {
  void* address = dlsym(library, symbol);
  if (address == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(absl::StrCat("cuBLAS: ", soname, " has no ", symbol, ": ",
                                                      error != nullptr ? error : "not found"));
  }
  *out = reinterpret_cast<Fn>(address);  // NOLINT: dlsym returns object pointers
  return absl::OkStatus();
}

absl::StatusOr<CublasApi> Open() {
  const std::string soname = absl::StrCat("libcublas.so.", CUBLAS_VER_MAJOR);
  // Kept open for the process: handles may live until exit.
  void* library = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) {
    const char* error = dlerror();
    return absl::FailedPreconditionError(
        absl::StrCat("cuBLAS: dlopen(", soname, "): ", error != nullptr ? error : "failed",
                     " (ExpertGemm::kCublasHostCounts needs it: put the CUDA toolkit's or the "
                     "nvidia-cublas wheel's lib directory on LD_LIBRARY_PATH)"));
  }
  CublasApi api;
  const char* name = soname.c_str();
  absl::Status status = Resolve(library, name, "cublasCreate_v2", &api.create);
  if (status.ok()) status = Resolve(library, name, "cublasDestroy_v2", &api.destroy);
  if (status.ok()) status = Resolve(library, name, "cublasSetStream_v2", &api.set_stream);
  if (status.ok()) status = Resolve(library, name, "cublasSetWorkspace_v2", &api.set_workspace);
  if (status.ok()) status = Resolve(library, name, "cublasGemmEx", &api.gemm_ex);
  if (status.ok()) status = Resolve(library, name, "cublasGetStatusString", &api.status_string);
  if (!status.ok()) return status;
  return api;
}

}  // namespace

absl::StatusOr<const CublasApi*> LoadCublas() {
  // Never destroyed: handles of static objects may be destroyed at exit.
  static const auto* const loaded = new absl::StatusOr<CublasApi>(Open());
  if (!loaded->ok()) return loaded->status();
  return &**loaded;
}

absl::Status CublasStatus(const CublasApi& api, cublasStatus_t err, const std::string& what) {
  if (err == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", api.status_string(err)));
}

}  // namespace moe_ep::kernels::internal
