#pragma once

// Expert compute on the GPU for the rows a rank received in dispatch
// (DESIGN §7): out[r] = sum over k whose expert is local of
// w[r,k] * expert_{ids[r,k]}(x[r]), written as bf16 into the combine send
// buffer.
//
// SwiGLU path: group (row, k) entries by local expert (stable radix sort,
// deterministic), gather each expert's rows into a contiguous bf16 block, then
// per expert one cuBLAS GEMM x [m, H] * gate_up^T -> [m, 2I] (bf16 in, fp32
// out, CUBLAS_COMPUTE_32F), silu(gate) * up -> bf16 [m, I], one GEMM
// act * down^T -> y [m, H] fp32, and a weighted per-row sum in fp32 over k in
// ascending order. Identity path: the same grouping, then out = (sum of local
// weights) * x, with no GEMM.
//
// Scratch (allocated once in Create, sized for max_rows * K entries):
//   keys/values/sorted/position int32 [max_rows*K] x 5, offsets [L+1],
//   cub sort temp, x bf16 [max_rows*K, H], gate_up fp32 [max_rows*K, 2I],
//   act bf16 [max_rows*K, I], y fp32 [max_rows*K, H]: one slab of
//   ScratchBytes() bytes, owned or the caller's (Create's `scratch`), so the
//   drop in free device memory is the reported figure (issue 10 item 2).
//   kCublasHostCounts adds a 32 MiB cuBLAS workspace (counted) and a cuBLAS
//   handle, whose own device memory (66 MiB on an H200, measured in
//   bench/results/run12) cuBLAS does not report: made only when chosen.
// GEMMs (ExpertGemm, set_gemm):
//   kGroupedDevice (default): grouped kernels that read each expert's row
//     count on the device; gate_up and silu are fused (act = bf16(silu(x
//     Wg^T) * (x Wu^T)), fp32 inside), then y = act down^T in fp32. No host
//     sync: graph-capturable. On an sm_90 device with a 90a build the Hopper
//     wgmma + TMA kernels of kernels/hopper_grouped_gemm.cuh run (issue 14);
//     elsewhere, or when H or I is not a multiple of 8, the WMMA kernels of
//     kernels/grouped_gemm.cuh.
//   kGroupedWmma: always the WMMA kernels (capturable); kept for comparison.
//   kCublasHostCounts: the L+1 expert offsets are copied to pinned host
//     memory and the stream is synchronised once (cuBLAS takes each expert's
//     m on the host); not graph-capturable. Kept for comparison.
// Both round act to bf16 before the down GEMM and accumulate in fp32. The
// identity path never synchronises and is capturable.
// Not thread-safe. Source: DESIGN §7, issue 3.

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "kernels/device_experts.h"
#include "kernels/expert_kernels.cuh"

namespace moe_ep::kernels {

// How the SwiGLU GEMMs get each expert's row count (see above).
enum class ExpertGemm {
  kGroupedDevice,     // device-side counts, Hopper kernels where available, capturable
  kGroupedWmma,       // device-side counts, grouped WMMA kernels, capturable
  kCublasHostCounts,  // cuBLAS per expert, one host sync, not capturable
};

// CheckCapturable()
//
// Whether a step with experts of `kind` computed by `gemm` can be captured
// into a CUDA graph: SwiGLU with kCublasHostCounts reads per-expert row
// counts on the host and cannot (kFailedPrecondition naming the rank and
// kGroupedDevice); everything else is OK. Both device data planes' Capture
// calls ask this (review duplicate D1). Pure.
absl::Status CheckCapturable(int rank, core::ExpertKind kind, ExpertGemm gemm);

class ExpertCompute {
 public:
  // max_rows: received rows per step at most (E * N). max_intermediate: I of
  // the largest SwiGLU expert set to run (0: identity only).
  // `scratch`: null to allocate the slab here (freed on destruction), or
  // device memory of at least ScratchBytes() bytes, 128-byte aligned, that
  // outlives this object (the GPU dispatcher's one allocation).
  // Errors: kInvalidArgument (sizes), kResourceExhausted (cudaMalloc).
  static absl::StatusOr<std::unique_ptr<ExpertCompute>> Create(int64_t max_rows, int top_k,
                                                               int64_t hidden,
                                                               int64_t max_intermediate,
                                                               int max_local_experts,
                                                               void* scratch = nullptr);
  // Device bytes of the scratch slab Create needs for these sizes.
  // Errors: kInvalidArgument (sizes), kInternal (cub).
  static absl::StatusOr<int64_t> ScratchBytes(int64_t max_rows, int top_k, int64_t hidden,
                                              int64_t max_intermediate, int max_local_experts);
  ~ExpertCompute();
  ExpertCompute(const ExpertCompute&) = delete;
  ExpertCompute& operator=(const ExpertCompute&) = delete;

  // Enqueues the expert compute for `num_rows` rows of `recv` ([rows, 2H+8K])
  // on `stream`, writing `combine_send` [rows, H] bf16 (rows with no local
  // expert are not written). Experts whose router_weight_use() is
  // kScalesInput (Llama-4; issue 35 item 5) compute sum_k e(bf16(w * x)):
  // the gathered row is scaled by the entry's weight, the sum weighs 1.
  // Errors: kInvalidArgument (num_rows > max_rows, experts' H differs, I >
  // max_intermediate, more local experts than max_local_experts),
  // kFailedPrecondition (SwiGLU with kCublasHostCounts while `stream` is
  // capturing), kInternal (CUDA/cuBLAS).
  absl::Status Run(const uint8_t* recv, int64_t num_rows, const DeviceExpertSet& experts,
                   uint16_t* combine_send, cudaStream_t stream);

  // Run with fp8 experts (DeviceExpertSet kind kFp8SwiGlu) is RunFp8 on
  // DeviceExpertSet::fp8().
  //
  // RunFp8()
  //
  // Run's SwiGLU with fp8 block-scaled experts (issue 35 item 3): the same
  // grouping, then on the Hopper kernels of kernels/fp8_grouped_gemm.cuh:
  // each gathered row quantized per 128 channels (core/fp8_e4m3.h's rule:
  // scale = amax / 448, codes of the bf16 values), gate/up with fp32
  // promotion of every 128-wide K block by both scales, act = bf16(silu(g) *
  // u) re-quantized per 128 columns the same way, down likewise, expert
  // outputs rounded to bf16, then the weighted sum over k ascending in fp32
  // into `combine_send` [rows, H] bf16 (rows with no local expert are not
  // written). Uses the scratch slab of Create (no extra memory; needs
  // max_intermediate >= I). Never allocates or synchronises: capturable.
  // Errors: kInvalidArgument (num_rows > max_rows, experts.hidden != H, I
  // not in [128, max_intermediate] or not a multiple of 128, more local
  // experts than max_local_experts, null slot ids or null or unaligned
  // weights), kFailedPrecondition (no sm_90a device or build), kInternal (CUDA).
  // experts.scales_input: the row quantized is bf16(w * x), the sum weighs 1
  // (Llama-4, as Run).
  absl::Status RunFp8(const uint8_t* recv, int64_t num_rows, const Fp8SwiGluExperts& experts,
                      uint16_t* combine_send, cudaStream_t stream);

  // Run with gpt-oss mxfp4 experts (kind kGptOssMxfp4) is RunMxfp4 on
  // DeviceExpertSet::mxfp4().
  //
  // RunMxfp4()
  //
  // Run with gpt-oss's mxfp4 experts (issue 35 item 3), the arithmetic of
  // core::quant::GptOssExpertForward: the same grouping, each expert's rows
  // gathered as bf16 (bf16(w * x) when experts.scales_input), then on the
  // kernels of kernels/mxfp4_grouped_gemm.cuh gate_up + bias and the clamped
  // SwiGLU fused (act = bf16(GptOssGlu(g, u)) [rows, I]), the down GEMM + bias
  // in fp32, and the weighted sum over k ascending in fp32 into
  // `combine_send` [rows, H] bf16 (rows with no local expert are not
  // written). Uses the scratch slab of Create (needs max_intermediate >= I).
  // Never allocates or synchronises: capturable.
  // Errors: kInvalidArgument (num_rows > max_rows, experts.hidden != H, I
  // not in [64, max_intermediate], H or I not a multiple of 64, more local
  // experts than max_local_experts, null pointers), kInternal (CUDA).
  absl::Status RunMxfp4(const uint8_t* recv, int64_t num_rows, const Mxfp4Experts& experts,
                        uint16_t* combine_send, cudaStream_t stream);

  // RunFp8's tile height (Fp8GemmParams::tile_rows: 0 picks from the rows
  // per expert, 128 or 256 forces one), for benches and tests.
  void SetFp8TileRowsForTest(int rows) { fp8_tile_rows_ = rows; }
  // Fp8GemmParams::cluster of both fp8 GEMMs (0 auto; benches compare).
  void SetFp8ClusterForTest(int cluster) { fp8_cluster_ = cluster; }
  // Fp8GemmParams::l2_hint of both fp8 GEMMs (0 none; benches compare).
  void SetFp8L2HintForTest(int hint) { fp8_l2_hint_ = hint; }
  // Fp8GemmParams::l2_prefetch of both fp8 GEMMs (-1 default; benches sweep).
  void SetFp8L2PrefetchForTest(int blocks) { fp8_l2_prefetch_ = blocks; }

  // Device bytes of scratch in use: the slab (owned or borrowed), plus the
  // cuBLAS workspace once kCublasHostCounts was chosen.
  int64_t allocated_bytes() const { return allocated_bytes_; }

  // Chooses the GEMM path. kCublasHostCounts (SwiGLU only) creates the cuBLAS
  // handle and its workspace on first choice.
  // Errors: kResourceExhausted (cudaMalloc), kFailedPrecondition (cuBLAS
  // cannot be opened: kernels/internal/cublas_loader.h), kInternal
  // (cublasCreate).
  absl::Status set_gemm(ExpertGemm gemm);
  // True when kGroupedDevice runs the Hopper kernels for intermediate size
  // `intermediate` (device, build and alignment allow it).
  bool UsesHopperGemm(int64_t intermediate) const {
    return hopper_available_ && hidden_ % 8 == 0 && intermediate % 8 == 0;
  }
  ExpertGemm gemm() const { return gemm_; }

 private:
  struct ScratchPlan;
  ExpertCompute() = default;
  static absl::StatusOr<ScratchPlan> Plan(int64_t max_rows, int top_k, int64_t hidden,
                                          int64_t max_intermediate, int max_local_experts);

  int64_t max_rows_ = 0;
  int top_k_ = 0;
  int64_t hidden_ = 0;
  int64_t max_intermediate_ = 0;
  int max_local_experts_ = 0;
  int64_t allocated_bytes_ = 0;
  ExpertGemm gemm_ = ExpertGemm::kGroupedDevice;
  bool hopper_available_ = false;  // HopperGroupedGemmAvailable() at Create
  int fp8_tile_rows_ = 0;          // SetFp8TileRowsForTest
  int fp8_cluster_ = 0;            // SetFp8ClusterForTest
  int fp8_l2_prefetch_ = -1;       // SetFp8L2PrefetchForTest
  int fp8_l2_hint_ = 0;            // SetFp8L2HintForTest
  ExpertEntryBuffers entries_;
  int32_t* tile_offsets_ = nullptr;  // device [max_local_experts + 1]
  uint16_t* x_ = nullptr;
  float* gate_up_ = nullptr;
  uint16_t* act_ = nullptr;
  float* y_ = nullptr;
  void* owned_scratch_ = nullptr;     // the slab when Create allocated it
  void* cublas_workspace_ = nullptr;  // kCublasHostCounts only
  int32_t* host_offsets_ = nullptr;   // pinned [max_local_experts + 1]
  cublasHandle_t cublas_ = nullptr;
};

}  // namespace moe_ep::kernels
