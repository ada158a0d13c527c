#include "kernels/expert_compute.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "core/status_macros.h"
#include "kernels/fp8_expert_kernels.cuh"
#include "kernels/fp8_grouped_gemm.cuh"
#include "kernels/grouped_gemm.cuh"
#include "kernels/hopper_grouped_gemm.cuh"
#include "kernels/internal/cublas_loader.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/kernel_preload.h"
#include "kernels/mxfp4_grouped_gemm.cuh"
#include "kernels/route.cuh"

namespace moe_ep::kernels {

absl::Status CheckCapturable(int rank, core::ExpertKind kind, ExpertGemm gemm) {
  if (kind == core::ExpertKind::kSwiGlu && gemm == ExpertGemm::kCublasHostCounts) {
    return absl::FailedPreconditionError(absl::StrFormat(
        "CaptureForward on rank %d: SwiGLU expert compute with kCublasHostCounts reads "
        "per-expert row counts on the host and cannot be captured; use kGroupedDevice",
        rank));
  }
  return absl::OkStatus();
}
namespace {

constexpr int64_t kCublasWorkspaceBytes = int64_t{32} << 20;

}  // namespace

// The scratch as offsets into one slab, in a fixed order, each part aligned
// to 128 bytes (TMA and vector loads need 16), so the slab is one allocation
// and its size is exactly what the parts need. cub's sort temp gets 256 bytes
// of slack and is aligned to 256 inside it, whatever the slab's base.
struct ExpertCompute::ScratchPlan {
  int64_t keys = 0, values = 0, sorted_keys = 0, sorted_values = 0, position = 0;
  int64_t offsets = 0, tile_offsets = 0, sort_temp = 0, x = 0, gate_up = 0, act = 0, y = 0;
  size_t sort_temp_bytes = 0;
  int64_t total = 0;
};

namespace {

int64_t Take(int64_t* cursor, int64_t bytes) {
  constexpr int64_t kAlign = 128;
  const int64_t at = *cursor;
  *cursor += (bytes + kAlign - 1) / kAlign * kAlign;
  return at;
}

// Bytes of `rows` rows of `width` e4m3 codes, then (128-byte aligned) their
// scales [width / 128, rows] fp32: RunFp8's activation layout.
int64_t Fp8RowsBytes(int64_t rows, int64_t width) {
  return (rows * width + 127) / 128 * 128 + rows * (width / kFp8ScaleBlock) * 4;
}

absl::Status CheckSizes(int64_t max_rows, int top_k, int64_t hidden, int64_t max_intermediate,
                        int max_local_experts) {
  if (max_rows < 0 || top_k < 1 || top_k > kMaxTopK || hidden < 4 || hidden % 4 != 0 ||
      max_intermediate < 0 || max_local_experts < 1) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::Create: expected max_rows >= 0 (got %d), top_k in [1, %d] (got %d), "
        "hidden a positive multiple of 4 (got %d), max_intermediate >= 0 (got %d), "
        "max_local_experts >= 1 (got %d)",
        max_rows, kMaxTopK, top_k, hidden, max_intermediate, max_local_experts));
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<ExpertCompute::ScratchPlan> ExpertCompute::Plan(int64_t max_rows, int top_k,
                                                               int64_t hidden,
                                                               int64_t max_intermediate,
                                                               int max_local_experts) {
  RETURN_IF_ERROR(CheckSizes(max_rows, top_k, hidden, max_intermediate, max_local_experts));
  const int64_t n = max_rows * top_k;
  const int64_t ib = n * static_cast<int64_t>(sizeof(int32_t));
  const int64_t lb = (max_local_experts + 1) * static_cast<int64_t>(sizeof(int32_t));
  ScratchPlan plan;
  int64_t cursor = 0;
  plan.keys = Take(&cursor, ib);
  plan.values = Take(&cursor, ib);
  plan.sorted_keys = Take(&cursor, ib);
  plan.sorted_values = Take(&cursor, ib);
  plan.position = Take(&cursor, ib);
  plan.offsets = Take(&cursor, lb);
  plan.tile_offsets = Take(&cursor, lb);
  ASSIGN_OR_RETURN(plan.sort_temp_bytes, SortTempBytes(n, max_local_experts));
  plan.sort_temp = Take(&cursor, static_cast<int64_t>(plan.sort_temp_bytes) + 256);
  if (max_intermediate > 0) {
    // RunFp8 keeps its codes and scales in the x and gate_up parts.
    plan.x = Take(&cursor, std::max(n * hidden * 2, Fp8RowsBytes(n, hidden)));
    plan.gate_up =
        Take(&cursor, std::max(n * 2 * max_intermediate * 4, Fp8RowsBytes(n, max_intermediate)));
    plan.act = Take(&cursor, n * max_intermediate * 2);
    plan.y = Take(&cursor, n * hidden * 4);
  }
  plan.total = cursor;
  return plan;
}

absl::StatusOr<int64_t> ExpertCompute::ScratchBytes(int64_t max_rows, int top_k, int64_t hidden,
                                                    int64_t max_intermediate,
                                                    int max_local_experts) {
  ASSIGN_OR_RETURN(ScratchPlan plan,
                   Plan(max_rows, top_k, hidden, max_intermediate, max_local_experts));
  return plan.total;
}

absl::StatusOr<std::unique_ptr<ExpertCompute>> ExpertCompute::Create(int64_t max_rows, int top_k,
                                                                     int64_t hidden,
                                                                     int64_t max_intermediate,
                                                                     int max_local_experts,
                                                                     void* scratch) {
  ASSIGN_OR_RETURN(ScratchPlan plan,
                   Plan(max_rows, top_k, hidden, max_intermediate, max_local_experts));
  std::unique_ptr<ExpertCompute> ec(new ExpertCompute());
  ec->max_rows_ = max_rows;
  ec->top_k_ = top_k;
  ec->hidden_ = hidden;
  ec->max_intermediate_ = max_intermediate;
  ec->max_local_experts_ = max_local_experts;
  ec->hopper_available_ =
      max_local_experts <= kHopperGemmMaxExperts && HopperGroupedGemmAvailable().ok();
  // No lazy load on the step path (kernels/kernel_preload.h).
  RETURN_IF_ERROR(PreloadStepKernels());
  ec->allocated_bytes_ = plan.total;
  char* base = static_cast<char*>(scratch);
  if (base == nullptr) {
    RETURN_IF_ERROR(
        internal::CudaStatus(cudaMalloc(&ec->owned_scratch_, plan.total),
                             absl::StrFormat("cudaMalloc(expert scratch, %d bytes)", plan.total)));
    base = static_cast<char*>(ec->owned_scratch_);
  }
  ExpertEntryBuffers& b = ec->entries_;
  b.keys = reinterpret_cast<int32_t*>(base + plan.keys);
  b.values = reinterpret_cast<int32_t*>(base + plan.values);
  b.sorted_keys = reinterpret_cast<int32_t*>(base + plan.sorted_keys);
  b.sorted_values = reinterpret_cast<int32_t*>(base + plan.sorted_values);
  b.position = reinterpret_cast<int32_t*>(base + plan.position);
  b.offsets = reinterpret_cast<int32_t*>(base + plan.offsets);
  ec->tile_offsets_ = reinterpret_cast<int32_t*>(base + plan.tile_offsets);
  // Round up to 256 bytes by pointer arithmetic (the plan reserved 256 extra).
  char* const sort_temp = base + plan.sort_temp;
  b.sort_temp = sort_temp + (256 - reinterpret_cast<uintptr_t>(sort_temp) % 256) % 256;
  b.sort_temp_bytes = plan.sort_temp_bytes;
  if (max_intermediate > 0) {
    ec->x_ = reinterpret_cast<uint16_t*>(base + plan.x);
    ec->gate_up_ = reinterpret_cast<float*>(base + plan.gate_up);
    ec->act_ = reinterpret_cast<uint16_t*>(base + plan.act);
    ec->y_ = reinterpret_cast<float*>(base + plan.y);
  }
  RETURN_IF_ERROR(internal::CudaStatus(cudaMallocHost(reinterpret_cast<void**>(&ec->host_offsets_),
                                                      (max_local_experts + 1) * sizeof(int32_t)),
                                       "cudaMallocHost(offsets)"));
  return ec;
}

absl::Status ExpertCompute::set_gemm(ExpertGemm gemm) {
  if (gemm == ExpertGemm::kCublasHostCounts && max_intermediate_ > 0 && cublas_ == nullptr) {
    ASSIGN_OR_RETURN(const internal::CublasApi* api, internal::LoadCublas());
    if (cublas_workspace_ == nullptr) {
      RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(&cublas_workspace_, kCublasWorkspaceBytes),
                                           "cudaMalloc(cublas workspace)"));
      allocated_bytes_ += kCublasWorkspaceBytes;
    }
    RETURN_IF_ERROR(internal::CublasStatus(*api, api->create(&cublas_), "cublasCreate"));
  }
  gemm_ = gemm;
  return absl::OkStatus();
}

ExpertCompute::~ExpertCompute() {
  if (cublas_ != nullptr) {
    // A handle exists only where LoadCublas succeeded, so this finds it open.
    absl::StatusOr<const internal::CublasApi*> api = internal::LoadCublas();
    if (api.ok()) (*api)->destroy(cublas_);
  }
  cudaFree(cublas_workspace_);
  cudaFree(owned_scratch_);
  cudaFreeHost(host_offsets_);
}

absl::Status ExpertCompute::Run(const uint8_t* recv, int64_t num_rows,
                                const DeviceExpertSet& experts, uint16_t* combine_send,
                                cudaStream_t stream) {
  if (experts.kind() == core::ExpertKind::kFp8SwiGlu) {
    return RunFp8(recv, num_rows, experts.fp8(), combine_send, stream);
  }
  if (experts.kind() == core::ExpertKind::kGptOssMxfp4) {
    return RunMxfp4(recv, num_rows, experts.mxfp4(), combine_send, stream);
  }
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
  RETURN_IF_ERROR(LaunchGroupEntriesByExpert(
      recv, num_rows, hidden_, top_k_, experts.device_slot_ids(), num_local, entries_, stream));
  if (!swiglu) {
    return LaunchWeightedExpertSum(recv, num_rows, hidden_, top_k_, entries_.position, nullptr,
                                   combine_send, stream);
  }
  const int64_t max_entries = num_rows * top_k_;
  // Llama-4 (issue 35 item 5): the weight scales the gathered input, and each
  // expert output enters the sum with weight 1.
  const bool scale_input = experts.router_weight_use() == core::RouterWeightUse::kScalesInput;
  RETURN_IF_ERROR(LaunchGatherExpertRows(recv, max_entries, hidden_, top_k_, entries_, num_local,
                                         x_, stream, scale_input));
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
                                   combine_send, stream, scale_input);
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
                                   combine_send, stream, scale_input);
  }
  // The one documented host sync: cuBLAS takes each expert's m on the host.
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMemcpyAsync(host_offsets_, entries_.offsets, (num_local + 1) * sizeof(int32_t),
                      cudaMemcpyDeviceToHost, stream),
      "cudaMemcpyAsync(offsets)"));
  RETURN_IF_ERROR(internal::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize"));

  ASSIGN_OR_RETURN(const internal::CublasApi* api, internal::LoadCublas());
  RETURN_IF_ERROR(
      internal::CublasStatus(*api, api->set_stream(cublas_, stream), "cublasSetStream"));
  RETURN_IF_ERROR(internal::CublasStatus(
      *api, api->set_workspace(cublas_, cublas_workspace_, kCublasWorkspaceBytes),
      "cublasSetWorkspace"));
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
        *api,
        api->gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, i2, m, h, &one,
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
        internal::CublasStatus(*api,
                               api->gemm_ex(cublas_, CUBLAS_OP_T, CUBLAS_OP_N, h, m, i1, &one,
                                            experts.down() + int64_t{l} * h * i1, CUDA_R_16BF, i1,
                                            act_ + off * i1, CUDA_R_16BF, i1, &zero, y_ + off * h,
                                            CUDA_R_32F, h, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                               "cublasGemmEx(down)"));
  }
  return LaunchWeightedExpertSum(recv, num_rows, hidden_, top_k_, entries_.position, y_,
                                 combine_send, stream, scale_input);
}

absl::Status ExpertCompute::RunFp8(const uint8_t* recv, int64_t num_rows,
                                   const Fp8SwiGluExperts& experts, uint16_t* combine_send,
                                   cudaStream_t stream) {
  if (num_rows < 0 || num_rows > max_rows_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::RunFp8: num_rows expected in [0, %d], got %d", max_rows_, num_rows));
  }
  if (experts.hidden != hidden_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::RunFp8: experts hidden expected %d, got %d", hidden_, experts.hidden));
  }
  const int64_t inter = experts.intermediate;
  if (inter < kFp8ScaleBlock || inter > max_intermediate_ || inter % kFp8ScaleBlock != 0 ||
      hidden_ % kFp8ScaleBlock != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::RunFp8: intermediate expected a multiple of %d in [%d, max_intermediate "
        "%d] and hidden a multiple of %d, got intermediate %d, hidden %d",
        kFp8ScaleBlock, kFp8ScaleBlock, max_intermediate_, kFp8ScaleBlock, inter, hidden_));
  }
  if (experts.num_experts < 0 || experts.num_experts > max_local_experts_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ExpertCompute::RunFp8: local experts expected in [0, %d], got %d",
                        max_local_experts_, experts.num_experts));
  }
  if (experts.num_experts > 0 &&
      (experts.slot_ids == nullptr || experts.gate_up == nullptr ||
       experts.gate_up_scale == nullptr || experts.down == nullptr ||
       experts.down_scale == nullptr || reinterpret_cast<uintptr_t>(experts.gate_up) % 16 != 0 ||
       reinterpret_cast<uintptr_t>(experts.down) % 16 != 0)) {
    return absl::InvalidArgumentError(
        "ExpertCompute::RunFp8: slot_ids, gate_up, gate_up_scale, down and down_scale must be "
        "non-null device pointers, the codes 16-byte aligned");
  }
  if (!hopper_available_) {
    return absl::FailedPreconditionError(
        absl::StrCat("ExpertCompute::RunFp8 needs the Hopper kernels: ",
                     HopperGroupedGemmAvailable().message()));
  }
  if (num_rows == 0 || experts.num_experts == 0) return absl::OkStatus();
  const int num_local = experts.num_experts;
  RETURN_IF_ERROR(LaunchGroupEntriesByExpert(recv, num_rows, hidden_, top_k_, experts.slot_ids,
                                             num_local, entries_, stream));
  const int64_t max_entries = num_rows * top_k_;
  // Scratch: x part = codes [entries, H] | scales [H/128, entries]; gate_up
  // part = act codes [entries, I] | scales [I/128, entries]; y part = bf16 y.
  auto* x_codes = reinterpret_cast<uint8_t*>(x_);
  auto* x_scales = reinterpret_cast<float*>(x_codes + (max_entries * hidden_ + 127) / 128 * 128);
  auto* act_codes = reinterpret_cast<uint8_t*>(gate_up_);
  auto* act_scales = reinterpret_cast<float*>(act_codes + (max_entries * inter + 127) / 128 * 128);
  auto* y = reinterpret_cast<uint16_t*>(y_);
  RETURN_IF_ERROR(LaunchGatherQuantizeExpertRows(recv, max_entries, hidden_, top_k_, entries_,
                                                 num_local, x_codes, x_scales, max_entries, stream,
                                                 experts.scales_input));
  Fp8GemmParams gate_up;
  gate_up.a = x_codes;
  gate_up.a_scale = x_scales;
  gate_up.a_scale_stride = max_entries;
  gate_up.max_rows = max_entries;
  gate_up.b = experts.gate_up;
  gate_up.b_scale = experts.gate_up_scale;
  gate_up.offsets = entries_.offsets;
  gate_up.num_local_experts = num_local;
  gate_up.n = inter;
  gate_up.k = hidden_;
  gate_up.tile_rows = fp8_tile_rows_;
  gate_up.cluster = fp8_cluster_;
  gate_up.l2_prefetch = fp8_l2_prefetch_;
  gate_up.l2_hint = fp8_l2_hint_;
  RETURN_IF_ERROR(LaunchFp8GroupedSwiGlu(gate_up, act_codes, act_scales, max_entries, stream));
  Fp8GemmParams down = gate_up;
  down.a = act_codes;
  down.a_scale = act_scales;
  down.b = experts.down;
  down.b_scale = experts.down_scale;
  down.n = hidden_;
  down.k = inter;
  RETURN_IF_ERROR(LaunchFp8GroupedGemm(down, y, stream));
  return LaunchWeightedExpertSumBf16(recv, num_rows, hidden_, top_k_, entries_.position, y,
                                     combine_send, stream, experts.scales_input);
}

absl::Status ExpertCompute::RunMxfp4(const uint8_t* recv, int64_t num_rows,
                                     const Mxfp4Experts& experts, uint16_t* combine_send,
                                     cudaStream_t stream) {
  if (num_rows < 0 || num_rows > max_rows_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::RunMxfp4: num_rows expected in [0, %d], got %d", max_rows_, num_rows));
  }
  if (experts.hidden != hidden_) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::RunMxfp4: experts hidden expected %d, got %d", hidden_, experts.hidden));
  }
  const int64_t inter = experts.intermediate;
  if (inter < kMxfp4KStep || inter > max_intermediate_ || inter % kMxfp4KStep != 0 ||
      hidden_ % kMxfp4KStep != 0) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "ExpertCompute::RunMxfp4: intermediate expected a multiple of %d in [%d, max_intermediate "
        "%d] and hidden a multiple of %d, got intermediate %d, hidden %d",
        kMxfp4KStep, kMxfp4KStep, max_intermediate_, kMxfp4KStep, inter, hidden_));
  }
  if (experts.num_experts < 0 || experts.num_experts > max_local_experts_) {
    return absl::InvalidArgumentError(
        absl::StrFormat("ExpertCompute::RunMxfp4: local experts expected in [0, %d], got %d",
                        max_local_experts_, experts.num_experts));
  }
  if (experts.num_experts > 0 &&
      (experts.slot_ids == nullptr || experts.gate_up_blocks == nullptr ||
       experts.gate_up_scales == nullptr || experts.gate_up_bias == nullptr ||
       experts.down_blocks == nullptr || experts.down_scales == nullptr ||
       experts.down_bias == nullptr)) {
    return absl::InvalidArgumentError(
        "ExpertCompute::RunMxfp4: slot_ids and the six weight arrays must be device pointers");
  }
  if (num_rows == 0 || experts.num_experts == 0) return absl::OkStatus();
  const int num_local = experts.num_experts;
  RETURN_IF_ERROR(LaunchGroupEntriesByExpert(recv, num_rows, hidden_, top_k_, experts.slot_ids,
                                             num_local, entries_, stream));
  const int64_t max_entries = num_rows * top_k_;
  RETURN_IF_ERROR(LaunchGatherExpertRows(recv, max_entries, hidden_, top_k_, entries_, num_local,
                                         x_, stream, experts.scales_input));
  Mxfp4GemmParams gate_up;
  gate_up.a = x_;
  gate_up.max_rows = max_entries;
  gate_up.blocks = experts.gate_up_blocks;
  gate_up.scales = experts.gate_up_scales;
  gate_up.bias = experts.gate_up_bias;
  gate_up.offsets = entries_.offsets;
  gate_up.num_local_experts = num_local;
  gate_up.n = inter;
  gate_up.k = hidden_;
  RETURN_IF_ERROR(LaunchMxfp4GroupedGptOssGlu(gate_up, experts.activation.alpha,
                                              experts.activation.limit, act_, stream));
  Mxfp4GemmParams down = gate_up;
  down.a = act_;
  down.blocks = experts.down_blocks;
  down.scales = experts.down_scales;
  down.bias = experts.down_bias;
  down.n = hidden_;
  down.k = inter;
  RETURN_IF_ERROR(LaunchMxfp4GroupedGemm(down, y_, stream));
  return LaunchWeightedExpertSum(recv, num_rows, hidden_, top_k_, entries_.position, y_,
                                 combine_send, stream, experts.scales_input);
}

}  // namespace moe_ep::kernels
