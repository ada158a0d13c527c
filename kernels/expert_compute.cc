#include "kernels/expert_compute.h"

#include <vector>

#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/grouped_gemm.cuh"
#include "kernels/hopper_grouped_gemm.cuh"
#include "kernels/internal/cuda_status.h"
#include "kernels/route.cuh"

namespace moe_ep::kernels {
namespace {

constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;

}  // namespace

absl::Status ExpertCompute::Alloc(void** ptr, int64_t bytes, const char* what) {
  if (bytes <= 0) return absl::OkStatus();
  RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(ptr, bytes), what));
  allocated_bytes_ += bytes;
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ExpertCompute>> ExpertCompute::Create(int64_t max_rows, int top_k,
                                                                     int64_t hidden,
                                                                     int64_t max_intermediate,
                                                                     int max_local_experts) {
  if (max_rows < 0 || top_k < 1 || top_k > kMaxTopK || hidden < 4 || hidden % 4 != 0 ||
      max_intermediate < 0 || max_local_experts < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::Create: expected max_rows >= 0 (got %d), top_k in [1, %d] (got %d), "
        "hidden a positive multiple of 4 (got %d), max_intermediate >= 0 (got %d), "
        "max_local_experts >= 1 (got %d)",
        max_rows, kMaxTopK, top_k, hidden, max_intermediate, max_local_experts));
  }
  std::unique_ptr<ExpertCompute> ec(new ExpertCompute());
  ec->max_rows_ = max_rows;
  ec->top_k_ = top_k;
  ec->hidden_ = hidden;
  ec->max_intermediate_ = max_intermediate;
  ec->max_local_experts_ = max_local_experts;
  ec->hopper_available_ =
      max_local_experts <= kHopperGemmMaxExperts && HopperGroupedGemmAvailable().ok();
  const int64_t n = max_rows * top_k;
  ExpertEntryBuffers& b = ec->entries_;
  const int64_t ib = n * static_cast<int64_t>(sizeof(int32_t));
  RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&b.keys), ib, "cudaMalloc(keys)"));
  RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&b.values), ib, "cudaMalloc(values)"));
  RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&b.sorted_keys), ib, "cudaMalloc(keys)"));
  RETURN_IF_ERROR(
      ec->Alloc(reinterpret_cast<void**>(&b.sorted_values), ib, "cudaMalloc(sorted_values)"));
  RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&b.position), ib, "cudaMalloc(position)"));
  RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&b.offsets),
                            (max_local_experts + 1) * int64_t{sizeof(int32_t)},
                            "cudaMalloc(offsets)"));
  RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&ec->tile_offsets_),
                            (max_local_experts + 1) * int64_t{sizeof(int32_t)},
                            "cudaMalloc(tile_offsets)"));
  ASSIGN_OR_RETURN(b.sort_temp_bytes, SortTempBytes(n, max_local_experts));
  RETURN_IF_ERROR(ec->Alloc(&b.sort_temp, static_cast<int64_t>(b.sort_temp_bytes) + 16,
                            "cudaMalloc(sort_temp)"));
  if (max_intermediate > 0) {
    RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&ec->x_), n * hidden * 2, "cudaMalloc(x)"));
    RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&ec->gate_up_), n * 2 * max_intermediate * 4,
                              "cudaMalloc(gate_up)"));
    RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&ec->act_), n * max_intermediate * 2,
                              "cudaMalloc(act)"));
    RETURN_IF_ERROR(ec->Alloc(reinterpret_cast<void**>(&ec->y_), n * hidden * 4, "cudaMalloc(y)"));
    RETURN_IF_ERROR(
        ec->Alloc(&ec->cublas_workspace_, kCublasWorkspaceBytes, "cudaMalloc(cublas workspace)"));
    RETURN_IF_ERROR(internal::CublasStatus(cublasCreate(&ec->cublas_), "cublasCreate"));
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaMallocHost(reinterpret_cast<void**>(&ec->host_offsets_),
                                                      (max_local_experts + 1) * sizeof(int32_t)),
                                       "cudaMallocHost(offsets)"));
  return ec;
}

ExpertCompute::~ExpertCompute() {
  if (cublas_ != nullptr) cublasDestroy(cublas_);
  for (void* p : {static_cast<void*>(entries_.keys), static_cast<void*>(entries_.values),
                  static_cast<void*>(entries_.sorted_keys),
                  static_cast<void*>(entries_.sorted_values), static_cast<void*>(entries_.position),
                  static_cast<void*>(entries_.offsets), static_cast<void*>(tile_offsets_),
                  entries_.sort_temp, static_cast<void*>(x_), static_cast<void*>(gate_up_),
                  static_cast<void*>(act_), static_cast<void*>(y_), cublas_workspace_}) {
    cudaFree(p);
  }
  cudaFreeHost(host_offsets_);
}

absl::Status ExpertCompute::Run(const uint8_t* recv, int64_t num_rows,
                                const DeviceExpertSet& experts, uint16_t* combine_send,
                                cudaStream_t stream) {
  if (num_rows < 0 || num_rows > max_rows_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::Run: num_rows expected in [0, %d], got %d", max_rows_, num_rows));
  }
  if (experts.hidden() != hidden_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::Run: experts hidden expected %d, got %d", hidden_, experts.hidden()));
  }
  if (experts.num_experts() > max_local_experts_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ExpertCompute::Run: local experts expected <= %d, got %d",
                        max_local_experts_, experts.num_experts()));
  }
  const bool swiglu = experts.kind() == core::ExpertKind::kSwiGlu;
  const int64_t inter = experts.intermediate();
  if (swiglu && inter > max_intermediate_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ExpertCompute::Run: intermediate expected <= max_intermediate %d, got %d",
                        max_intermediate_, inter));
  }
  if (swiglu && gemm_ == ExpertGemm::kCublasHostCounts) {
    cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
    RETURN_IF_ERROR(
        internal::CudaStatus(cudaStreamIsCapturing(stream, &capture), "cudaStreamIsCapturing"));
    if (capture != cudaStreamCaptureStatusNone) {
      return absl::FailedPreconditionError(
          "ExpertCompute::Run: SwiGLU experts with kCublasHostCounts read per-expert row counts on "
          "the host and cannot be captured in a CUDA graph; use kGroupedDevice");
    }
  }
  if (num_rows == 0 || experts.num_experts() == 0) return absl::OkStatus();
  const int num_local = experts.num_experts();
  RETURN_IF_ERROR(LaunchGroupEntriesByExpert(recv, num_rows, hidden_, top_k_,
                                             experts.first_expert(), num_local, entries_, stream));
  if (!swiglu) {
    return LaunchWeightedExpertSum(recv, num_rows, hidden_, top_k_, entries_.position, nullptr,
                                   combine_send, stream);
  }
  const int64_t max_entries = num_rows * top_k_;
  RETURN_IF_ERROR(
      LaunchGatherExpertRows(recv, max_entries, hidden_, top_k_, entries_, num_local, x_, stream));
  if (gemm_ == ExpertGemm::kGroupedDevice && UsesHopperGemm(inter)) {
    HopperGemmParams gate_up;
    gate_up.a = x_;
    gate_up.max_rows = max_entries;
    gate_up.b = experts.gate_up();
    gate_up.offsets = entries_.offsets;
    gate_up.num_local_experts = num_local;
    gate_up.n = inter;
    gate_up.k = hidden_;
    RETURN_IF_ERROR(LaunchHopperGroupedSwiGlu(gate_up, act_, stream));
    HopperGemmParams down = gate_up;
    down.a = act_;
    down.b = experts.down();
    down.n = hidden_;
    down.k = inter;
    RETURN_IF_ERROR(LaunchHopperGroupedGemm(down, y_, stream));
    return LaunchWeightedExpertSum(recv, num_rows, hidden_, top_k_, entries_.position, y_,
                                   combine_send, stream);
  }
  if (gemm_ != ExpertGemm::kCublasHostCounts) {
    RETURN_IF_ERROR(LaunchExpertTileOffsets(entries_.offsets, num_local, tile_offsets_, stream));
    GroupedGemmParams gate_up;
    gate_up.a = x_;
    gate_up.max_rows = max_entries;
    gate_up.b = experts.gate_up();
    gate_up.offsets = entries_.offsets;
    gate_up.tile_offsets = tile_offsets_;
    gate_up.num_local_experts = num_local;
    gate_up.n = inter;
    gate_up.k = hidden_;
    RETURN_IF_ERROR(LaunchGroupedSwiGlu(gate_up, act_, stream));
    GroupedGemmParams down = gate_up;
    down.a = act_;
    down.b = experts.down();
    down.n = hidden_;
    down.k = inter;
    RETURN_IF_ERROR(LaunchGroupedGemm(down, y_, stream));
    return LaunchWeightedExpertSum(recv, num_rows, hidden_, top_k_, entries_.position, y_,
                                   combine_send, stream);
  }
  // The one documented host sync: cuBLAS takes each expert's m on the host.
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMemcpyAsync(host_offsets_, entries_.offsets, (num_local + 1) * sizeof(int32_t),
                      cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync(offsets)"));
  RETURN_IF_ERROR(internal::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));

  RETURN_IF_ERROR(internal::CublasStatus(cublasSetStream(cublas_, stream), "cublasSetStream"));
  RETURN_IF_ERROR(internal::CublasStatus(
      cublasSetWorkspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes), "cublasSetWorkspace"));
  const float one = 1.0f;
  const float zero = 0.0f;
  const int h = static_cast<int>(hidden_);
  const int i2 = static_cast<int>(2 * inter);
  const int i1 = static_cast<int>(inter);
  for (int l = 0; l < num_local; ++l) {
    const int m = host_offsets_[l + 1] - host_offsets_[l];
    if (m == 0) continue;
    const int64_t off = host_offsets_[l];
    // Row-major C[m, 2I] = X[m, H] * W[2I, H]^T, i.e. column-major
    // C^T[2I, m] = W^T^T * X^T: op(A) = T on W (ld H), op(B) = N on X (ld H).
    RETURN_IF_ERROR(internal::CublasStatus(
        cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, i2, m, h, &one,
                     experts.gate_up() + int64_t{l} * i2 * h, CUDA_R_16BF, h, x_ + off * h,
                     CUDA_R_16BF, h, &zero, gate_up_ + off * i2, CUDA_R_32F, i2, CUBLAS_COMPUTE_32F,
                     CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx(gate_up)"));
  }
  RETURN_IF_ERROR(
      LaunchSiluMul(gate_up_, entries_.offsets + num_local, max_entries, inter, act_, stream));
  for (int l = 0; l < num_local; ++l) {
    const int m = host_offsets_[l + 1] - host_offsets_[l];
    if (m == 0) continue;
    const int64_t off = host_offsets_[l];
    // Row-major Y[m, H] = act[m, I] * down[H, I]^T.
    RETURN_IF_ERROR(
        internal::CublasStatus(cublasGemmEx(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, h, m, i1, &one,
                                            experts.down() + int64_t{l} * h * i1, CUDA_R_16BF, i1,
                                            act_ + off * i1, CUDA_R_16BF, i1, &zero, y_ + off * h,
                                            CUDA_R_32F, h, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                               "cublasGemmEx(down)"));
  }
  return LaunchWeightedExpertSum(recv, num_rows, hidden_, top_k_, entries_.position, y_,
                                 combine_send, stream);
}

}  // namespace moe_ep::kernels
