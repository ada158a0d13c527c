#include <cuda_bf16.h>

#include "absl/strings/str_format.h"
#include "kernels/combine_reduce.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/kernel_modules.h"
#include "kernels/route.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int kCombineThreads = 256;
static_assert(kCombineThreads >= kMaxEpSize, "a thread per rank reads the headers");
constexpr int kNoRefusal = 1 << 30;  // above every rank
constexpr int kOwnRefusal = -1;      // below every rank: this rank's own wins

__device__ __forceinline__ float Bf16Lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float Bf16Hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Block t = source token t; uint2 = 4 bf16 per thread step.
__global__ void CombineReduceKernel(const uint16_t* __restrict__ recv,
                                    const int32_t* __restrict__ token_slot,
                                    const int64_t* num_tokens, int64_t max_tokens,
                                    int64_t hidden_size, int ep_size,
                                    const uint16_t* __restrict__ shared,
                                    uint16_t* __restrict__ output, const int64_t* headers, int rank,
                                    StepHeaderError* error) {
  __shared__ int32_t slot[kMaxEpSize];
  __shared__ int refusing;  // kNoRefusal, kOwnRefusal or the lowest refusing peer
  const int64_t t = blockIdx.x;
  const int64_t n = *num_tokens < max_tokens ? *num_tokens : max_tokens;
  if (t >= n && (headers == nullptr || t != 0)) return;
  if (headers != nullptr) {
    // Thread r reads rank r's row: one load each, not a chain of E.
    if (threadIdx.x == 0) refusing = kNoRefusal;
    __syncthreads();
    const int r = threadIdx.x;
    if (r < ep_size && headers[3 * r + 2] == kRefusedCombineTokens) {
      atomicMin(&refusing, r == rank ? kOwnRefusal : r);
    }
    __syncthreads();
    if (refusing != kNoRefusal) {
      // This rank's own refusal records nothing (its caller has the error).
      if (t == 0 && threadIdx.x == 0 && refusing != kOwnRefusal) {
        // The ranks agreed on (epoch, R) at the dispatch: "mine" is theirs.
        const int64_t* row = headers + 3 * refusing;
        RecordStepHeaderError(error, refusing, row, 0, 1, 1, row[0], row[1]);
      }
      return;
    }
    if (t >= n) return;
  }
  if (threadIdx.x < ep_size) slot[threadIdx.x] = token_slot[t * ep_size + threadIdx.x];
  __syncthreads();
  const int64_t vecs = hidden_size / 4;
  uint2* out = reinterpret_cast<uint2*>(output + t * hidden_size);
  for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    for (int d = 0; d < ep_size; ++d) {
      if (slot[d] < 0) continue;
      const uint2 x =
          reinterpret_cast<const uint2*>(recv + (d * max_tokens + slot[d]) * hidden_size)[v];
      acc[0] += Bf16Lo(x.x);
      acc[1] += Bf16Hi(x.x);
      acc[2] += Bf16Lo(x.y);
      acc[3] += Bf16Hi(x.y);
    }
    if (shared != nullptr) {  // the shared expert's term, after the ranks'
      const uint2 x = reinterpret_cast<const uint2*>(shared + t * hidden_size)[v];
      acc[0] += Bf16Lo(x.x);
      acc[1] += Bf16Hi(x.x);
      acc[2] += Bf16Lo(x.y);
      acc[3] += Bf16Hi(x.y);
    }
    out[v] = make_uint2(PackBf16(acc[0], acc[1]), PackBf16(acc[2], acc[3]));
  }
}

}  // namespace

absl::Status LaunchCombineReduce(const CombineReduceParams& p, cudaStream_t stream) {
  if (p.num_tokens == nullptr ||
      (p.max_tokens > 0 && (p.recv == nullptr || p.token_slot == nullptr))) {
    return absl::InvalidArgumentError("LaunchCombineReduce: null device pointer");
  }
  if (p.max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchCombineReduce: max_tokens expected >= 0, got %d", p.max_tokens));
  }
  if (p.hidden_size < 4 || p.hidden_size % 4 != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchCombineReduce: hidden expected a positive multiple of 4, got %d", p.hidden_size));
  }
  if (p.ep_size < 1 || p.ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchCombineReduce: ep_size expected in [1, %d], got %d", kMaxEpSize, p.ep_size));
  }
  if (p.headers != nullptr && (p.error == nullptr || p.rank < 0 || p.rank >= p.ep_size)) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchCombineReduce: with headers, error must not be null and rank must be in [0, %d) "
        "(ep_size); got error %p, rank %d",
        p.ep_size, static_cast<const void*>(p.error), p.rank));
  }
  if (p.max_tokens == 0 && p.headers == nullptr) return absl::OkStatus();
  if (p.output == nullptr && p.max_tokens > 0) {
    return absl::InvalidArgumentError("LaunchCombineReduce: null output");
  }
  const int64_t blocks = p.max_tokens > 0 ? p.max_tokens : 1;  // block 0 checks the headers
  CombineReduceKernel<<<static_cast<unsigned>(blocks), kCombineThreads, 0, stream>>>(
      p.recv, p.token_slot, p.num_tokens, p.max_tokens, p.hidden_size, p.ep_size, p.shared,
      p.output, p.headers, p.rank, p.error);
  return internal::LaunchStatus("CombineReduceKernel");
}

const void* internal::CombineReduceModule() {
  return reinterpret_cast<const void*>(&CombineReduceKernel);
}

}  // namespace moe_ep::kernels
