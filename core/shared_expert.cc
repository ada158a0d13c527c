#include "core/shared_expert.h"

#include <cmath>
#include <string_view>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"
#include "core/safetensors.h"
#include "core/seeded_stream.h"
#include "core/status_macros.h"

namespace moe_ep::core {
namespace {

absl::Status CheckHidden(int64_t hidden) {
  if (hidden < 1) {
    return absl::InvalidArgumentError(absl::StrFormat("hidden: expected >= 1, got %d", hidden));
  }
  return absl::OkStatus();
}

absl::Status CheckGate(const std::vector<bf16_t>& gate, int64_t hidden) {
  if (!gate.empty() && static_cast<int64_t>(gate.size()) != hidden) {
    return absl::InvalidArgumentError(
        absl::StrFormat("gate: expected %d elements (H), got %d", hidden, gate.size()));
  }
  return absl::OkStatus();
}

std::vector<bf16_t> SeededGate(uint64_t seed, int layer, int64_t hidden) {
  std::vector<bf16_t> gate(hidden);
  const uint64_t key = SharedGateKey(seed, layer);
  const SeededUniform range = SeededUniformFor(hidden);
  for (int64_t h = 0; h < hidden; ++h) gate[h] = SeededElement(key, h, range);
  return gate;
}

std::string SharedTensorName(const std::string& pattern, int layer, const char* hf,
                             const char* mixtral) {
  return absl::StrReplaceAll(pattern,
                             {{"{layer}", absl::StrCat(layer)}, {"{proj}", hf}, {"{w}", mixtral}});
}

}  // namespace

uint64_t SharedExpertSeed(uint64_t seed) {
  return SplitMix64(seed ^ 0x7368617265642d65ull);  // "shared-e"
}

uint64_t SharedGateKey(uint64_t seed, int layer) {
  // Expert -1 never names a routed expert; kGate as the projection.
  return SeededTensorKey(SharedExpertSeed(seed), layer, -1, SeededProjection::kGate);
}

float StableSigmoid(float z) {
  if (z >= 0.0f) return 1.0f / (1.0f + std::exp(-z));
  const float e = std::exp(z);
  return e / (1.0f + e);
}

absl::StatusOr<SharedExpert> SharedExpert::Generate(uint64_t seed, int layer, int64_t hidden,
                                                    int64_t intermediate, bool sigmoid_gate) {
  ASSIGN_OR_RETURN(ExpertSet set, ExpertSet::GenerateSwiGlu(SharedExpertSeed(seed), layer, 0, 1,
                                                            hidden, intermediate));
  return SharedExpert(std::move(set),
                      sigmoid_gate ? SeededGate(seed, layer, hidden) : std::vector<bf16_t>());
}

absl::StatusOr<SharedExpert> SharedExpert::Identity(uint64_t seed, int layer, int64_t hidden,
                                                    bool sigmoid_gate) {
  RETURN_IF_ERROR(CheckHidden(hidden));
  return SharedExpert(ExpertSet::Identity(0, 1, hidden),
                      sigmoid_gate ? SeededGate(seed, layer, hidden) : std::vector<bf16_t>());
}

absl::StatusOr<SharedExpert> SharedExpert::FromWeights(SwiGluWeights weights,
                                                       std::vector<bf16_t> gate, int64_t hidden,
                                                       int64_t intermediate) {
  RETURN_IF_ERROR(CheckGate(gate, hidden));
  std::vector<SwiGluWeights> one;
  one.push_back(std::move(weights));
  ASSIGN_OR_RETURN(ExpertSet set, ExpertSet::FromWeights(0, std::move(one), hidden, intermediate));
  return SharedExpert(std::move(set), std::move(gate));
}

absl::StatusOr<SharedExpert> SharedExpert::IdentityWithGate(std::vector<bf16_t> gate,
                                                            int64_t hidden) {
  RETURN_IF_ERROR(CheckHidden(hidden));
  RETURN_IF_ERROR(CheckGate(gate, hidden));
  return SharedExpert(ExpertSet::Identity(0, 1, hidden), std::move(gate));
}

absl::StatusOr<SharedExpert> SharedExpert::LoadSafetensors(const std::string& path,
                                                           const std::string& name_pattern,
                                                           const std::string& gate_name, int layer,
                                                           int64_t hidden, int64_t intermediate) {
  RETURN_IF_ERROR(CheckSwiGluDims(0, 1, hidden, intermediate));
  const std::string_view pattern(name_pattern);
  if (pattern.find("{proj}") == std::string_view::npos &&
      pattern.find("{w}") == std::string_view::npos) {
    return absl::InvalidArgumentError(
        absl::StrCat("shared name_pattern: expected {proj} or {w}, got \"", name_pattern, "\""));
  }
  ASSIGN_OR_RETURN(SafetensorsCheckpoint ckpt, SafetensorsCheckpoint::Open(path));
  SwiGluWeights w;
  ASSIGN_OR_RETURN(w.gate,
                   ReadBf16Matrix(ckpt, SharedTensorName(name_pattern, layer, "gate_proj", "w1"),
                                  intermediate, hidden));
  ASSIGN_OR_RETURN(w.up,
                   ReadBf16Matrix(ckpt, SharedTensorName(name_pattern, layer, "up_proj", "w3"),
                                  intermediate, hidden));
  ASSIGN_OR_RETURN(
      w.down, ReadBf16Matrix(ckpt, SharedTensorName(name_pattern, layer, "down_proj", "w2"), hidden,
                             intermediate));
  std::vector<bf16_t> gate;
  if (!gate_name.empty()) {
    const std::string name = absl::StrReplaceAll(gate_name, {{"{layer}", absl::StrCat(layer)}});
    ASSIGN_OR_RETURN(gate, ReadBf16Matrix(ckpt, name, 1, hidden));
  }
  return FromWeights(std::move(w), std::move(gate), hidden, intermediate);
}

int64_t SharedExpert::weight_bytes() const {
  return experts_.weight_bytes() + static_cast<int64_t>(gate_.size() * sizeof(bf16_t));
}

absl::Status SharedExpert::GateValues(absl::Span<const bf16_t> hidden, int64_t num_tokens,
                                      absl::Span<float> g) const {
  const int64_t h = experts_.hidden();
  if (num_tokens < 0 || static_cast<int64_t>(hidden.size()) != num_tokens * h ||
      static_cast<int64_t>(g.size()) != num_tokens) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shared expert: expected hidden [%d, %d] and %d gate values, got %d and %d elements",
        num_tokens, h, num_tokens, hidden.size(), g.size()));
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    if (gate_.empty()) {
      g[t] = 1.0f;
      continue;
    }
    float logit = 0.0f;
    for (int64_t i = 0; i < h; ++i) logit += Bf16ToFloat(gate_[i]) * Bf16ToFloat(hidden[t * h + i]);
    g[t] = StableSigmoid(logit);
  }
  return absl::OkStatus();
}

absl::Status SharedExpert::ComputeFloat(absl::Span<const bf16_t> hidden, int64_t num_tokens,
                                        absl::Span<float> out) const {
  const int64_t h = experts_.hidden();
  std::vector<float> g(num_tokens > 0 ? num_tokens : 0);
  RETURN_IF_ERROR(GateValues(hidden, num_tokens, absl::MakeSpan(g)));
  if (static_cast<int64_t>(out.size()) != num_tokens * h) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shared expert: out expected [%d, %d], got %d elements", num_tokens, h, out.size()));
  }
  std::vector<float> x(hidden.size());
  for (size_t i = 0; i < x.size(); ++i) x[i] = Bf16ToFloat(hidden[i]);
  if (experts_.kind() == ExpertKind::kIdentity) {
    std::copy(x.begin(), x.end(), out.begin());
  } else if (num_tokens > 0) {
    RETURN_IF_ERROR(experts_.Apply(0, x, num_tokens, out));
  }
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t i = 0; i < h; ++i) out[t * h + i] *= g[t];
  }
  return absl::OkStatus();
}

absl::Status SharedExpert::Compute(absl::Span<const bf16_t> hidden, int64_t num_tokens,
                                   absl::Span<bf16_t> out) const {
  const int64_t h = experts_.hidden();
  if (num_tokens < 0 || static_cast<int64_t>(out.size()) != num_tokens * h) {
    return absl::InvalidArgumentError(absl::StrFormat(
        "shared expert: out expected [%d, %d], got %d elements", num_tokens, h, out.size()));
  }
  std::vector<float> y(out.size());
  RETURN_IF_ERROR(ComputeFloat(hidden, num_tokens, absl::MakeSpan(y)));
  for (size_t i = 0; i < y.size(); ++i) out[i] = FloatToBf16(y[i]);
  return absl::OkStatus();
}

}  // namespace moe_ep::core
