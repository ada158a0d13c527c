// smem_stream_bench: how fast asynchronous bulk copies fill shared memory on
// one GPU, alone: the floor of a GEMM whose time is its operand loads
// (issues 32, 35; bench/results/fp8-ablate: the fp8 and bf16 expert GEMMs
// take as long with their products removed).
//
// Each CTA's producer threads (lane 0 of warps 0 .. producers-1) stream
// `iters` chunks of `chunk` bytes each from a device buffer of `src_mib` MiB
// into their own ring of `stages` chunks with cp.async.bulk (one-dimensional
// bulk copy, mbarrier completion), reusing a slot once its previous copy has
// landed (no consumer). Chunk i of producer p of CTA b is read from offset
// ((b * 7919 + i * producers + p) * chunk) mod the buffer's size: all CTAs
// stream at once from spread-out addresses. A buffer of 32 MiB stays in L2;
// 1024 MiB streams from DRAM. One row per configuration: CTAs, CTAs per SM
// (1 or 2, from the shared memory asked for), producers, in-flight bytes per
// SM, p50 over --reps of the kernel's time (CUDA events), the aggregate rate
// (TB/s) and the rate per SM (GB/s). With cluster 2 each CTA copies half of
// every chunk and multicasts it to its pair: the L2 serves half the bytes
// that land in shared memory, and the rates count the bytes that land. Such
// rows use as many pairs as can be resident at once (fewer than one a pair
// of SMs where a GPC's SM count is odd).
// Usage: moe_ep_smem_stream_bench [--reps N]. Output: CSV on stdout.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "bench/expert_bench_util.h"
#include "kernels/internal/hopper_ptx.cuh"

namespace {

constexpr int kMaxProducers = 4;

__device__ __forceinline__ void BulkCopy(uint32_t dst, const uint8_t* src, int bytes,
                                         uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::
          "r"(dst),
      "l"(src), "r"(bytes), "r"(bar)
      : "memory");
}

// One copy written to the same offset of both CTAs of a 2-CTA cluster,
// completing on the barrier at the same offset in each.
__device__ __forceinline__ void BulkCopyMulticast(uint32_t dst, const uint8_t* src, int bytes,
                                                  uint32_t bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.multicast::cluster "
      "[%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
      "l"(src), "r"(bytes), "r"(bar), "h"(static_cast<uint16_t>(3))
      : "memory");
}

// cluster 1: each producer refills a slot once its previous copy has landed.
// cluster 2: the two CTAs of a cluster stream the same chunks; each copies
// half of every chunk and multicasts it to both (the TMA multicast of a GEMM
// whose paired CTAs share an operand). A slot is refilled once both CTAs
// have seen its previous chunk land (an empty barrier with an arrival from
// each CTA), since the peer writes into it too.
__global__ void StreamKernel(const uint8_t* src, int64_t src_bytes, int chunk, int stages,
                             int producers, int iters, int cluster) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using namespace moe_ep::kernels::internal;
  extern __shared__ __align__(128) uint8_t smem[];
  const int per = stages / producers;  // slots of one producer's ring
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + int64_t{stages} * chunk);
  uint64_t* empty = full + stages;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      MbarInit(SmemAddr(&full[s]), 1);
      MbarInit(SmemAddr(&empty[s]), 2);
    }
    FenceBarrierInit();
  }
  const uint32_t rank = cluster > 1 ? ClusterCtaRank() : 0;
  if (cluster > 1) {
    ClusterSync();  // the peer's barriers exist before its first copy or arrival
  } else {
    __syncthreads();
  }
  const int p = threadIdx.x / 32;
  if (threadIdx.x % 32 == 0 && p < producers) {
    const int64_t chunks = src_bytes / chunk;
    const int64_t group = blockIdx.x / cluster;  // both CTAs of a cluster read the same chunks
    const int part = chunk / cluster;
    for (int i = 0; i < iters; ++i) {
      const int s = p * per + i % per;
      const uint32_t bar = SmemAddr(&full[s]);
      const uint32_t prev = ((i / per) & 1) ^ 1;  // parity of the slot's previous round
      if (i >= per) {
        MbarWait(bar, prev);
        if (cluster > 1) {
          MbarArrive(SmemAddr(&empty[s]));
          MbarArrivePeer(SmemAddr(&empty[s]), rank ^ 1);
          MbarWait(SmemAddr(&empty[s]), prev);
        }
      }
      MbarArriveExpectTx(bar, chunk);
      const int64_t c = (group * 7919 + int64_t{i} * producers + p) % chunks;
      const uint32_t dst = SmemAddr(smem + int64_t{s} * chunk + rank * part);
      if (cluster > 1) {
        BulkCopyMulticast(dst, src + c * chunk + rank * part, part, bar);
      } else {
        BulkCopy(dst, src + c * chunk, chunk, bar);
      }
    }
    for (int i = iters > per ? iters - per : 0; i < iters; ++i) {
      MbarWait(SmemAddr(&full[p * per + i % per]), (i / per) & 1);
    }
  }
  // The peer's copies into this CTA have landed (every full barrier's last
  // phase); its arrivals on this CTA's empty barriers come before it passes
  // this barrier, so neither CTA's shared memory goes while the other uses it.
  if (cluster > 1) {
    __syncwarp();  // lane 0 rejoins its warp before the aligned barrier
    ClusterSync();
  }
#endif
}

struct Config {
  int ctas_per_sm;  // 1 or 2
  int sm_share;     // 1: every SM; 2: half of them
  int producers;
  int stages;
  int chunk;
  int src_mib;
  int cluster = 1;  // 2: CTA pairs multicasting halves of the same chunks
};

}  // namespace

int main(int argc, char** argv) {
  int reps = 20;
  for (int i = 1; i + 1 < argc; ++i) {
    if (std::string(argv[i]) == "--reps") reps = std::atoi(argv[i + 1]);
  }
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, 0));
  const int sms = prop.multiProcessorCount;
  const std::vector<Config> configs = {
      {1, 1, 1, 24, 8192, 32},     {1, 1, 1, 6, 32768, 32},      {1, 1, 1, 12, 8192, 32},
      {1, 1, 1, 4, 8192, 32},      {1, 1, 2, 24, 8192, 32},      {1, 1, 4, 24, 8192, 32},
      {2, 1, 1, 12, 8192, 32},     {2, 1, 2, 12, 8192, 32},      {1, 2, 1, 24, 8192, 32},
      {1, 1, 1, 24, 8192, 1024},   {2, 1, 1, 12, 8192, 1024},    {1, 1, 1, 24, 8192, 32, 2},
      {1, 1, 1, 12, 16384, 32, 2}, {1, 1, 1, 24, 8192, 1024, 2},
  };
  uint8_t* src = nullptr;
  CUDA_CHECK(cudaMalloc(&src, int64_t{1024} << 20));
  CUDA_CHECK(cudaMemset(src, 1, int64_t{1024} << 20));
  CUDA_CHECK(cudaFuncSetAttribute(StreamKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  prop.sharedMemPerBlockOptin));
  cudaEvent_t e0, e1;
  CUDA_CHECK(cudaEventCreate(&e0));
  CUDA_CHECK(cudaEventCreate(&e1));
  std::printf(
      "gpu,cluster,ctas,ctas_per_sm,sms_used,producers,stages,chunk,inflight_kib_per_sm,src_mib,"
      "p50_us,"
      "tbps,gbps_per_sm\n");
  for (const Config& c : configs) {
    const size_t smem = size_t{static_cast<size_t>(c.stages)} * c.chunk + c.stages * 16;
    cudaLaunchConfig_t cfg{};
    cfg.blockDim = dim3(32 * kMaxProducers);
    cfg.dynamicSmemBytes = smem;
    cudaLaunchAttribute attr{};
    attr.id = cudaLaunchAttributeClusterDimension;
    attr.val.clusterDim.x = c.cluster;
    attr.val.clusterDim.y = 1;
    attr.val.clusterDim.z = 1;
    cfg.attrs = &attr;
    cfg.numAttrs = 1;
    int sms_used = sms / c.sm_share;
    if (c.cluster > 1) {
      // Whole pairs only, no more than can be resident at once.
      sms_used = sms_used / c.cluster * c.cluster;
      cfg.gridDim = dim3(sms_used);
      int clusters = 0;
      CUDA_CHECK(cudaOccupancyMaxActiveClusters(&clusters, StreamKernel, &cfg));
      if (clusters < 1) {
        std::fprintf(stderr, "no %d-CTA cluster of %zu bytes fits: row skipped\n", c.cluster, smem);
        continue;
      }
      sms_used = std::min(sms_used, clusters * c.cluster);
    }
    const int ctas = sms_used * c.ctas_per_sm;
    cfg.gridDim = dim3(ctas);
    // 64 MiB into each SM used, shared by its CTAs and producers.
    const int iters =
        static_cast<int>((int64_t{64} << 20) / c.chunk / (c.ctas_per_sm * c.producers));
    const int64_t src_bytes = int64_t{c.src_mib} << 20;
    std::vector<double> us_samples;
    for (int r = 0; r < reps + 2; ++r) {
      CUDA_CHECK(cudaEventRecord(e0));
      CUDA_CHECK(cudaLaunchKernelEx(&cfg, StreamKernel, static_cast<const uint8_t*>(src), src_bytes,
                                    c.chunk, c.stages, c.producers, iters, c.cluster));
      CUDA_CHECK(cudaEventRecord(e1));
      CUDA_CHECK(cudaEventSynchronize(e1));
      CUDA_CHECK(cudaGetLastError());
      float t = 0;
      CUDA_CHECK(cudaEventElapsedTime(&t, e0, e1));
      if (r >= 2) us_samples.push_back(t * 1e3);
    }
    const double us = moe_ep::bench::P50(us_samples);
    const double bytes = double{1.0} * ctas * c.producers * iters * c.chunk;
    std::printf("%s,%d,%d,%d,%d,%d,%d,%d,%d,%d,%.1f,%.3f,%.1f\n", prop.name, c.cluster, ctas,
                c.ctas_per_sm, sms_used, c.producers, c.stages, c.chunk,
                c.stages * c.chunk * c.ctas_per_sm / 1024, c.src_mib, us, bytes / us / 1e6,
                bytes / us / 1e3 / sms_used);
    std::fflush(stdout);
  }
  cudaFree(src);
  return 0;
}
