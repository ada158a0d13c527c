#include "kernels/device_experts.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "core/expert_source.h"
#include "core/quantized_weights.h"
#include "core/status_macros.h"
#include "kernels/fp8_expert_kernels.cuh"
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
  set->router_weight_use_ = experts.router_weight_use();
  if (set->kind_ == core::ExpertKind::kIdentity || set->num_experts_ == 0) return set;
  if (set->kind_ == core::ExpertKind::kFp8SwiGlu) {
    RETURN_IF_ERROR(set->AllocateFp8());
    RETURN_IF_ERROR(set->UploadFp8(experts));
    return set;
  }
  if (set->kind_ == core::ExpertKind::kGptOssMxfp4) {
    set->gpt_oss_activation_ = experts.gpt_oss_activation();
    RETURN_IF_ERROR(set->AllocateMxfp4());
    for (int l = 0; l < set->num_experts_; ++l) {
      RETURN_IF_ERROR(set->UploadMxfp4(l, experts.gpt_oss_weights(l)));
    }
    return set;
  }

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
  ASSIGN_OR_RETURN(std::unique_ptr<DeviceExpertSet> set, LoadWeights(source, staging_bytes));
  set->router_weight_use_ = source.router_weight_use;
  return set;
}

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::LoadWeights(
    const core::ExpertSource& source, int64_t staging_bytes) {
  RETURN_IF_ERROR(core::ValidateExpertSource(source));
  if (staging_bytes < 4) {
    return absl::InvalidArgumentError(
        absl::StrCat("DeviceExpertSet::Load: staging_bytes: expected >= 4, got ", staging_bytes));
  }
  if (source.kind == core::ExpertSourceKind::kIdentity) {
    return WithSlots(core::ExpertKind::kIdentity, source.Ids(), source.hidden, 0);
  }
  const core::ExpertKind kind = source.expert_kind();
  if (kind == core::ExpertKind::kGptOssMxfp4) return LoadMxfp4(source);
  if (kind == core::ExpertKind::kFp8SwiGlu) {
    if (source.kind != core::ExpertSourceKind::kSeeded)
      return LoadFp8Checkpoint(source, staging_bytes);
    ASSIGN_OR_RETURN(
        std::unique_ptr<DeviceExpertSet> set,
        WithSlots(core::ExpertKind::kFp8SwiGlu, source.Ids(), source.hidden, source.intermediate));
    if (set->num_experts_ == 0) return set;
    RETURN_IF_ERROR(set->AllocateFp8());
    RETURN_IF_ERROR(set->GenerateSeededFp8(source.seed, source.layer));
    return set;
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

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::LoadFp8Checkpoint(
    const core::ExpertSource& source, int64_t staging_bytes) {
  auto with_source = [&](const absl::Status& s) {
    return absl::Status(s.code(),
                        absl::StrCat("expert source (", source.Describe(), "): ", s.message()));
  };
  absl::StatusOr<core::SafetensorsCheckpoint> ckpt =
      core::SafetensorsCheckpoint::Open(source.checkpoint_path);
  if (!ckpt.ok()) return with_source(ckpt.status());
  // Every tensor is found and checked (dtype, shape, scale grid) from the
  // headers before device memory is taken; then the bytes stream through.
  const std::vector<int> ids = source.Ids();
  const core::SeededProjection projs[3] = {
      core::SeededProjection::kGate, core::SeededProjection::kUp, core::SeededProjection::kDown};
  std::vector<core::quant::Fp8BlockTensorViews> views;
  views.reserve(3 * ids.size());
  for (const int e : ids) {
    for (int p = 0; p < 3; ++p) {
      const bool down = p == 2;
      const std::string name = source.TensorName(e, projs[p]);
      absl::StatusOr<core::quant::Fp8BlockTensorViews> found = core::quant::FindFp8BlockMatrix(
          *ckpt, name, name + "_scale_inv", down ? source.hidden : source.intermediate,
          down ? source.intermediate : source.hidden);
      if (!found.ok()) return with_source(found.status());
      views.push_back(*std::move(found));
    }
  }
  ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceExpertSet> set,
      WithSlots(core::ExpertKind::kFp8SwiGlu, ids, source.hidden, source.intermediate));
  if (set->num_experts_ == 0) return set;
  RETURN_IF_ERROR(set->AllocateFp8());
  const int64_t ih = source.hidden * source.intermediate;
  const int64_t gs = set->Fp8GateScales();
  const int64_t ds = set->Fp8DownScales();
  // Slots of staging_bytes / 2 bytes each (at most one weight's codes).
  ASSIGN_OR_RETURN(std::unique_ptr<PinnedUpload> upload,
                   PinnedUpload::Create(std::max<int64_t>(1, std::min(staging_bytes / 4, ih / 2))));
  for (int l = 0; l < set->num_experts_; ++l) {
    uint8_t* const codes[3] = {set->fp8_gate_up_ + (2 * l) * ih,
                               set->fp8_gate_up_ + (2 * l + 1) * ih, set->fp8_down_ + l * ih};
    float* const scales[3] = {set->fp8_gate_up_scale_ + (2 * l) * gs,
                              set->fp8_gate_up_scale_ + (2 * l + 1) * gs,
                              set->fp8_down_scale_ + l * ds};
    for (int p = 0; p < 3; ++p) {
      const core::quant::Fp8BlockTensorViews& v = views[3 * l + p];
      RETURN_IF_ERROR(upload->CopyBytes(v.weight.data, codes[p]));
      RETURN_IF_ERROR(upload->CopyBytes(v.scale_inv.data, scales[p]));
      core::ReleaseTensorPages(v.weight);
      core::ReleaseTensorPages(v.scale_inv);
    }
  }
  RETURN_IF_ERROR(upload->Finish());
  return set;
}

int64_t DeviceExpertSet::Fp8GateScales() const {
  return core::quant::Fp8ScaleBlocks(intermediate_) * core::quant::Fp8ScaleBlocks(hidden_);
}

int64_t DeviceExpertSet::Fp8DownScales() const {
  return core::quant::Fp8ScaleBlocks(hidden_) * core::quant::Fp8ScaleBlocks(intermediate_);
}

absl::Status DeviceExpertSet::AllocateFp8() {
  const int64_t l = num_experts_;
  const int64_t ih = hidden_ * intermediate_;
  RETURN_IF_ERROR(
      internal::CudaStatus(cudaMalloc(&fp8_gate_up_, l * 2 * ih), "cudaMalloc(fp8 gate_up)"));
  RETURN_IF_ERROR(
      internal::CudaStatus(cudaMalloc(&fp8_gate_up_scale_, l * 2 * Fp8GateScales() * sizeof(float)),
                           "cudaMalloc(fp8 gate_up scales)"));
  RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(&fp8_down_, l * ih), "cudaMalloc(fp8 down)"));
  return internal::CudaStatus(cudaMalloc(&fp8_down_scale_, l * Fp8DownScales() * sizeof(float)),
                              "cudaMalloc(fp8 down scales)");
}

absl::Status DeviceExpertSet::UploadFp8(const core::ExpertSet& experts) {
  const int64_t ih = hidden_ * intermediate_;
  const int64_t gs = Fp8GateScales();
  const int64_t ds = Fp8DownScales();
  for (int l = 0; l < num_experts_; ++l) {
    const core::quant::Fp8SwiGluWeights& w = experts.fp8_weights(l);
    const core::quant::Fp8BlockMatrix* parts[2] = {&w.gate, &w.up};
    for (int p = 0; p < 2; ++p) {
      if (static_cast<int64_t>(parts[p]->codes.size()) != ih ||
          static_cast<int64_t>(parts[p]->scale_inv.size()) != gs) {
        return absl::InternalError(
            "DeviceExpertSet::Upload: host fp8 weights have unexpected sizes");
      }
      RETURN_IF_ERROR(
          internal::CudaStatus(cudaMemcpy(fp8_gate_up_ + (l * 2 + p) * ih, parts[p]->codes.data(),
                                          ih, cudaMemcpyHostToDevice),
                               "cudaMemcpy(fp8 gate_up)"));
      RETURN_IF_ERROR(internal::CudaStatus(
          cudaMemcpy(fp8_gate_up_scale_ + (l * 2 + p) * gs, parts[p]->scale_inv.data(),
                     gs * sizeof(float), cudaMemcpyHostToDevice),
          "cudaMemcpy(fp8 gate_up scales)"));
    }
    if (static_cast<int64_t>(w.down.codes.size()) != ih ||
        static_cast<int64_t>(w.down.scale_inv.size()) != ds) {
      return absl::InternalError("DeviceExpertSet::Upload: host fp8 weights have unexpected sizes");
    }
    RETURN_IF_ERROR(internal::CudaStatus(
        cudaMemcpy(fp8_down_ + l * ih, w.down.codes.data(), ih, cudaMemcpyHostToDevice),
        "cudaMemcpy(fp8 down)"));
    RETURN_IF_ERROR(
        internal::CudaStatus(cudaMemcpy(fp8_down_scale_ + l * ds, w.down.scale_inv.data(),
                                        ds * sizeof(float), cudaMemcpyHostToDevice),
                             "cudaMemcpy(fp8 down scales)"));
  }
  return absl::OkStatus();
}

absl::Status DeviceExpertSet::GenerateSeededFp8(uint64_t seed, int layer) {
  const int64_t ih = hidden_ * intermediate_;
  // One expert's bf16 weights at a time: the scratch is 3 I H bf16, freed here.
  uint16_t* bf16 = nullptr;
  RETURN_IF_ERROR(internal::CudaStatus(cudaMalloc(&bf16, 3 * ih * sizeof(uint16_t)),
                                       "cudaMalloc(seeded bf16 scratch)"));
  absl::Status status = absl::OkStatus();
  for (int l = 0; l < num_experts_ && status.ok(); ++l) {
    SeededSwiGluParams params;
    params.seed = seed;
    params.layer = layer;
    params.first_expert = expert_ids_[l];
    params.num_experts = 1;
    params.hidden = hidden_;
    params.intermediate = intermediate_;
    params.gate_up = bf16;
    params.down = bf16 + 2 * ih;
    // The legacy default stream throughout: each launch is ordered after the
    // previous one, so the scratch is reused safely.
    status = LaunchSeededSwiGluWeights(params, /*stream=*/nullptr);
    if (status.ok()) {
      status =
          LaunchQuantizeFp8BlockMatrices(bf16, 2, intermediate_, hidden_, fp8_gate_up_ + l * 2 * ih,
                                         fp8_gate_up_scale_ + l * 2 * Fp8GateScales(),
                                         /*stream=*/nullptr);
    }
    if (status.ok()) {
      status =
          LaunchQuantizeFp8BlockMatrices(bf16 + 2 * ih, 1, hidden_, intermediate_,
                                         fp8_down_ + l * ih, fp8_down_scale_ + l * Fp8DownScales(),
                                         /*stream=*/nullptr);
    }
  }
  absl::Status synced = internal::CudaStatus(cudaStreamSynchronize(nullptr),
                                             "cudaStreamSynchronize(seeded fp8 expert weights)");
  cudaFree(bf16);
  RETURN_IF_ERROR(status);
  return synced;
}

Fp8SwiGluExperts DeviceExpertSet::fp8() const {
  Fp8SwiGluExperts view;
  view.slot_ids = device_slot_ids_;
  view.num_experts = num_experts_;
  view.hidden = hidden_;
  view.intermediate = intermediate_;
  view.gate_up = fp8_gate_up_;
  view.gate_up_scale = fp8_gate_up_scale_;
  view.down = fp8_down_;
  view.down_scale = fp8_down_scale_;
  view.scales_input = router_weight_use_ == core::RouterWeightUse::kScalesInput;
  return view;
}

DeviceExpertSet::~DeviceExpertSet() {
  cudaFree(gate_up_);
  cudaFree(down_);
  cudaFree(fp8_gate_up_);
  cudaFree(fp8_gate_up_scale_);
  cudaFree(fp8_down_);
  cudaFree(fp8_down_scale_);
  cudaFree(mxfp4_);
  cudaFree(device_slot_ids_);
}

int64_t DeviceExpertSet::weight_bytes() const {
  switch (kind_) {
    case core::ExpertKind::kIdentity:
      return 0;
    case core::ExpertKind::kFp8SwiGlu:
      return int64_t{num_experts_} *
             (3 * hidden_ * intermediate_ + (2 * Fp8GateScales() + Fp8DownScales()) * 4);
    case core::ExpertKind::kGptOssMxfp4:
      return int64_t{num_experts_} * Mxfp4SlotBytes();
    default:
      return int64_t{num_experts_} * 3 * hidden_ * intermediate_ * 2;
  }
}

}  // namespace moe_ep::kernels
