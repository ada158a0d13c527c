#include "absl/strings/str_format.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/route.cuh"
#include "kernels/step_header.cuh"

namespace moe_ep::kernels {
namespace {

// Thread i < num_replicas writes replica row i (T = `sent_tokens`, what the
// peers see); thread 0 also the header (T = `num_tokens`, what this rank's
// kernels read).
__global__ void WriteStepHeaderKernel(int64_t* header, int64_t* replicas, int num_replicas,
                                      int64_t epoch, int64_t r, int64_t num_tokens,
                                      int64_t sent_tokens) {
  const int i = threadIdx.x;
  if (i == 0) {
    header[0] = epoch;
    header[1] = r;
    header[2] = num_tokens;
  }
  if (i < num_replicas) {
    replicas[3 * i] = epoch;
    replicas[3 * i + 1] = r;
    replicas[3 * i + 2] = sent_tokens;
  }
}

__global__ void VerifyStepHeaderKernel(const int64_t* gathered, int ep_size, int64_t* header,
                                       int32_t* error_rank) {
  for (int r = 0; r < ep_size; ++r) {
    if (gathered[3 * r] != header[0] || gathered[3 * r + 1] != header[1]) {
      *error_rank = r + 1;
      header[2] = 0;
      return;
    }
  }
}

// Records rank r's header row in `error` unless an earlier record sticks,
// and makes this rank's step move no token (header[2], T = 0).
__device__ void RecordAndStop(const int64_t* gathered, int r, int32_t r_differs, int32_t refused,
                              int64_t* header, StepHeaderError* error) {
  // A combine's refusal is the combine reduction's to record (combine 0).
  RecordStepHeaderError(error, r, gathered + 3 * r, r_differs, refused, 0, header[0], header[1]);
  header[2] = 0;
}

// One thread: the (epoch, R) disagreements first (they may have sized the
// transfers differently), then the refusals (issue 30 item 1): this rank's
// own (its caller has the error: nothing recorded), else the lowest peer's.
__global__ void CheckStepHeadersKernel(const int64_t* gathered, int ep_size, int rank,
                                       int64_t* header, StepHeaderError* error) {
  for (int r = 0; r < ep_size; ++r) {
    if (gathered[3 * r] != header[0] || gathered[3 * r + 1] != header[1]) {
      RecordAndStop(gathered, r, gathered[3 * r + 1] != header[1] ? 1 : 0, 0, header, error);
      return;
    }
  }
  if (gathered[3 * rank + 2] == kRefusedStepTokens) {
    header[2] = 0;
    return;
  }
  for (int r = 0; r < ep_size; ++r) {
    if (gathered[3 * r + 2] == kRefusedStepTokens) {
      RecordAndStop(gathered, r, 0, 1, header, error);
      return;
    }
  }
}

absl::Status CheckArgs(const void* gathered, int ep_size, const void* header, const void* error,
                       const char* who) {
  if (gathered == nullptr || header == nullptr || error == nullptr) {
    return absl::InvalidArgumentError(absl::StrFormat("%s: null device pointer", who));
  }
  if (ep_size < 1 || ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("%s: ep_size expected in [1, %d], got %d", who, kMaxEpSize, ep_size));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status LaunchWriteStepHeader(int64_t* header, int64_t* replicas, int num_replicas,
                                   int64_t epoch, int64_t r, int64_t num_tokens, HeaderRefusal sent,
                                   cudaStream_t stream) {
  if (header == nullptr || (replicas == nullptr && num_replicas > 0)) {
    return absl::InvalidArgumentError("LaunchWriteStepHeader: null device pointer");
  }
  if (num_replicas < 0 || num_replicas > kMaxEpSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchWriteStepHeader: num_replicas expected in [0, %d], got %d",
                        kMaxEpSize, num_replicas));
  }
  const int64_t sent_tokens = sent == HeaderRefusal::kStep      ? kRefusedStepTokens
                              : sent == HeaderRefusal::kCombine ? kRefusedCombineTokens
                                                                : num_tokens;
  WriteStepHeaderKernel<<<1, kMaxEpSize, 0, stream>>>(header, replicas, num_replicas, epoch, r,
                                                      num_tokens, sent_tokens);
  return internal::LaunchStatus("WriteStepHeaderKernel");
}

absl::Status LaunchVerifyStepHeader(const int64_t* gathered, int ep_size, int64_t* header,
                                    int32_t* error_rank, cudaStream_t stream) {
  absl::Status s = CheckArgs(gathered, ep_size, header, error_rank, "LaunchVerifyStepHeader");
  if (!s.ok()) return s;
  VerifyStepHeaderKernel<<<1, 1, 0, stream>>>(gathered, ep_size, header, error_rank);
  return internal::LaunchStatus("VerifyStepHeaderKernel");
}

absl::Status LaunchCheckStepHeaders(const int64_t* gathered, int ep_size, int rank, int64_t* header,
                                    StepHeaderError* error, cudaStream_t stream) {
  absl::Status s = CheckArgs(gathered, ep_size, header, error, "LaunchCheckStepHeaders");
  if (!s.ok()) return s;
  if (rank < 0 || rank >= ep_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchCheckStepHeaders: rank expected in [0, %d) (ep_size), got %d", ep_size, rank));
  }
  CheckStepHeadersKernel<<<1, 1, 0, stream>>>(gathered, ep_size, rank, header, error);
  return internal::LaunchStatus("CheckStepHeadersKernel");
}

const void* internal::StepHeaderModule() {
  return reinterpret_cast<const void*>(&WriteStepHeaderKernel);
}

}  // namespace moe_ep::kernels
