#include "server/nccl_runtime.h"

#include <string>

#include "absl/strings/str_cat.h"

#if MOE_EP_HAVE_CUDA
#include <nccl.h>
#endif

namespace moe_ep::server {
namespace {

std::string NcclVersionString(int code) {
  return absl::StrCat(code / 10000, ".", code / 100 % 100, ".", code % 100);
}

}  // namespace

absl::Status CompareNcclVersions(int built_against, int at_run_time) {
  if (built_against / 100 == at_run_time / 100) return absl::OkStatus();
  return absl::FailedPreconditionError(absl::StrCat(
      "NCCL runtime ", NcclVersionString(at_run_time), " differs from the NCCL ",
      NcclVersionString(built_against),
      " this library was built against (major.minor must match); put the matching libnccl.so.2 "
      "first on the library path or rebuild against the installed NCCL"));
}

absl::Status CheckNcclRuntime() {
#if MOE_EP_HAVE_CUDA
  int version = 0;
  if (ncclResult_t result = ncclGetVersion(&version); result != ncclSuccess) {
    return absl::UnavailableError(
        absl::StrCat("ncclGetVersion failed: ", ncclGetErrorString(result)));
  }
  return CompareNcclVersions(NCCL_VERSION_CODE, version);
#else
  return absl::OkStatus();
#endif
}

}  // namespace moe_ep::server
