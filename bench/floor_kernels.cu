#include "bench/floor_kernels.h"

namespace moe_ep::bench {
namespace {

__global__ void EmptyKernel() {}

__global__ void StepNodeKernel(int64_t tokens) {
  // Never true for a real T: keeps the argument live without work.
  if (tokens < 0) asm volatile("trap;");
}

// GPU scope: the two thread-ranks share one device (the one-sided plane's
// thread windows use the same scope there).
__global__ void FlagExchangeKernel(FlagSlots s) {
  const uint64_t e = *s.epoch + 1;
  *s.epoch = e;
  asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(s.peer), "l"(e) : "memory");
  uint64_t seen = 0;
  // The asm's output operand writes `seen`; clang-tidy does not see asm
  // outputs, so bugprone-infinite-loop thinks nothing in the loop changes it.
  do {  // NOLINT(bugprone-infinite-loop)
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(seen) : "l"(s.own) : "memory");
  } while (seen < e);
}

}  // namespace

cudaError_t LaunchEmpty(cudaStream_t stream, int blocks, int threads) {
  EmptyKernel<<<blocks, threads, 0, stream>>>();
  return cudaGetLastError();
}

cudaError_t LaunchStepNode(cudaStream_t stream, int64_t tokens) {
  StepNodeKernel<<<1, 32, 0, stream>>>(tokens);
  return cudaGetLastError();
}

cudaError_t LaunchFlagExchange(cudaStream_t stream, FlagSlots slots) {
  FlagExchangeKernel<<<1, 1, 0, stream>>>(slots);
  return cudaGetLastError();
}

}  // namespace moe_ep::bench
