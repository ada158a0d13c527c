#pragma once

// The shared expert of one MoE layer (DESIGN §7 "Shared experts"; issue 18):
// a dense SwiGLU every token passes through, never dispatched. Each rank
// holds a replica and computes it for its own tokens; the result is one more
// term of the combine sum:
//
//   y[t] = bf16( sum over destination ranks d of float(routed_d[t])
//                + float(bf16(g[t] * shared(x[t]))) )
//   g[t] = sigmoid(sum_h float(gate[h]) * float(x[t, h]))  with a gate
//          (Qwen2-MoE `shared_expert_gate`, [1, H]), else 1.
//
// DeepSeek/Kimi's n_shared_experts are one fused SwiGLU of
// n * moe_intermediate_size (core/model_config.h); Llama-4's shared expert
// is ungated. An identity shared expert (shared(x) = x) serves
// communication-only runs, gated or not.
//
// Seeded weights are a pure function of (seed, layer): the SwiGLU is
// ExpertSet::GenerateSwiGlu(SharedExpertSeed(seed), layer, 0, 1, H, I) and
// the gate's element h is SeededElement(SharedGateKey(seed, layer), h,
// SeededUniformFor(H)) (core/seeded_stream.h), so workers, the reference and
// a device generator make the same bits without copying.
// Thread-compatible (const methods may run concurrently).

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/experts.h"

namespace moe_ep::core {

// The seed the shared SwiGLU is generated from: distinct from `seed` so it
// never equals routed expert 0 of the same layer.
uint64_t SharedExpertSeed(uint64_t seed);
// The seeded-stream key of layer `layer`'s gate vector.
uint64_t SharedGateKey(uint64_t seed, int layer);

// sigmoid(z) = 1 / (1 + exp(-z)) in fp32, without overflow for large |z|
// (z = -30 gives 9.3576e-14, z = 30 gives 1 - 9.4e-14, which rounds to 1).
float StableSigmoid(float z);

class SharedExpert {
 public:
  // Seeded SwiGLU (see above); `sigmoid_gate` adds a seeded gate vector.
  // Errors: kInvalidArgument for hidden < 1 or intermediate < 1.
  static absl::StatusOr<SharedExpert> Generate(uint64_t seed, int layer, int64_t hidden,
                                               int64_t intermediate, bool sigmoid_gate);
  // shared(x) = x; with `sigmoid_gate`, the seeded gate of (seed, layer).
  // Errors: kInvalidArgument for hidden < 1.
  static absl::StatusOr<SharedExpert> Identity(uint64_t seed, int layer, int64_t hidden,
                                               bool sigmoid_gate);
  // Given weights (tests, converters); `gate` empty = no gate, else [H].
  // Errors: kInvalidArgument (a tensor's size is not I * H, or the gate's
  // not H).
  static absl::StatusOr<SharedExpert> FromWeights(SwiGluWeights weights, std::vector<bf16_t> gate,
                                                  int64_t hidden, int64_t intermediate);
  // As FromWeights with shared(x) = x (tests). Errors: as Identity, and a
  // gate whose size is not H.
  static absl::StatusOr<SharedExpert> IdentityWithGate(std::vector<bf16_t> gate, int64_t hidden);
  // Loads from a safetensors checkpoint (file, index or directory; see
  // core/safetensors.h). `name_pattern` holds {layer} and {proj}
  // (gate_proj/up_proj/down_proj) or {w} (w1/w3/w2), e.g.
  //   DeepSeek/Kimi: "model.layers.{layer}.mlp.shared_experts.{proj}.weight"
  //   Qwen2-MoE:     "model.layers.{layer}.mlp.shared_expert.{proj}.weight"
  //   Llama-4:       "language_model.model.layers.{layer}.feed_forward.shared_expert.{proj}.weight"
  // `gate_name` ({layer} expanded; empty = no gate), a [1, H] tensor, e.g.
  //   Qwen2-MoE:     "model.layers.{layer}.mlp.shared_expert_gate.weight".
  // Errors: kInvalidArgument (pattern lacks {proj}/{w}, sizes < 1, a shape
  // differs), kNotFound (file or tensor, named), kDataLoss (corrupt file).
  static absl::StatusOr<SharedExpert> LoadSafetensors(const std::string& path,
                                                      const std::string& name_pattern,
                                                      const std::string& gate_name, int layer,
                                                      int64_t hidden, int64_t intermediate);

  ExpertKind kind() const { return experts_.kind(); }
  int64_t hidden() const { return experts_.hidden(); }
  int64_t intermediate() const { return experts_.intermediate(); }  // 0 for identity
  bool has_gate() const { return !gate_.empty(); }
  // The gate vector [H] (bf16 bit patterns); empty without a gate.
  const std::vector<bf16_t>& gate() const { return gate_; }
  // The SwiGLU as a one-expert set (expert id 0), for device upload.
  const ExpertSet& experts() const { return experts_; }
  // Bytes held: 3 * I * H * 2 for the SwiGLU plus 2 * H for a gate.
  int64_t weight_bytes() const;

  // g[t] for `num_tokens` rows of hidden [T, H] bf16 (1 without a gate);
  // the dot product is summed in fp32 in ascending h. g has T entries.
  // Errors: kInvalidArgument when a span's size differs from its shape.
  absl::Status GateValues(absl::Span<const bf16_t> hidden, int64_t num_tokens,
                          absl::Span<float> g) const;
  // out[t] = g[t] * shared(x[t]) in fp32, [T, H] (overwritten).
  // Errors: as GateValues.
  absl::Status ComputeFloat(absl::Span<const bf16_t> hidden, int64_t num_tokens,
                            absl::Span<float> out) const;
  // The combine term: out[t] = bf16(g[t] * shared(x[t])), [T, H] bf16.
  // Errors: as GateValues.
  absl::Status Compute(absl::Span<const bf16_t> hidden, int64_t num_tokens,
                       absl::Span<bf16_t> out) const;

 private:
  SharedExpert(ExpertSet experts, std::vector<bf16_t> gate)
      : experts_(std::move(experts)), gate_(std::move(gate)) {}

  ExpertSet experts_;
  std::vector<bf16_t> gate_;  // [H] or empty
};

}  // namespace moe_ep::core
