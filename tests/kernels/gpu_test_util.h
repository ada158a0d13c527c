#pragma once

// Helpers shared by the GPU tests: device detection with a printed skip
// reason, device buffers, seeded MoE inputs. Test-only.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "core/bf16.h"
#include "kernels/dispatch_pack.cuh"

namespace moe_ep::kernels::testing {

// Number of CUDA devices; 0 when there is no driver or device.
inline int GpuCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// Skips the test with a printed reason when fewer than `needed` GPUs exist.
#define MOE_EP_REQUIRE_GPUS(needed)                                                        \
  do {                                                                                     \
    const int moe_ep_gpus_ = ::moe_ep::kernels::testing::GpuCount();                       \
    if (moe_ep_gpus_ < (needed)) {                                                         \
      std::printf("[  SKIPPED ] needs %d CUDA device(s), cudaGetDeviceCount reports %d\n", \
                  (needed), moe_ep_gpus_);                                                 \
      GTEST_SKIP() << "needs " << (needed) << " CUDA device(s), found " << moe_ep_gpus_;   \
    }                                                                                      \
  } while (0)

// A device buffer of T elements; copies from/to host vectors.
template <typename T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    if (count_ > 0) {
      EXPECT_EQ(cudaMalloc(&ptr_, count_ * sizeof(T)), cudaSuccess);
    }
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { Upload(host); }
  ~DeviceBuffer() { cudaFree(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  void Upload(const std::vector<T>& host) {
    if (!host.empty()) {
      EXPECT_EQ(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
                cudaSuccess);
    }
  }
  std::vector<T> Download(size_t count) const {
    std::vector<T> host(count);
    if (count > 0) {
      EXPECT_EQ(cudaMemcpy(host.data(), ptr_, count * sizeof(T), cudaMemcpyDeviceToHost),
                cudaSuccess);
    }
    return host;
  }
  T* get() const { return ptr_; }

 private:
  size_t count_;
  T* ptr_ = nullptr;
};

// Seeded inputs of one rank: hidden uniform in [-1, 1] (bf16), K distinct
// expert ids per token, a fraction of them replaced by the configured invalid
// id (DESIGN §7: no other out-of-range id is valid input; route_test covers
// those), weights uniform in (0, 1).
struct MoeInputs {
  std::vector<core::bf16_t> hidden;  // [T, H]
  std::vector<int32_t> ids;          // [T, K]
  std::vector<float> weights;        // [T, K]
};

inline MoeInputs MakeInputs(uint64_t seed, int64_t num_tokens, int64_t hidden, int top_k,
                            int num_experts, double invalid_fraction, int32_t invalid_id = -1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> value(-1.0f, 1.0f);
  std::uniform_real_distribution<float> weight(0.05f, 1.0f);
  std::uniform_real_distribution<double> coin(0.0, 1.0);
  std::uniform_int_distribution<int> expert(0, num_experts - 1);
  MoeInputs in;
  in.hidden.resize(num_tokens * hidden);
  for (auto& h : in.hidden) h = core::FloatToBf16(value(rng));
  in.ids.resize(num_tokens * top_k);
  in.weights.resize(num_tokens * top_k);
  for (int64_t t = 0; t < num_tokens; ++t) {
    std::vector<int32_t> chosen;
    while (static_cast<int>(chosen.size()) < top_k) {
      const int32_t e = expert(rng);
      bool dup = false;
      for (int32_t c : chosen) dup = dup || c == e;
      if (!dup || top_k > num_experts) chosen.push_back(e);
    }
    for (int k = 0; k < top_k; ++k) {
      int32_t id = chosen[k];
      if (coin(rng) < invalid_fraction) id = invalid_id;
      in.ids[t * top_k + k] = id;
      in.weights[t * top_k + k] = weight(rng);
    }
  }
  return in;
}

// The received rows of `in` as dispatch packs them: [rows, 2H + 8K] of
// hidden bf16 | ids int32 | weights fp32 (DispatchRowBytes).
inline std::vector<uint8_t> PackRows(const MoeInputs& in, int64_t rows, int64_t hidden, int top_k) {
  const int64_t row_bytes = DispatchRowBytes(hidden, top_k);
  std::vector<uint8_t> out(rows * row_bytes);
  for (int64_t r = 0; r < rows; ++r) {
    uint8_t* row = out.data() + r * row_bytes;
    std::memcpy(row, in.hidden.data() + r * hidden, hidden * 2);
    std::memcpy(row + 2 * hidden, in.ids.data() + r * top_k, 4 * top_k);
    std::memcpy(row + 2 * hidden + 4 * top_k, in.weights.data() + r * top_k, 4 * top_k);
  }
  return out;
}

// Captures what `enqueue` puts on a fresh stream into a CUDA graph, replays
// it once and waits: the status of the capture (failures are recorded).
inline absl::Status ReplayFromGraph(const std::function<absl::Status(cudaStream_t)>& enqueue) {
  cudaStream_t stream;
  EXPECT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  cudaGraph_t graph;
  EXPECT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  const absl::Status captured = enqueue(stream);
  EXPECT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  if (captured.ok()) {
    cudaGraphExec_t exec;
    EXPECT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    cudaGraphExecDestroy(exec);
  }
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  return captured;
}

}  // namespace moe_ep::kernels::testing
