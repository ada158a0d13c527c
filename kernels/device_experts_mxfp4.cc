// DeviceExpertSet's gpt-oss mxfp4 experts (issue 35 item 3): one device
// slab holding every slot's tensors as the checkpoint stores them (the
// e2m1 codes of each 4-byte word in the kernels' order,
// Mxfp4BlocksToDeviceOrder), filled one expert at a time from the host
// (seeded or sliced from the fused checkpoint tensors).

#include <cuda_runtime.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/expert_source.h"
#include "core/quantized_formats.h"
#include "core/quantized_weights.h"
#include "core/safetensors.h"
#include "core/status_macros.h"
#include "kernels/device_experts.h"
#include "kernels/internal/cuda_status.h"
#include "kernels/mxfp4_grouped_gemm.cuh"

namespace moe_ep::kernels {

// Bytes of one slot's six arrays; the slab holds all slots of the first,
// then all of the second, and so on (each size is even, so the bf16 biases
// stay aligned).
struct DeviceExpertSet::Mxfp4Layout {
  int64_t gate_up_blocks = 0;  // 2I * H / 2
  int64_t down_blocks = 0;     // H * I / 2
  int64_t gate_up_scales = 0;  // 2I * H / 32
  int64_t down_scales = 0;     // H * I / 32
  int64_t gate_up_bias = 0;    // 2 * 2I
  int64_t down_bias = 0;       // 2 * H
  int64_t Slot() const {
    return gate_up_blocks + down_blocks + gate_up_scales + down_scales + gate_up_bias + down_bias;
  }
};

DeviceExpertSet::Mxfp4Layout DeviceExpertSet::Mxfp4Sizes() const {
  const int64_t h = hidden_;
  const int64_t i = intermediate_;
  Mxfp4Layout s;
  s.gate_up_blocks = 2 * i * h / 2;
  s.down_blocks = h * i / 2;
  s.gate_up_scales = 2 * i * (h / core::quant::kMxfp4Block);
  s.down_scales = h * (i / core::quant::kMxfp4Block);
  s.gate_up_bias = 2 * 2 * i;
  s.down_bias = 2 * h;
  return s;
}

int64_t DeviceExpertSet::Mxfp4SlotBytes() const { return Mxfp4Sizes().Slot(); }

absl::Status DeviceExpertSet::AllocateMxfp4() {
  const int64_t bytes = int64_t{num_experts_} * Mxfp4SlotBytes();
  return internal::CudaStatus(cudaMalloc(&mxfp4_, bytes),
                              absl::StrCat("cudaMalloc(mxfp4 experts, ", bytes, " bytes)"));
}

Mxfp4Experts DeviceExpertSet::mxfp4() const {
  Mxfp4Experts view;
  if (kind_ != core::ExpertKind::kGptOssMxfp4) return view;
  const Mxfp4Layout s = Mxfp4Sizes();
  const int64_t l = num_experts_;
  uint8_t* p = mxfp4_;
  view.slot_ids = device_slot_ids_;
  view.num_experts = num_experts_;
  view.hidden = hidden_;
  view.intermediate = intermediate_;
  view.gate_up_blocks = p;
  view.down_blocks = p += l * s.gate_up_blocks;
  view.gate_up_scales = p += l * s.down_blocks;
  view.down_scales = p += l * s.gate_up_scales;
  view.gate_up_bias = reinterpret_cast<const uint16_t*>(p += l * s.down_scales);
  view.down_bias = reinterpret_cast<const uint16_t*>(p + l * s.gate_up_bias);
  view.activation = gpt_oss_activation_;
  view.scales_input = router_weight_use_ == core::RouterWeightUse::kScalesInput;
  return view;
}

absl::Status DeviceExpertSet::UploadMxfp4(int slot, const core::quant::GptOssExpertWeights& w) {
  const Mxfp4Layout s = Mxfp4Sizes();
  const Mxfp4Experts view = mxfp4();
  const int64_t two_i = 2 * intermediate_;
  if (!core::quant::CheckMxfp4Matrix(w.gate_up, two_i, hidden_, "gate_up").ok() ||
      !core::quant::CheckMxfp4Matrix(w.down, hidden_, intermediate_, "down").ok() ||
      static_cast<int64_t>(w.gate_up_bias.size()) != two_i ||
      static_cast<int64_t>(w.down_bias.size()) != hidden_) {
    return absl::InternalError(absl::StrCat(
        "DeviceExpertSet: host mxfp4 weights of slot ", slot, " are not gate_up [", two_i, ", ",
        hidden_, "] and down [", hidden_, ", ", intermediate_, "] with their biases"));
  }
  struct Piece {
    const void* host;
    const void* device_base;
    int64_t bytes;
    const char* name;
  };
  // The kernels read the e2m1 codes in their device order (same bytes).
  std::vector<uint8_t> gate_up_blocks = w.gate_up.blocks;
  std::vector<uint8_t> down_blocks = w.down.blocks;
  Mxfp4BlocksToDeviceOrder(gate_up_blocks.data(), static_cast<int64_t>(gate_up_blocks.size()));
  Mxfp4BlocksToDeviceOrder(down_blocks.data(), static_cast<int64_t>(down_blocks.size()));
  const Piece pieces[6] = {
      {gate_up_blocks.data(), view.gate_up_blocks, s.gate_up_blocks, "gate_up blocks"},
      {down_blocks.data(), view.down_blocks, s.down_blocks, "down blocks"},
      {w.gate_up.scales.data(), view.gate_up_scales, s.gate_up_scales, "gate_up scales"},
      {w.down.scales.data(), view.down_scales, s.down_scales, "down scales"},
      {w.gate_up_bias.data(), view.gate_up_bias, s.gate_up_bias, "gate_up bias"},
      {w.down_bias.data(), view.down_bias, s.down_bias, "down bias"},
  };
  for (const Piece& piece : pieces) {
    // The slab is this set's own allocation; the view only hands it out const.
    auto* dst = const_cast<uint8_t*>(static_cast<const uint8_t*>(piece.device_base)) +
                int64_t{slot} * piece.bytes;
    RETURN_IF_ERROR(
        internal::CudaStatus(cudaMemcpy(dst, piece.host, piece.bytes, cudaMemcpyHostToDevice),
                             absl::StrCat("cudaMemcpy(mxfp4 ", piece.name, ")")));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<DeviceExpertSet>> DeviceExpertSet::LoadMxfp4(
    const core::ExpertSource& source) {
  const std::vector<int> ids = source.Ids();
  const auto with_source = [&](const absl::Status& s) {
    return absl::Status(s.code(),
                        absl::StrCat("expert source (", source.Describe(), "): ", s.message()));
  };
  std::optional<core::SafetensorsCheckpoint> ckpt;
  const std::string prefix = source.name_pattern.empty()
                                 ? std::string(core::quant::kGptOssExpertPrefix)
                                 : source.name_pattern;
  const auto read = [&](int e) -> absl::StatusOr<core::quant::GptOssExpertWeights> {
    if (!ckpt.has_value()) {
      return core::quant::GenerateGptOssExpert(source.seed, source.layer, e, source.hidden,
                                               source.intermediate);
    }
    ASSIGN_OR_RETURN(
        std::vector<core::quant::GptOssExpertWeights> one,
        core::quant::ReadGptOssExperts(*ckpt, prefix, source.layer, source.num_routed_experts, {e},
                                       source.hidden, source.intermediate));
    return std::move(one.front());
  };
  if (source.kind == core::ExpertSourceKind::kSafetensors) {
    absl::StatusOr<core::SafetensorsCheckpoint> opened =
        core::SafetensorsCheckpoint::Open(source.checkpoint_path);
    if (!opened.ok()) return with_source(opened.status());
    ckpt.emplace(*std::move(opened));
  }
  // The first expert is read before any device memory is taken (for a
  // checkpoint that checks the fused tensors' dtypes and shapes); then one
  // expert at a time.
  absl::StatusOr<core::quant::GptOssExpertWeights> w;
  if (!ids.empty()) {
    w = read(ids.front());
    if (!w.ok()) return with_source(w.status());
  }
  ASSIGN_OR_RETURN(
      std::unique_ptr<DeviceExpertSet> set,
      WithSlots(core::ExpertKind::kGptOssMxfp4, ids, source.hidden, source.intermediate));
  set->gpt_oss_activation_ = source.gpt_oss_activation;
  if (set->num_experts_ == 0) return set;
  RETURN_IF_ERROR(set->AllocateMxfp4());
  for (int l = 0; l < set->num_experts_; ++l) {
    if (l > 0) {
      w = read(ids[l]);
      if (!w.ok()) return with_source(w.status());
    }
    RETURN_IF_ERROR(set->UploadMxfp4(l, *w));
  }
  return set;
}

}  // namespace moe_ep::kernels
