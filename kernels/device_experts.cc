#include "kernels/device_experts.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/pinned_upload.h"
#include "kernels/seeded_weights.cuh"

namespace moe_ep::kernels {

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::Upload(
    const core::ExpertSet& experts) {
  std::unique_ptr<DeviceExpertSet> set(new DeviceExpertSet());
  set->kind_ = experts.kind();
  set->first_expert_ = experts.first_expert();
  set->num_experts_ = experts.num_experts();
  set->hidden_ = experts.hidden();
  set->intermediate_ = experts.intermediate();
  if (set->kind_ == core::ExpertKind::kIdentity || set->num_experts_ == 0) return set;

  const int64_t h = set->hidden_;
  const int64_t i = set->intermediate_;
  const int64_t per_expert_gate_up = 2 * i * h;
  const int64_t per_expert_down = h * i;
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMalloc(&set->gate_up_, set->num_experts_ * per_expert_gate_up * sizeof(uint16_t)),
      "cudaMalloc(gate_up)"));
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMalloc(&set->down_, set->num_experts_ * per_expert_down * sizeof(uint16_t)),
      "cudaMalloc(down)"));
  for (int l = 0; l < set->num_experts_; ++l) {
    const core::SwiGluWeights& w = experts.swiglu_weights(l);
    if (static_cast<int64_t>(w.gate.size()) != i * h ||
        static_cast<int64_t>(w.up.size()) != i * h ||
        static_cast<int64_t>(w.down.size()) != h * i) {
      return absl::InternalError("DeviceExpertSet::Upload: host weights have unexpected sizes");
    }
    uint16_t* gu = set->gate_up_ + l * per_expert_gate_up;
    RETURN_IF_ERROR(internal::CudaStatus(
        cudaMemcpy(gu, w.gate.data(), i * h * sizeof(uint16_t), cudaMemcpyHostToDevice),
        "cudaMemcpy(gate)"));
    RETURN_IF_ERROR(internal::CudaStatus(
        cudaMemcpy(gu + i * h, w.up.data(), i * h * sizeof(uint16_t), cudaMemcpyHostToDevice),
        "cudaMemcpy(up)"));
    RETURN_IF_ERROR(
        internal::CudaStatus(cudaMemcpy(set->down_ + l * per_expert_down, w.down.data(),
                                        h * i * sizeof(uint16_t), cudaMemcpyHostToDevice),
                             "cudaMemcpy(down)"));
  }
  return set;
}

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::GenerateSwiGlu(
    uint64_t seed, int layer, int first_expert, int num_experts, int64_t hidden,
    int64_t intermediate) {
  // Same argument checks and messages as core::ExpertSet::GenerateSwiGlu.
  RETURN_IF_ERROR(core::CheckSwiGluDims(first_expert, num_experts, hidden, intermediate));
  std::unique_ptr<DeviceExpertSet> set(new DeviceExpertSet());
  set->kind_ = core::ExpertKind::kSwiGlu;
  set->first_expert_ = first_expert;
  set->num_experts_ = num_experts;
  set->hidden_ = hidden;
  set->intermediate_ = intermediate;
  if (num_experts == 0) return set;
  RETURN_IF_ERROR(set->AllocateSwiGlu());
  SeededSwiGluParams params;
  params.seed = seed;
  params.layer = layer;
  params.first_expert = first_expert;
  params.num_experts = num_experts;
  params.hidden = hidden;
  params.intermediate = intermediate;
  params.gate_up = set->gate_up_;
  params.down = set->down_;
  // The legacy default stream, as Upload's cudaMemcpy: ordered after work
  // already enqueued on blocking streams; waited for here.
  RETURN_IF_ERROR(LaunchSeededSwiGluWeights(params, /*stream=*/nullptr));
  RETURN_IF_ERROR(internal::CudaStatus(cudaStreamSynchronize(nullptr),
                                       "cudaStreamSynchronize(seeded expert weights)"));
  return set;
}

absl::Status DeviceExpertSet::AllocateSwiGlu() {
  const int64_t elements = int64_t{num_experts_} * hidden_ * intermediate_;
  RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(&gate_up_, 2 * elements * sizeof(uint16_t)),
                                       "cudaMalloc(gate_up)"));
  return internal::CudaStatus(cudaMalloc(&down_, elements * sizeof(uint16_t)), "cudaMalloc(down)");
}

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::Load(
    const core::ExpertSource& source, int64_t staging_bytes) {
  RETURN_IF_ERROR(core::ValidateExpertSource(source));
  if (staging_bytes < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceExpertSet::Load: staging_bytes: expected >= 4, got ", staging_bytes));
  }
  switch (source.kind) {
    case core::ExpertSourceKind::kSeeded:
      return GenerateSwiGlu(source.seed, source.layer, source.first_expert, source.num_experts,
                            source.hidden, source.intermediate);
    case core::ExpertSourceKind::kIdentity: {
      std::unique_ptr<DeviceExpertSet> set(new DeviceExpertSet());
      set->kind_ = core::ExpertKind::kIdentity;
      set->first_expert_ = source.first_expert;
      set->num_experts_ = source.num_experts;
      set->hidden_ = source.hidden;
      return set;
    }
    case core::ExpertSourceKind::kSafetensors:
      break;
  }
  // Every tensor is found and its shape checked before device memory is taken.
  ASSIGN_OR_RETURN(core::SafetensorsCheckpoint ckpt, core::OpenExpertCheckpoint(source));
  std::unique_ptr<DeviceExpertSet> set(new DeviceExpertSet());
  set->kind_ = core::ExpertKind::kSwiGlu;
  set->first_expert_ = source.first_expert;
  set->num_experts_ = source.num_experts;
  set->hidden_ = source.hidden;
  set->intermediate_ = source.intermediate;
  if (source.num_experts == 0) return set;
  RETURN_IF_ERROR(set->AllocateSwiGlu());
  const int64_t ih = source.intermediate * source.hidden;
  ASSIGN_OR_RETURN(std::unique_ptr<PinnedUpload> upload,
                   PinnedUpload::Create(std::min(staging_bytes / 4, ih)));
  for (int l = 0; l < source.num_experts; ++l) {
    const int e = source.first_expert + l;
    uint16_t* const dst[3] = {set->gate_up_ + l * 2 * ih, set->gate_up_ + l * 2 * ih + ih,
                              set->down_ + l * ih};
    const core::SeededProjection projs[3] = {
        core::SeededProjection::kGate, core::SeededProjection::kUp, core::SeededProjection::kDown};
    for (int p = 0; p < 3; ++p) {
      // OpenExpertCheckpoint found it with this shape; Find again is a map lookup.
      ASSIGN_OR_RETURN(core::SafetensorsTensorView view, ckpt.Find(source.TensorName(e, projs[p])));
      RETURN_IF_ERROR(upload->Copy(view, ih, dst[p]));
      core::ReleaseTensorPages(view);
    }
  }
  RETURN_IF_ERROR(upload->Finish());
  return set;
}

DeviceExpertSet::~DeviceExpertSet() {
  cudaFree(gate_up_);
  cudaFree(down_);
}

int64_t DeviceExpertSet::weight_bytes() const {
  if (kind_ == core::ExpertKind::kIdentity) return 0;
  return int64_t{num_experts_} * 3 * hidden_ * intermediate_ * 2;
}

}  // namespace moe_ep::kernels
