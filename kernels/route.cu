#include <cub/block/block_scan.cuh>

#include "absl/strings/str_format.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/internal/device_placement.cuh"
#include "kernels/internal/expert_id_check.cuh"
#include "kernels/internal/kernel_modules.h"
#include "kernels/route.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int kRouteThreads = 512;

// Block d = destination rank d. Each chunk of kRouteThreads tokens: thread i
// flags token (chunk + i) when one of its K valid ids lives on rank d; an
// exclusive block scan of the flags plus the running total of earlier chunks
// is the token's slot. Buffers: topk_ids [R, K], token_slot [R, E] (column d
// written by block d only), send_counts [E].
__global__ void RouteKernel(const int32_t* __restrict__ topk_ids, const int64_t* num_tokens,
                            int64_t max_tokens, int top_k, int num_experts, int ep_size, int base,
                            int rem, int32_t* __restrict__ token_slot,
                            int32_t* __restrict__ send_counts, DevicePlacement placement,
                            unsigned long long* __restrict__ expert_tokens,
                            int32_t invalid_expert_id, ExpertIdError* id_error) {
  using BlockScan = cub::BlockScan<int, kRouteThreads>;
  __shared__ typename BlockScan::TempStorage temp;
  const int d = blockIdx.x;
  const int64_t n = *num_tokens < max_tokens ? *num_tokens : max_tokens;
  int running = 0;  // identical in every thread
  for (int64_t start = 0; start < n; start += kRouteThreads) {
    const int64_t t = start + threadIdx.x;
    int flag = 0;
    if (t < n) {
      for (int k = 0; k < top_k; ++k) {
        const int32_t id = topk_ids[t * top_k + k];
        if (d == 0)
          internal::CheckExpertId(id_error, id, t * top_k + k, num_experts, invalid_expert_id);
        if (id < 0 || id >= num_experts) continue;
        if (internal::DestinationRank(placement, t, id, base, rem) == d) flag = 1;
        if (d == 0 && expert_tokens != nullptr) atomicAdd(expert_tokens + id, 1ULL);
      }
    }
    int prefix = 0;
    int total = 0;
    BlockScan(temp).ExclusiveSum(flag, prefix, total);
    if (t < n) token_slot[t * ep_size + d] = flag ? running + prefix : -1;
    running += total;
    __syncthreads();  // temp is reused by the next chunk's scan
  }
  if (threadIdx.x == 0) send_counts[d] = running;
}

}  // namespace

absl::Status LaunchRoute(const RouteParams& p, cudaStream_t stream) {
  if (p.num_tokens == nullptr || p.token_slot == nullptr || p.send_counts == nullptr ||
      (p.topk_ids == nullptr && p.max_tokens > 0)) {
    return absl::InvalidArgumentError("LaunchRoute: null device pointer");
  }
  if (p.max_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchRoute: max_tokens expected >= 0, got %d", p.max_tokens));
  }
  if (p.top_k < 1 || p.top_k > kMaxTopK) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchRoute: top_k expected in [1, %d], got %d", kMaxTopK, p.top_k));
  }
  if (p.ep_size < 1 || p.ep_size > kMaxEpSize) {
    return absl::InvalidArgumentError(
        absl::StrFormat("LaunchRoute: ep_size expected in [1, %d], got %d", kMaxEpSize, p.ep_size));
  }
  if (p.num_experts < p.ep_size) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "LaunchRoute: num_experts expected >= ep_size %d, got %d", p.ep_size, p.num_experts));
  }
  if (p.placement.replica_offsets != nullptr && p.placement.replica_ranks == nullptr) {
    return absl::InvalidArgumentError("LaunchRoute: placement with offsets but no replica ranks");
  }
  const int base = p.num_experts / p.ep_size;
  const int rem = p.num_experts % p.ep_size;
  RouteKernel<<<p.ep_size, kRouteThreads, 0, stream>>>(
      p.topk_ids, p.num_tokens, p.max_tokens, p.top_k, p.num_experts, p.ep_size, base, rem,
      p.token_slot, p.send_counts, p.placement, p.expert_tokens, p.invalid_expert_id, p.id_error);
  return internal::LaunchStatus("RouteKernel");
}

const void* internal::RouteModule() { return reinterpret_cast<const void*>(&RouteKernel); }

}  // namespace moe_ep::kernels
