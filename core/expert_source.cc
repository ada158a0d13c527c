#include "core/expert_source.h"

#include <algorithm>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "core/expert_placement.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

constexpr SeededProjection kProjections[3] = {SeededProjection::kGate, SeededProjection::kUp,
                                              SeededProjection::kDown};

absl::Status Invalid(const ExpertSource& source, const std::string& what) {
  return absl::InvalidArgumentError(
      absl::StrCat("expert source (", source.Describe(), "): ", what));
}

absl::Status WithSource(const ExpertSource& source, const absl::Status& status) {
  if (status.ok()) return status;
  return absl::Status(status.code(),
                      absl::StrCat("expert source (", source.Describe(), "): ", status.message()));
}

}  // namespace

std::string ExpertTensorName(const std::string& pattern, int layer, int expert,
                             SeededProjection proj) {
  const char* hf = proj == SeededProjection::kGate ? "gate_proj"
                   : proj == SeededProjection::kUp ? "up_proj"
                                                   : "down_proj";
  const char* mixtral = proj == SeededProjection::kGate ? "w1"
                        : proj == SeededProjection::kUp ? "w3"
                                                        : "w2";
  return absl::StrReplaceAll(pattern, {{"{layer}", absl::StrCat(layer)},
                                       {"{expert}", absl::StrCat(expert)},
                                       {"{proj}", hf},
                                       {"{w}", mixtral}});
}

const char* ExpertSourceKindName(ExpertSourceKind kind) {
  switch (kind) {
    case ExpertSourceKind::kSeeded:
      return "seeded";
    case ExpertSourceKind::kSafetensors:
      return "safetensors";
    case ExpertSourceKind::kIdentity:
      return "identity";
  }
  return "?";
}

ExpertSource ExpertSource::Seeded(uint64_t seed, int layer, int num_routed_experts,
                                  int first_expert, int num_experts, int64_t hidden,
                                  int64_t intermediate) {
  ExpertSource s;
  s.kind = ExpertSourceKind::kSeeded;
  s.seed = seed;
  s.layer = layer;
  s.num_routed_experts = num_routed_experts;
  s.first_expert = first_expert;
  s.num_experts = num_experts;
  s.hidden = hidden;
  s.intermediate = intermediate;
  return s;
}

ExpertSource ExpertSource::Safetensors(std::string checkpoint_path, std::string name_pattern,
                                       int layer, int num_routed_experts, int first_expert,
                                       int num_experts, int64_t hidden, int64_t intermediate) {
  ExpertSource s;
  s.kind = ExpertSourceKind::kSafetensors;
  s.checkpoint_path = std::move(checkpoint_path);
  s.name_pattern = std::move(name_pattern);
  s.layer = layer;
  s.num_routed_experts = num_routed_experts;
  s.first_expert = first_expert;
  s.num_experts = num_experts;
  s.hidden = hidden;
  s.intermediate = intermediate;
  return s;
}

ExpertSource ExpertSource::Identity(int layer, int num_routed_experts, int first_expert,
                                    int num_experts, int64_t hidden) {
  ExpertSource s;
  s.kind = ExpertSourceKind::kIdentity;
  s.layer = layer;
  s.num_routed_experts = num_routed_experts;
  s.first_expert = first_expert;
  s.num_experts = num_experts;
  s.hidden = hidden;
  return s;
}

ExpertKind ExpertSource::expert_kind() const {
  if (kind == ExpertSourceKind::kIdentity) return ExpertKind::kIdentity;
  switch (weight_format) {
    case quant::ExpertWeightFormat::kBf16:
      return ExpertKind::kSwiGlu;
    case quant::ExpertWeightFormat::kFp8Block128:
      return ExpertKind::kFp8SwiGlu;
    case quant::ExpertWeightFormat::kMxfp4:
      return ExpertKind::kGptOssMxfp4;
  }
  return ExpertKind::kSwiGlu;
}

int64_t ExpertSource::weight_bytes() const {
  if (expert_kind() == ExpertKind::kIdentity) return 0;
  return int64_t{num_experts} * quant::ExpertWeightBytes(weight_format, hidden, intermediate);
}

std::vector<int> ExpertSource::Ids() const {
  if (!expert_ids.empty()) return expert_ids;
  std::vector<int> ids;
  ids.reserve(std::max(num_experts, 0));
  for (int i = 0; i < num_experts; ++i) ids.push_back(first_expert + i);
  return ids;
}

ExpertSource ExpertSource::WithExperts(std::vector<int> ids) const {
  ExpertSource s = *this;
  s.first_expert = ids.empty() ? 0 : ids.front();
  s.num_experts = static_cast<int>(ids.size());
  s.expert_ids = std::move(ids);
  return s;
}

std::string ExpertSource::TensorName(int expert, SeededProjection proj) const {
  return ExpertTensorName(name_pattern, layer, expert, proj);
}

std::string ExpertSource::Describe() const {
  if (!expert_ids.empty()) {
    return absl::StrCat("layer ", layer, " experts {", absl::StrJoin(expert_ids, ","), "} of ",
                        num_routed_experts, ", ", ExpertSourceKindName(kind));
  }
  return absl::StrCat("layer ", layer, " experts [", first_expert, ", ",
                      int64_t{first_expert} + num_experts, ") of ", num_routed_experts, ", ",
                      ExpertSourceKindName(kind));
}

absl::Status ValidateExpertSource(const ExpertSource& source) {
  if (source.kind != ExpertSourceKind::kSeeded && source.kind != ExpertSourceKind::kSafetensors &&
      source.kind != ExpertSourceKind::kIdentity) {
    return Invalid(source, absl::StrCat("kind: expected seeded, safetensors or identity, got ",
                                        static_cast<int>(source.kind)));
  }
  if (source.layer < 0) {
    return Invalid(source, absl::StrCat("layer: expected >= 0, got ", source.layer));
  }
  if (source.num_routed_experts < 1) {
    return Invalid(
        source, absl::StrCat("num_routed_experts: expected >= 1, got ", source.num_routed_experts));
  }
  if (source.first_expert < 0 || source.num_experts < 0 ||
      int64_t{source.first_expert} + source.num_experts > source.num_routed_experts) {
    return Invalid(source, absl::StrFormat("expert range: expected [first_expert, first_expert + "
                                           "num_experts) inside [0, %d), got [%d, %d)",
                                           source.num_routed_experts, source.first_expert,
                                           int64_t{source.first_expert} + source.num_experts));
  }
  if (!source.expert_ids.empty()) {
    const std::vector<int>& ids = source.expert_ids;
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= source.num_routed_experts || (i > 0 && ids[i] <= ids[i - 1])) {
        return Invalid(source, absl::StrFormat("expert_ids: expected ascending distinct ids in "
                                               "[0, %d), got %d at position %d",
                                               source.num_routed_experts, ids[i], i));
      }
    }
    if (source.first_expert != ids.front() || source.num_experts != static_cast<int>(ids.size())) {
      return Invalid(source, absl::StrFormat("expert_ids: first_expert %d and num_experts %d "
                                             "must be expert_ids' first (%d) and count (%d)",
                                             source.first_expert, source.num_experts, ids.front(),
                                             ids.size()));
    }
  }
  if (source.hidden < 1) {
    return Invalid(source, absl::StrCat("hidden: expected >= 1, got ", source.hidden));
  }
  if (source.expert_kind() != ExpertKind::kIdentity && source.intermediate < 1) {
    return Invalid(source, absl::StrCat("intermediate: expected >= 1 for SwiGLU experts, got ",
                                        source.intermediate));
  }
  const bool mxfp4 = source.expert_kind() == ExpertKind::kGptOssMxfp4;
  if (mxfp4 &&
      (source.hidden % quant::kMxfp4Block != 0 || source.intermediate % quant::kMxfp4Block != 0)) {
    return Invalid(source, absl::StrCat("hidden and intermediate: expected multiples of 32 (the "
                                        "mxfp4 block) for gpt-oss experts, got ",
                                        source.hidden, " and ", source.intermediate));
  }
  if (mxfp4 && !(source.gpt_oss_activation.limit > 0.0f)) {
    return Invalid(
        source, absl::StrCat("swiglu_limit: expected > 0, got ", source.gpt_oss_activation.limit));
  }
  if (source.kind != ExpertSourceKind::kSafetensors) return absl::OkStatus();
  if (source.checkpoint_path.empty() || source.checkpoint_path[0] != '/') {
    return Invalid(source, absl::StrCat("checkpoint_path: expected an absolute path (resolved "
                                        "under --checkpoint-dir), got \"",
                                        source.checkpoint_path, "\""));
  }
  const std::string_view pattern(source.name_pattern);
  if (mxfp4) {
    if (pattern.find("{expert}") != std::string_view::npos) {
      return Invalid(source, absl::StrCat("name_pattern: gpt-oss keeps all experts of a layer in "
                                          "one tensor; expected a prefix with {layer} such as \"",
                                          quant::kGptOssExpertPrefix, "\", got \"",
                                          source.name_pattern, "\""));
    }
    return absl::OkStatus();
  }
  if (pattern.find("{expert}") == std::string_view::npos ||
      (pattern.find("{proj}") == std::string_view::npos &&
       pattern.find("{w}") == std::string_view::npos)) {
    return Invalid(source, absl::StrCat("name_pattern: expected {expert} and one of {proj} or "
                                        "{w}, e.g. \"model.layers.{layer}.mlp.experts.{expert}."
                                        "{proj}.weight\", got \"",
                                        source.name_pattern, "\""));
  }
  return absl::OkStatus();
}

std::string DescribeExpertIds(const std::vector<int>& ids) {
  if (ids.empty()) return "[]";
  if (ids.back() - ids.front() + 1 == static_cast<int>(ids.size())) {
    return absl::StrCat("[", ids.front(), ", ", ids.back() + 1, ")");
  }
  return absl::StrCat("{", absl::StrJoin(ids, ","), "}");
}

std::vector<int> DistinctSlotExperts(const PlacementTable& table, int rank) {
  std::vector<int> ids = table.SlotExperts(rank);
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

absl::Status CheckExpertSlots(const ExpertSource& source, const PlacementTable& table, int rank) {
  if (rank < 0 || rank >= table.ep_size()) {
    return Invalid(source,
                   absl::StrCat("rank: expected in [0, ", table.ep_size(), "), got ", rank));
  }
  if (source.num_routed_experts != table.num_experts()) {
    return Invalid(source,
                   absl::StrCat("num_routed_experts: the placement table has ", table.num_experts(),
                                " experts, got ", source.num_routed_experts));
  }
  const std::vector<int> want = DistinctSlotExperts(table, rank);
  if (source.Ids() != want) {
    return Invalid(source, absl::StrCat("experts: expected ", DescribeExpertIds(want), " for rank ",
                                        rank, " under the installed placement table (fingerprint ",
                                        absl::Hex(table.Fingerprint()), "), got ",
                                        DescribeExpertIds(source.Ids())));
  }
  return absl::OkStatus();
}

absl::Status CheckExpertRange(const ExpertSource& source, int rank, int ep_size) {
  ASSIGN_OR_RETURN(ExpertPlacement placement,
                   ExpertPlacement::Contiguous(source.num_routed_experts, ep_size));
  if (rank < 0 || rank >= ep_size) {
    return Invalid(source, absl::StrCat("rank: expected in [0, ", ep_size, "), got ", rank));
  }
  const int first = placement.FirstExpert(rank);
  const int count = placement.NumLocalExperts(rank);
  if (source.first_expert != first || source.num_experts != count) {
    return Invalid(
        source,
        absl::StrFormat("expert range: expected [%d, %d) for rank %d of %d (contiguous "
                        "placement of %d experts), got [%d, %d)",
                        first, first + count, rank, ep_size, source.num_routed_experts,
                        source.first_expert, int64_t{source.first_expert} + source.num_experts));
  }
  return absl::OkStatus();
}

absl::StatusOr<SafetensorsCheckpoint> OpenExpertCheckpoint(const ExpertSource& source) {
  absl::StatusOr<SafetensorsCheckpoint> ckpt = SafetensorsCheckpoint::Open(source.checkpoint_path);
  if (!ckpt.ok()) return WithSource(source, ckpt.status());
  for (int e : source.Ids()) {
    for (SeededProjection proj : kProjections) {
      const bool down = proj == SeededProjection::kDown;
      absl::StatusOr<SafetensorsTensorView> view = FindBf16Matrix(
          *ckpt, source.TensorName(e, proj), down ? source.hidden : source.intermediate,
          down ? source.intermediate : source.hidden);
      if (!view.ok()) return WithSource(source, view.status());
    }
  }
  return ckpt;
}

namespace {

// The SwiGLU-kind experts of a seeded or safetensors source, in its format.
absl::StatusOr<ExpertSet> MakeSwiGluKindExperts(const ExpertSource& source) {
  const ExpertKind kind = source.expert_kind();
  if (source.kind == ExpertSourceKind::kSeeded) {
    switch (kind) {
      case ExpertKind::kFp8SwiGlu:
        return ExpertSet::GenerateFp8SwiGlu(source.seed, source.layer, source.first_expert,
                                            source.num_experts, source.hidden, source.intermediate);
      case ExpertKind::kGptOssMxfp4:
        return ExpertSet::GenerateGptOss(source.seed, source.layer, source.first_expert,
                                         source.num_experts, source.hidden, source.intermediate,
                                         source.gpt_oss_activation);
      default:
        return ExpertSet::GenerateSwiGlu(source.seed, source.layer, source.first_expert,
                                         source.num_experts, source.hidden, source.intermediate);
    }
  }
  if (kind == ExpertKind::kFp8SwiGlu || kind == ExpertKind::kGptOssMxfp4) {
    absl::StatusOr<SafetensorsCheckpoint> ckpt =
        SafetensorsCheckpoint::Open(source.checkpoint_path);
    if (!ckpt.ok()) return WithSource(source, ckpt.status());
    if (kind == ExpertKind::kGptOssMxfp4) {
      const std::string prefix = source.name_pattern.empty()
                                     ? std::string(quant::kGptOssExpertPrefix)
                                     : source.name_pattern;
      absl::StatusOr<std::vector<quant::GptOssExpertWeights>> read =
          quant::ReadGptOssExperts(*ckpt, prefix, source.layer, source.num_routed_experts,
                                   source.Ids(), source.hidden, source.intermediate);
      if (!read.ok()) return WithSource(source, read.status());
      return ExpertSet::FromGptOssWeights(source.first_expert, std::move(*read), source.hidden,
                                          source.intermediate, source.gpt_oss_activation);
    }
    std::vector<quant::Fp8SwiGluWeights> weights(source.num_experts);
    for (int i = 0; i < source.num_experts; ++i) {
      const int e = source.first_expert + i;
      quant::Fp8BlockMatrix* parts[3] = {&weights[i].gate, &weights[i].up, &weights[i].down};
      for (int p = 0; p < 3; ++p) {
        const bool down = p == 2;
        const std::string name = source.TensorName(e, kProjections[p]);
        absl::StatusOr<quant::Fp8BlockMatrix> read = quant::ReadFp8BlockMatrix(
            *ckpt, name, name + "_scale_inv", down ? source.hidden : source.intermediate,
            down ? source.intermediate : source.hidden);
        if (!read.ok()) return WithSource(source, read.status());
        *parts[p] = std::move(*read);
      }
    }
    return ExpertSet::FromFp8Weights(source.first_expert, std::move(weights), source.hidden,
                                     source.intermediate);
  }
  ASSIGN_OR_RETURN(SafetensorsCheckpoint ckpt, OpenExpertCheckpoint(source));
  std::vector<SwiGluWeights> weights(source.num_experts);
  for (int i = 0; i < source.num_experts; ++i) {
    const int e = source.first_expert + i;
    SwiGluWeights& w = weights[i];
    std::vector<bf16_t>* parts[3] = {&w.gate, &w.up, &w.down};
    for (int p = 0; p < 3; ++p) {
      const bool down = p == 2;
      absl::StatusOr<std::vector<bf16_t>> read = ReadBf16Matrix(
          ckpt, source.TensorName(e, kProjections[p]), down ? source.hidden : source.intermediate,
          down ? source.intermediate : source.hidden);
      if (!read.ok()) return WithSource(source, read.status());
      *parts[p] = std::move(*read);
    }
  }
  return ExpertSet::FromWeights(source.first_expert, std::move(weights), source.hidden,
                                source.intermediate);
}

}  // namespace

absl::StatusOr<ExpertSet> MakeHostExperts(const ExpertSource& source) {
  RETURN_IF_ERROR(ValidateExpertSource(source));
  const std::vector<int> ids = source.Ids();
  if (!ids.empty() && ids.back() - ids.front() + 1 != static_cast<int>(ids.size())) {
    // Not one range: each maximal run of consecutive ids is a range source,
    // and the set is their union (the same bits per expert as one range).
    std::vector<ExpertSet> parts;
    for (size_t begin = 0; begin < ids.size();) {
      size_t end = begin + 1;
      while (end < ids.size() && ids[end] == ids[end - 1] + 1) ++end;
      ExpertSource run = source;
      run.expert_ids.clear();
      run.first_expert = ids[begin];
      run.num_experts = static_cast<int>(end - begin);
      ASSIGN_OR_RETURN(ExpertSet part, MakeHostExperts(run));
      parts.push_back(std::move(part));
      begin = end;
    }
    return ExpertSet::Union(std::move(parts));
  }
  if (source.kind == ExpertSourceKind::kIdentity) {
    return ExpertSet::Identity(source.first_expert, source.num_experts, source.hidden);
  }
  ASSIGN_OR_RETURN(ExpertSet set, MakeSwiGluKindExperts(source));
  set.set_router_weight_use(source.router_weight_use);
  return set;
}

}  // namespace moe_ep::core
