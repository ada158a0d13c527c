#include "kernels/device_experts.h"

#include <cuda_runtime.h>

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "core/expert_source.h"
#include "core/status_macros.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/pinned_upload.h"
#include "kernels/seeded_weights.cuh"

namespace moe_ep::kernels {

namespace {

// "slot_ids: expected ..." when `ids` are not ascending distinct ids >= 0.
absl::Status CheckSlotIds(const char* call, const std::vector<int>& ids) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || (i > 0 && ids[i] <= ids[i - 1])) {
      return absl::InvalidArgumentError(
          absl::StrCat(call, ": slot ids: expected ascending distinct ids >= 0, got ", ids[i],
                       " at slot ", i, " of ", core::DescribeExpertIds(ids)));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::WithSlots(core::ExpertKind kind,
                                                                            std::vector<int> ids,
                                                                            int64_t hidden,
                                                                            int64_t intermediate) {
  RETURN_IF_ERROR(CheckSlotIds("DeviceExpertSet", ids));
  std::unique_ptr<DeviceExpertSet> set(new DeviceExpertSet());
  set->kind_ = kind;
  set->num_experts_ = static_cast<int>(ids.size());
  set->hidden_ = hidden;
  set->intermediate_ = kind == core::ExpertKind::kIdentity ? 0 : intermediate;
  set->expert_ids_ = ids;
  set->slot_ids_ = std::move(ids);
  if (set->num_experts_ == 0) return set;
  const std::vector<int32_t> device(set->slot_ids_.begin(), set->slot_ids_.end());
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMalloc(&set->device_slot_ids_, device.size() * sizeof(int32_t)), "cudaMalloc(slot ids)"));
  RETURN_IF_ERROR(
      internal::CudaStatus(cudaMemcpy(set->device_slot_ids_, device.data(),
                                      device.size() * sizeof(int32_t), cudaMemcpyHostToDevice),
                           "cudaMemcpy(slot ids)"));
  return set;
}

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::Upload(
    const core::ExpertSet& experts) {
  ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceExpertSet> set,
      WithSlots(experts.kind(), experts.expert_ids(), experts.hidden(), experts.intermediate()));
  if (set->kind_ == core::ExpertKind::kIdentity || set->num_experts_ == 0) return set;

  const int64_t h = set->hidden_;
  const int64_t i = set->intermediate_;
  const int64_t per_expert_gate_up = 2 * i * h;
  const int64_t per_expert_down = h * i;
  RETURN_IF_ERROR(set->AllocateSwiGlu());
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
  std::vector<int> ids(num_experts);
  for (int l = 0; l < num_experts; ++l) ids[l] = first_expert + l;
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceExpertSet> set,
                   WithSlots(core::ExpertKind::kSwiGlu, std::move(ids), hidden, intermediate));
  if (num_experts == 0) return set;
  RETURN_IF_ERROR(set->AllocateSwiGlu());
  RETURN_IF_ERROR(set->GenerateSeeded(seed, layer));
  return set;
}

absl::Status DeviceExpertSet::GenerateSeeded(uint64_t seed, int layer) {
  const int64_t ih = hidden_ * intermediate_;
  // One launch per run of consecutive ids (slots [begin, end) hold ids
  // expert_ids_[begin] + 0 .. end - begin - 1).
  for (int begin = 0; begin < num_experts_;) {
    int end = begin + 1;
    while (end < num_experts_ && expert_ids_[end] == expert_ids_[end - 1] + 1) ++end;
    SeededSwiGluParams params;
    params.seed = seed;
    params.layer = layer;
    params.first_expert = expert_ids_[begin];
    params.num_experts = end - begin;
    params.hidden = hidden_;
    params.intermediate = intermediate_;
    params.gate_up = gate_up_ + begin * 2 * ih;
    params.down = down_ + begin * ih;
    // The legacy default stream, as Upload's cudaMemcpy: ordered after work
    // already enqueued on blocking streams; waited for below.
    RETURN_IF_ERROR(LaunchSeededSwiGluWeights(params, /*stream=*/nullptr));
    begin = end;
  }
  return internal::CudaStatus(cudaStreamSynchronize(nullptr),
                              "cudaStreamSynchronize(seeded expert weights)");
}

absl::Status DeviceExpertSet::Renumber(const std::vector<int>& slot_ids, cudaStream_t stream) {
  if (static_cast<int>(slot_ids.size()) != num_experts_) {
    return absl::InvalidArgumentError(absl::StrCat("DeviceExpertSet::Renumber: slot ids: expected ",
                                                   num_experts_, " (one a slot), got ",
                                                   slot_ids.size()));
  }
  RETURN_IF_ERROR(CheckSlotIds("DeviceExpertSet::Renumber", slot_ids));
  if (slot_ids == slot_ids_) return absl::OkStatus();
  const std::vector<int32_t> device(slot_ids.begin(), slot_ids.end());
  RETURN_IF_ERROR(internal::CudaStatus(
      cudaMemcpyAsync(device_slot_ids_, device.data(), device.size() * sizeof(int32_t),
                      cudaMemcpyHostToDevice, stream),
      "cudaMemcpyAsync(slot ids)"));
  // `device` is a local: the copy has read it once the stream is done.
  RETURN_IF_ERROR(
      internal::CudaStatus(cudaStreamSynchronize(stream), "cudaStreamSynchronize(slot ids)"));
  slot_ids_ = slot_ids;
  return absl::OkStatus();
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
  if (source.kind == core::ExpertSourceKind::kIdentity) {
    return WithSlots(core::ExpertKind::kIdentity, source.Ids(), source.hidden, 0);
  }
  if (source.kind == core::ExpertSourceKind::kSeeded) {
    ASSIGN_OR_RETURN(
        std::unique_ptr<DeviceExpertSet> set,
        WithSlots(core::ExpertKind::kSwiGlu, source.Ids(), source.hidden, source.intermediate));
    if (set->num_experts_ == 0) return set;
    RETURN_IF_ERROR(set->AllocateSwiGlu());
    RETURN_IF_ERROR(set->GenerateSeeded(source.seed, source.layer));
    return set;
  }
  // Every tensor is found and its shape checked before device memory is taken.
  ASSIGN_OR_RETURN(core::SafetensorsCheckpoint ckpt, core::OpenExpertCheckpoint(source));
  ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceExpertSet> set,
      WithSlots(core::ExpertKind::kSwiGlu, source.Ids(), source.hidden, source.intermediate));
  if (set->num_experts_ == 0) return set;
  RETURN_IF_ERROR(set->AllocateSwiGlu());
  const int64_t ih = source.intermediate * source.hidden;
  ASSIGN_OR_RETURN(std::unique_ptr<PinnedUpload> upload,
                   PinnedUpload::Create(std::min(staging_bytes / 4, ih)));
  for (int l = 0; l < set->num_experts_; ++l) {
    const int e = set->expert_ids_[l];
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
  cudaFree(device_slot_ids_);
}

int64_t DeviceExpertSet::weight_bytes() const {
  if (kind_ == core::ExpertKind::kIdentity) return 0;
  return int64_t{num_experts_} * 3 * hidden_ * intermediate_ * 2;
}

}  // namespace moe_ep::kernels
