#include "kernels/onesided/onesided_bulk.h"

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"

namespace moe_ep::kernels::onesided {

using internal::CudaStatus;

const char* OsPathName(OsPath path) { return path == OsPath::kSm ? "sm" : "ce"; }

absl::StatusOr<OsPathChoice> ParseOsPathChoice(std::string_view name) {
  if (name == "auto") return OsPathChoice::kAuto;
  if (name == "sm") return OsPathChoice::kSm;
  if (name == "ce") return OsPathChoice::kCopyEngine;
  return absl::InvalidArgumentError(
      absl::StrFormat("one-sided path: expected auto, sm or ce, got \"%s\"", name));
}

OsPath ChooseOsPath(OsPathChoice choice, int64_t r, int64_t ce_min_tokens, bool fp8) {
  if (fp8 || choice == OsPathChoice::kSm) return OsPath::kSm;
  if (choice == OsPathChoice::kCopyEngine) return OsPath::kCopyEngine;
  return r >= ce_min_tokens ? OsPath::kCopyEngine : OsPath::kSm;
}

absl::Status EnqueueOsBulkDispatch(const OsDispatchParams& p, int64_t rows, cudaStream_t stream) {
  if (rows < 0 || rows > p.step.r || (rows > 0 && p.hidden == nullptr) || p.fp8 || p.ep_size < 1 ||
      p.ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "EnqueueOsBulkDispatch: expected rows in [0, R %d], a hidden input, bf16 rows, ep_size in "
        "[1, %d]; got rows %d, hidden %s, fp8 %s, ep_size %d",
        p.step.r, kMaxEpSize, rows, p.hidden == nullptr ? "null" : "set", p.fp8 ? "yes" : "no",
        p.ep_size));
  }
  if (rows == 0) return absl::OkStatus();
  const size_t width = static_cast<size_t>(2 * p.hidden_size);
  const size_t pitch = static_cast<size_t>(2 * p.hidden_size + 8 * p.top_k);
  for (int d = 0; d < p.ep_size; ++d) {
    uint8_t* dst = p.peers.window[d] + p.off.dispatch_recv + p.rank * p.step.r * pitch;
    RETURN_IF_ERROR(
        CudaStatus(cudaMemcpy2DAsync(dst, pitch, p.hidden, width, width, static_cast<size_t>(rows),
                                     cudaMemcpyDefault, stream),
                   absl::StrFormat("cudaMemcpy2DAsync(dispatch rows %d to rank %d)", rows, d)));
  }
  return absl::OkStatus();
}

absl::Status EnqueueOsBulkCombine(const OsPeerTable& peers, const OsWindowOffsets& off, int rank,
                                  int ep_size, int64_t r, int64_t hidden,
                                  const uint16_t* expert_out, cudaStream_t stream) {
  if (r < 0 || (r > 0 && expert_out == nullptr) || ep_size < 1 || ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "EnqueueOsBulkCombine: expected R >= 0, an expert output, ep_size in [1, %d]; got R %d, "
        "ep_size %d",
        kMaxEpSize, r, ep_size));
  }
  if (r == 0) return absl::OkStatus();
  const size_t slab = static_cast<size_t>(r * hidden * 2);
  for (int s = 0; s < ep_size; ++s) {
    uint8_t* dst = peers.window[s] + off.combine_recv + rank * slab;
    RETURN_IF_ERROR(CudaStatus(
        cudaMemcpyAsync(dst, expert_out + s * r * hidden, slab, cudaMemcpyDefault, stream),
        absl::StrFormat("cudaMemcpyAsync(combine rows to rank %d)", s)));
  }
  return absl::OkStatus();
}

}  // namespace moe_ep::kernels::onesided
