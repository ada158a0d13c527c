#pragma once

// The experts of one MoE layer held by one rank, and their computation
// (DESIGN §7). SwiGLU: out = down( silu(gate(x)) * up(x) ) with gate, up
// [I, H] and down [H, I], bf16 storage and fp32 accumulation (BLAS sgemm on
// weights widened to fp32 per call). Identity: out = x.
//
// Seeded weights are a pure function of (seed, layer, expert, projection), so
// any process (a worker holding a few experts, or the single-process
// reference holding all) generates bit-identical weights.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/types/span.h"
#include "core/bf16.h"
#include "core/model_config.h"
#include "core/quantized_expert_compute.h"
#include "core/quantized_weights.h"
#include "core/safetensors.h"
#include "core/stop_check.h"

namespace moe_ep::core {

// What an expert computes and from which weights (DESIGN §7; issue 35).
enum class ExpertKind {
  kSwiGlu,    // down(silu(gate(x)) * up(x)), bf16 weights, fp32 activations
  kIdentity,  // x
  // DeepSeek-V3's SwiGLU on fp8 e4m3 128 x 128 block-scaled weights with
  // activations quantized per token per 128 channels
  // (core/quantized_expert_compute.h).
  kFp8SwiGlu,
  // gpt-oss's clamped SwiGLU with biases on mxfp4 weights, bf16 activations
  // (core/quantized_expert_compute.h).
  kGptOssMxfp4,
};

// "swiglu", "identity", "fp8-swiglu", "gpt-oss-mxfp4".
const char* ExpertKindName(ExpertKind kind);

// Reads one 2-D tensor `name` of shape [rows, cols] from `ckpt` as bf16 bit
// patterns (BF16 as is, F16 and F32 rounded to nearest even), row-major.
// Errors: kNotFound (no such tensor), kInvalidArgument (shape differs, or a
// quantized dtype such as F8_E4M3 or U8, naming the tensor, expected and
// got), kDataLoss (corrupt file).
// Used by ExpertSet::LoadSafetensors and core/shared_expert.h.
absl::StatusOr<std::vector<bf16_t>> ReadBf16Matrix(SafetensorsCheckpoint& ckpt,
                                                   const std::string& name, int64_t rows,
                                                   int64_t cols);

// FindBf16Matrix()
//
// The view of 2-D tensor `name` of shape [rows, cols] in `ckpt`, from the
// header alone (no data is read), for loaders that decode it piece by piece
// (SafetensorsToBf16; kernels/device_experts.h). Errors: as ReadBf16Matrix
// without kDataLoss from the data.
absl::StatusOr<SafetensorsTensorView> FindBf16Matrix(SafetensorsCheckpoint& ckpt,
                                                     const std::string& name, int64_t rows,
                                                     int64_t cols);

// The argument checks of ExpertSet::GenerateSwiGlu, FromWeights and
// LoadSafetensors (and kernels::DeviceExpertSet::GenerateSwiGlu), in this
// order. Errors: kInvalidArgument for hidden < 1, intermediate < 1,
// num_experts < 0 or first_expert < 0, naming the field and its value.
absl::Status CheckSwiGluDims(int first_expert, int num_experts, int64_t hidden,
                             int64_t intermediate);

// How many weights ExpertSet::GenerateSwiGlu makes between two polls of its
// StopCheck (8 MiB of bf16; tens of milliseconds of one core).
inline constexpr int64_t kGenerateStopChunk = int64_t{1} << 22;

// Weights of one SwiGLU expert, bf16 bit patterns, row-major.
struct SwiGluWeights {
  std::vector<bf16_t> gate;  // [I, H]
  std::vector<bf16_t> up;    // [I, H]
  std::vector<bf16_t> down;  // [H, I]
};

// Experts of one layer: the range [first_expert, first_expert + num_experts)
// (every factory but Union), or any set of distinct logical experts (Union:
// the slots of a rank under a placement table, DESIGN §15).
class ExpertSet {
 public:
  // The arguments seeded weights were generated from (GenerateSwiGlu), so a
  // device can make the same bits itself instead of copying them
  // (kernels/device_experts.h, core/seeded_stream.h).
  struct SeedOrigin {
    uint64_t seed = 0;
    int layer = 0;
  };

  // Seeded SwiGLU weights: values uniform in [-s, s] with s = 1/sqrt(fan_in),
  // so activations keep their scale across layers. Large sets are generated
  // on all cores (core/parallel_for.h; the counter-based stream of
  // core/seeded_stream.h makes the bits independent of the split). `stop`
  // (core/stop_check.h; null = never) is polled on the calling thread
  // before each chunk of kGenerateStopChunk weights: once it answers true,
  // nothing is returned but LocalStop ("weight generation: after <n> of
  // <total> weights"), so a request-sized set ends soon after its call's
  // bound (issue 13 item 6). The bits do not depend on `stop`.
  // Errors: kInvalidArgument for hidden < 1, intermediate < 1, num_experts < 0;
  // LocalStop.
  static absl::StatusOr<ExpertSet> GenerateSwiGlu(uint64_t seed, int layer, int first_expert,
                                                  int num_experts, int64_t hidden,
                                                  int64_t intermediate,
                                                  const StopCheck& stop = nullptr);
  static ExpertSet Identity(int first_expert, int num_experts, int64_t hidden);
  // SwiGLU experts [first_expert, first_expert + weights.size()) from given
  // weights (tests, converters). Errors: kInvalidArgument for hidden or
  // intermediate < 1, first_expert < 0, or a tensor whose size is not I * H.
  static absl::StatusOr<ExpertSet> FromWeights(int first_expert, std::vector<SwiGluWeights> weights,
                                               int64_t hidden, int64_t intermediate);
  // Loads gate/up/down of each expert from a safetensors file (bf16 or fp32
  // tensors). `name_pattern` contains {layer}, {expert} and {proj} (gate_proj,
  // up_proj, down_proj). Errors: kNotFound (file or tensor name),
  // kInvalidArgument (shape or dtype differs from [I, H] / [H, I]).
  // Details (core/safetensors.h): `path` is a .safetensors file, a
  // model.safetensors.index.json, or a directory holding either; BF16, F16
  // and F32 tensors are accepted (F16/F32 rounded to bf16). {proj} expands to
  // the Qwen/DeepSeek names gate_proj/up_proj/down_proj; {w} expands to
  // Mixtral's w1/w3/w2 (gate/up/down), e.g.
  //   Qwen-MoE, DeepSeek: "model.layers.{layer}.mlp.experts.{expert}.{proj}.weight"
  //   Mixtral:            "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"
  // The pattern must hold {expert} and {proj} or {w} (kInvalidArgument).
  // A corrupt file is kDataLoss.
  static absl::StatusOr<ExpertSet> LoadSafetensors(const std::string& path,
                                                   const std::string& name_pattern, int layer,
                                                   int first_expert, int num_experts,
                                                   int64_t hidden, int64_t intermediate);

  // Quantized experts (issue 35): fp8 block-scaled SwiGLU (gate, up [I, H],
  // down [H, I] each Fp8BlockMatrix) and gpt-oss mxfp4 (gate_up [2I, H], down
  // [H, I], biases), experts [first_expert, first_expert + weights.size()).
  // Errors: kInvalidArgument as FromWeights, naming the expert and tensor
  // whose shape or scale grid is wrong (quant::CheckFp8BlockMatrix,
  // quant::CheckMxfp4Matrix); mxfp4 H or I not a multiple of 32.
  static absl::StatusOr<ExpertSet> FromFp8Weights(int first_expert,
                                                  std::vector<quant::Fp8SwiGluWeights> weights,
                                                  int64_t hidden, int64_t intermediate);
  static absl::StatusOr<ExpertSet> FromGptOssWeights(
      int first_expert, std::vector<quant::GptOssExpertWeights> weights, int64_t hidden,
      int64_t intermediate, const quant::GptOssActivation& activation = {});
  // Seeded quantized experts: quant::GenerateFp8SwiGlu / GenerateGptOssExpert
  // per expert (the seeded bf16 weights of GenerateSwiGlu, quantized), with
  // `stop` polled before each expert (LocalStop as GenerateSwiGlu).
  // Errors: those of the generators and of FromFp8Weights / FromGptOssWeights.
  static absl::StatusOr<ExpertSet> GenerateFp8SwiGlu(uint64_t seed, int layer, int first_expert,
                                                     int num_experts, int64_t hidden,
                                                     int64_t intermediate,
                                                     const StopCheck& stop = nullptr);
  static absl::StatusOr<ExpertSet> GenerateGptOss(uint64_t seed, int layer, int first_expert,
                                                  int num_experts, int64_t hidden,
                                                  int64_t intermediate,
                                                  const quant::GptOssActivation& activation = {},
                                                  const StopCheck& stop = nullptr);

  // Union()
  //
  // One set holding the experts of all `parts` (each a range as the
  // factories above make; any order), indexed in ascending expert id. When
  // the ids form one range the result is that range's set, identical to
  // making it in one call. Replicas of one logical expert on one rank are one
  // expert of the set: its weights are held once (DESIGN §15).
  // Errors (kInvalidArgument): `parts` empty; parts of different kind, H,
  // I, router-weight use or gpt-oss activation; an expert held by two parts
  // (names it).
  static absl::StatusOr<ExpertSet> Union(std::vector<ExpertSet> parts);

  ExpertKind kind() const { return kind_; }
  // The smallest expert id held, and how many experts are held.
  int first_expert() const { return first_expert_; }
  int num_experts() const { return num_experts_; }
  // The expert ids held, ascending ([num_experts()]).
  std::vector<int> expert_ids() const;
  // Whether the ids held are exactly [first_expert, first_expert + num_experts).
  bool contiguous() const { return local_of_.empty(); }
  int64_t hidden() const { return hidden_; }
  int64_t intermediate() const { return intermediate_; }
  bool Owns(int64_t expert_id) const { return LocalIndex(expert_id) >= 0; }
  // The position of `expert_id` among expert_ids() (its local index), or -1
  // when the set does not hold it.
  int LocalIndex(int64_t expert_id) const {
    if (local_of_.empty()) {
      return expert_id >= first_expert_ && expert_id < first_expert_ + num_experts_
                 ? static_cast<int>(expert_id - first_expert_)
                 : -1;
    }
    return expert_id >= 0 && expert_id < static_cast<int64_t>(local_of_.size())
               ? local_of_[expert_id]
               : -1;
  }
  // Bytes of weight storage held, in the weights' own format (bf16 2 a
  // weight; fp8 1 a weight + 4 a 128 x 128 block; mxfp4 17/32 a weight + the
  // bf16 biases); 0 for identity.
  int64_t weight_bytes() const;
  // The quantized weights of local expert `local_index`. REQUIRES: kind()
  // kFp8SwiGlu (resp. kGptOssMxfp4) and 0 <= local_index < num_experts().
  const quant::Fp8SwiGluWeights& fp8_weights(int local_index) const {
    return fp8_weights_[local_index];
  }
  const quant::GptOssExpertWeights& gpt_oss_weights(int local_index) const {
    return gpt_oss_weights_[local_index];
  }
  // gpt-oss's activation parameters (kGptOssMxfp4; defaults otherwise).
  const quant::GptOssActivation& gpt_oss_activation() const { return gpt_oss_activation_; }

  // How ComputeWeightedSum applies a row's router weight w (DESIGN §7;
  // issue 35 item 5): kScalesOutput (default) w * e(x); kScalesInput
  // e(w * x), as Llama-4's routed experts compute (the sigmoid router score
  // multiplies the expert's input, in fp32, before the expert). Identity
  // experts give w * x either way. Apply never scales.
  RouterWeightUse router_weight_use() const { return router_weight_use_; }
  void set_router_weight_use(RouterWeightUse use) { router_weight_use_ = use; }
  // SwiGLU weights of local expert `expert_ids()[local_index]`, for copying
  // onto a device (kernels/device_experts.h). REQUIRES: kind() == kSwiGlu and
  // 0 <= local_index < num_experts().
  const SwiGluWeights& swiglu_weights(int local_index) const { return weights_[local_index]; }
  // (seed, layer) for sets made by GenerateSwiGlu; empty for identity,
  // FromWeights and LoadSafetensors sets.
  const std::optional<SeedOrigin>& seed_origin() const { return seed_origin_; }

  // out[r, :] = expert(x[r, :]) for `rows` rows; x and out are [rows, H] fp32.
  // kSwiGlu widens the expert's weights to fp32 on all cores (large
  // experts), then runs two BLAS sgemm calls (BLAS's own threads);
  // kFp8SwiGlu and kGptOssMxfp4 run the quantized reference
  // (quant::Fp8SwiGluForward, quant::GptOssExpertForward) on all cores.
  // Thread-compatible.
  // Errors: kInvalidArgument when !Owns(expert_id) or spans are too short.
  absl::Status Apply(int64_t expert_id, absl::Span<const float> x, int64_t rows,
                     absl::Span<float> out) const;
  // As Apply, with the fp32 weights and intermediate held in `scratch`, grown
  // to 3 * I * H + rows * 2 * I floats when smaller and never shrunk, so a
  // caller applying many experts reuses one buffer instead of faulting in
  // fresh pages on every call (a DeepSeek-V3 expert widens to 528 MiB).
  // Same output bits as Apply.
  absl::Status Apply(int64_t expert_id, absl::Span<const float> x, int64_t rows,
                     absl::Span<float> out, std::vector<float>& scratch) const;

  // Expert compute for received rows (DESIGN §7): for each row r of `x`
  // ([rows, H] fp32), out[r] = sum over k with Owns(ids[r, k]) of
  // weights[r, k] * expert_{ids[r,k]}(x[r]). Rows are grouped by expert so each
  // expert runs one GEMM. ids [rows, K] int32, weights [rows, K] fp32,
  // out [rows, H] fp32 (overwritten). Rows with no local expert get zeros.
  // Under RouterWeightUse::kScalesInput the term is expert(w * x[r]).
  // `stop` (core/stop_check.h; null = never) is polled before each expert
  // that has rows (SwiGLU sets): once it answers true the sum is abandoned
  // (`out` holds a partial sum) and LocalStop ("expert compute: after <e>
  // of <n> experts with rows") is returned (issue 13 item 6).
  absl::Status ComputeWeightedSum(absl::Span<const float> x, absl::Span<const int32_t> ids,
                                  absl::Span<const float> weights, int64_t rows, int top_k,
                                  absl::Span<float> out, const StopCheck& stop = nullptr) const;

 private:
  ExpertKind kind_ = ExpertKind::kIdentity;
  int first_expert_ = 0;
  int num_experts_ = 0;
  int64_t hidden_ = 0;
  int64_t intermediate_ = 0;
  std::vector<SwiGluWeights> weights_;                       // num_experts_ entries for kSwiGlu
  std::vector<quant::Fp8SwiGluWeights> fp8_weights_;         // for kFp8SwiGlu
  std::vector<quant::GptOssExpertWeights> gpt_oss_weights_;  // for kGptOssMxfp4
  quant::GptOssActivation gpt_oss_activation_;
  RouterWeightUse router_weight_use_ = RouterWeightUse::kScalesOutput;
  // Empty for a range; else [max id + 1]: local index of each id, -1 when
  // not held (Union of a set that is not a range).
  std::vector<int> local_of_;
  std::optional<SeedOrigin> seed_origin_;

  // Both Apply overloads; `scratch` may be null (a buffer per call).
  absl::Status ApplyWithScratch(int64_t expert_id, absl::Span<const float> x, int64_t rows,
                                absl::Span<float> out, std::vector<float>* scratch) const;
};

}  // namespace moe_ep::core
