#pragma once

// Where one rank's routed experts of one MoE layer come from (DESIGN §7;
// issue 10 item 6): seeded (a pure function of (seed, layer, expert)), a
// safetensors checkpoint, or identity. LoadExperts hands this description to
// the data plane, and each plane makes the weights in its own memory: the
// CPU plane materialises a core::ExpertSet (MakeHostExperts); the GPU plane
// generates seeded weights on the device and streams checkpoint tensors
// through a bounded pinned buffer (kernels/device_experts.h), so no host
// copy of the layer ever exists there.
//
// The source names this rank's expert range [first_expert, first_expert +
// num_experts) of the layer's num_routed_experts (E); the planes check that
// range against their own contiguous placement (core/expert_placement.h).
// Value type; thread-compatible. Source: DESIGN §7; issue 10 item 6.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "core/experts.h"
#include "core/placement_table.h"
#include "core/safetensors.h"
#include "core/seeded_stream.h"

namespace moe_ep::core {

// ExpertTensorName()
//
// `pattern` with {layer} and {expert} replaced by the numbers, {proj} by
// gate_proj / up_proj / down_proj and {w} by Mixtral's w1 / w3 / w2.
// Example: ("model.layers.{layer}.mlp.experts.{expert}.{proj}.weight", 3, 7,
// kUp) -> "model.layers.3.mlp.experts.7.up_proj.weight". Pure.
std::string ExpertTensorName(const std::string& pattern, int layer, int expert,
                             SeededProjection proj);

enum class ExpertSourceKind { kSeeded, kSafetensors, kIdentity };

// "seeded", "safetensors", "identity".
const char* ExpertSourceKindName(ExpertSourceKind kind);

struct ExpertSource {
  ExpertSourceKind kind = ExpertSourceKind::kIdentity;
  int layer = 0;                // layer index, substituted for {layer}
  int num_routed_experts = 0;   // E of the layer (all ranks)
  int first_expert = 0;         // global id of this rank's first expert
  int num_experts = 0;          // L: this rank's experts
  int64_t hidden = 0;           // H
  int64_t intermediate = 0;     // I (SwiGLU kinds; ignored for identity)
  uint64_t seed = 0;            // kSeeded
  std::string checkpoint_path;  // kSafetensors: canonical path (server/path_policy.h)
  std::string name_pattern;     // kSafetensors: {layer}, {expert}, {proj} or {w}
  // The weights' format (issue 35): bf16 (kSwiGlu experts), fp8 128 x 128
  // block-scaled (kFp8SwiGlu: seeded = the seeded bf16 weights quantized;
  // safetensors = F8_E4M3 `TensorName(e, proj)` with its F32
  // `TensorName(e, proj) + "_scale_inv"`), or mxfp4 (kGptOssMxfp4: seeded,
  // or gpt-oss's fused tensors under name_pattern = a prefix with {layer},
  // default quant::kGptOssExpertPrefix). Ignored for identity.
  quant::ExpertWeightFormat weight_format = quant::ExpertWeightFormat::kBf16;
  // gpt-oss's activation (kMxfp4 only): swiglu_limit and alpha.
  quant::GptOssActivation gpt_oss_activation;
  // Llama-4: the router weight scales the expert's input (ExpertSet
  // router_weight_use()).
  RouterWeightUse router_weight_use = RouterWeightUse::kScalesOutput;
  // Empty: this rank's experts are the range above. Otherwise the distinct
  // logical experts of this rank's slots under a placement table (DESIGN
  // §15), ascending; then first_expert is expert_ids.front() and num_experts
  // expert_ids.size(). Replicas of one expert on a rank are one entry.
  std::vector<int> expert_ids;

  // The experts this source makes, ascending: expert_ids, or the range.
  std::vector<int> Ids() const;
  // This source with `ids` (ascending, distinct, non-empty) as its experts:
  // sets expert_ids, first_expert and num_experts.
  ExpertSource WithExperts(std::vector<int> ids) const;

  // The three kinds, with every field they use.
  static ExpertSource Seeded(uint64_t seed, int layer, int num_routed_experts, int first_expert,
                             int num_experts, int64_t hidden, int64_t intermediate);
  static ExpertSource Safetensors(std::string checkpoint_path, std::string name_pattern, int layer,
                                  int num_routed_experts, int first_expert, int num_experts,
                                  int64_t hidden, int64_t intermediate);
  static ExpertSource Identity(int layer, int num_routed_experts, int first_expert, int num_experts,
                               int64_t hidden);

  // kIdentity for identity; else by weight_format: kSwiGlu (bf16),
  // kFp8SwiGlu (fp8), kGptOssMxfp4 (mxfp4).
  ExpertKind expert_kind() const;
  // Bytes of the weights the source makes, in their format: L *
  // quant::ExpertWeightBytes (0 for identity). Example: L 4, H 7168, I 2048
  // -> bf16 352,321,536; fp8 176,203,776.
  int64_t weight_bytes() const;
  // The checkpoint name of `expert`'s projection `proj` ({layer}, {expert},
  // {proj} -> gate_proj/up_proj/down_proj, {w} -> w1/w3/w2 expanded).
  std::string TensorName(int expert, SeededProjection proj) const;
  // "layer 3 experts [8, 16) (safetensors)", for messages.
  std::string Describe() const;
};

// ValidateExpertSource()
//
// Checks the fields without touching the file system: layer >= 0;
// num_routed_experts >= 1; 0 <= first_expert and first_expert + num_experts
// <= num_routed_experts; hidden >= 1; intermediate >= 1 for SwiGLU kinds;
// for kSafetensors an absolute checkpoint_path and a name_pattern holding
// {expert} and one of {proj} or {w} (bf16, fp8) or no {expert} (mxfp4: a
// prefix, may be empty); mxfp4 H and I multiples of 32; gpt-oss limit > 0.
// Errors: kInvalidArgument naming the field, expected and got, prefixed with
// "expert source (<Describe()>)".
// Pure and thread-safe.
absl::Status ValidateExpertSource(const ExpertSource& source);

// CheckExpertSlots()
//
// OK when the source makes exactly the distinct logical experts of `rank`'s
// slots under `table` (PlacementTable::SlotExperts, deduplicated, ascending):
// what LoadExperts loads once a table is installed (DESIGN §15). Errors:
// kInvalidArgument naming both lists, or a rank outside the table.
// Pure and thread-safe.
absl::Status CheckExpertSlots(const ExpertSource& source, const PlacementTable& table, int rank);

// DistinctSlotExperts()
//
// The distinct logical experts of `rank`'s slots under `table`, ascending.
// REQUIRES: 0 <= rank < table.ep_size(). Example: slots {5, 2, 5} -> {2, 5}.
std::vector<int> DistinctSlotExperts(const PlacementTable& table, int rank);

// DescribeExpertIds()
//
// "[a, b)" when `ids` (ascending) is the range a..b-1, else "{a,c,...}";
// "[]" when empty. For messages. Pure.
std::string DescribeExpertIds(const std::vector<int>& ids);

// CheckExpertRange()
//
// OK when the source's range is what `rank` owns in the contiguous placement
// of num_routed_experts on `ep_size` ranks. Errors: kInvalidArgument naming
// both ranges ("expected [a, b) for rank r of n"), or the placement's own
// error. Pure and thread-safe.
absl::Status CheckExpertRange(const ExpertSource& source, int rank, int ep_size);

// OpenExpertCheckpoint()
//
// Opens the source's checkpoint and checks, from the headers alone (no
// tensor data is read), that every tensor of this rank's experts exists
// with shape [I, H] (gate, up) or [H, I] (down) and a bf16/f16/f32 dtype.
// REQUIRES: kind == kSafetensors, weight_format kBf16 and
// ValidateExpertSource(source) is OK. (Quantized checkpoints are checked by
// their readers, core/quantized_weights.h, tensor by tensor.)
// Errors (each prefixed with "expert source (<Describe()>)"): kNotFound (path,
// shard or tensor missing, named), kInvalidArgument (a shape differs, with
// expected and got), kDataLoss (corrupt file), kPermissionDenied.
// Not thread-safe with other users of the returned checkpoint.
absl::StatusOr<SafetensorsCheckpoint> OpenExpertCheckpoint(const ExpertSource& source);

// MakeHostExperts()
//
// The experts the source describes, in host memory (the CPU data plane):
// ExpertSet::GenerateSwiGlu, ExpertSet::LoadSafetensors or
// ExpertSet::Identity with the source's fields; for fp8 / mxfp4,
// ExpertSet::GenerateFp8SwiGlu / GenerateGptOss or the checkpoint read with
// quant::ReadFp8BlockMatrix / quant::ReadGptOssExperts, bytes as stored. The
// set's router_weight_use is the source's. Validates first.
// Errors: those of ValidateExpertSource and OpenExpertCheckpoint, and of the
// quantized readers (a missing scale, a wrong dtype or shape, a scale grid
// that does not tile its weight: each naming the tensor).
absl::StatusOr<ExpertSet> MakeHostExperts(const ExpertSource& source);

}  // namespace moe_ep::core
