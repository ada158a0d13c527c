#pragma once

// The MoE shape of a model, read from its Hugging Face `config.json`
// (DESIGN §9): sizes, routed experts, top-k and which decoder layers are
// sparse (MoE) versus dense.

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "core/quantized_formats.h"
#include "nlohmann/json.hpp"

namespace moe_ep::core {

// The shared (dense, never dispatched) expert of each sparse layer
// (DESIGN §7): a SwiGLU of `intermediate_size` every token passes through,
// added to the routed sum, times sigmoid(gate . x) when `sigmoid_gate`.
// DeepSeek/Kimi fuse their n_shared_experts into one SwiGLU of
// n_shared_experts * moe_intermediate_size (as their modelling code does).
struct SharedExpertConfig {
  int count = 0;                  // shared experts as published; 0 = none
  int64_t intermediate_size = 0;  // I of the (fused) shared SwiGLU, elements; 0 = none
  bool sigmoid_gate = false;      // Qwen2-MoE `shared_expert_gate` ([1, H])
  std::string source_key;         // the key it was read from, e.g. "n_shared_experts"

  bool present() const { return intermediate_size > 0; }
};

// How the router's top-k weight w enters a routed expert's term.
enum class RouterWeightUse {
  kScalesOutput,  // w * e(x): DeepSeek, Qwen, Mixtral, gpt-oss, MiniMax, Jamba
  kScalesInput,   // e(w * x): Llama-4 (sigmoid score times the expert's input)
};

// "output" or "input".
const char* RouterWeightUseName(RouterWeightUse use);

// The checkpoint's `quantization_config` (DESIGN §7 "Weight formats are the
// checkpoint's"; issue 35 item 1). Absent: bf16 weights, method "".
struct QuantizationConfig {
  std::string method;  // quant_method as published: "" (none), "fp8", "mxfp4"
  std::string fmt;     // fp8's value format as published: "e4m3", "float8_e4m3fn"; else ""
  // Weight block [rows, cols] of one scale: fp8 [128, 128] (weight_block_size);
  // mxfp4 [1, 32] (fixed by the format: one E8M0 scale per 32 along K);
  // empty for bf16.
  std::vector<int64_t> weight_block_size;
  std::string activation_scheme;  // "dynamic" (fp8), "" when not given
  // Module patterns left in bf16, as published (e.g. "lm_head",
  // "model.layers.*.mlp.router").
  std::vector<std::string> modules_to_not_convert;
  // The routed experts' weight format: kFp8Block128 / kMxfp4 unless an entry
  // of modules_to_not_convert names the experts (then kBf16).
  quant::ExpertWeightFormat expert_format = quant::ExpertWeightFormat::kBf16;

  bool present() const { return !method.empty(); }
};

struct ModelDescription {
  std::string name;                   // file stem or preset name, e.g. "DeepSeek-V3"
  std::string model_type;             // the config's family, e.g. "deepseek_v3", "llama4"
  int64_t hidden_size = 0;            // H, elements
  int num_layers = 0;                 // decoder layers (MTP / next-n layers excluded)
  int num_experts = 0;                // routed experts per sparse layer (shared experts excluded)
  int top_k = 0;                      // K, routed experts per token
  int64_t moe_intermediate_size = 0;  // I of one routed expert, elements
  // I of the dense MLP, elements; 0 when the config has none and no layer is
  // dense (Mixtral, gpt-oss, MiniMax: their `intermediate_size` is the expert
  // size and lands in moe_intermediate_size).
  int64_t intermediate_size = 0;
  double rms_norm_eps = 0.0;
  std::vector<bool> sparse_layers;   // [num_layers]; true = MoE layer
  SharedExpertConfig shared_expert;  // none for Mixtral, gpt-oss, MiniMax, Qwen3, Jamba
  // s of DeepSeek-V3 (2.5) and Kimi-K2 (2.827): the routed sum is scaled by
  // s. moe-ep folds s into the top-k weights the caller passes (DESIGN §7:
  // y = sum_k (s * w_k) e_k(x) + shared(x)); 1 for every other family.
  double routed_scaling_factor = 1.0;
  RouterWeightUse router_weight_use = RouterWeightUse::kScalesOutput;
  QuantizationConfig quantization;  // none for bf16 checkpoints
  // gpt-oss's clamp of its SwiGLU (`swiglu_limit`, 7.0 in the published
  // configs); 0 for every other family.
  double swiglu_limit = 0.0;

  int NumSparseLayers() const;
  // Bytes of one routed expert's weights in the checkpoint's format
  // (quant::ExpertWeightBytes): DeepSeek-V3 fp8 44,050,944; bf16 models
  // 3 * I * H * 2.
  int64_t ExpertWeightBytes() const;
  // Indices of the sparse layers, ascending.
  std::vector<int> SparseLayerIndices() const;
};

// ParseModelConfig()
//
// Reads a published Hugging Face config.json. The family is chosen by
// `model_type`; each family's sparse-layer rule is the one of its Hugging Face
// modelling code:
//   deepseek_v2, deepseek_v3, kimi_k2: layer i is sparse iff
//       i >= first_k_dense_replace (default 0) and i % moe_layer_freq (default 1) == 0;
//   qwen2_moe, qwen3_moe: sparse iff i is not in mlp_only_layers (default [])
//       and (i + 1) % decoder_sparse_step (default 1) == 0;
//   mixtral, gpt_oss, minimax_m2: every layer sparse;
//   llama4 (keys read from `text_config`), llama4_text: sparse iff i is in
//       moe_layers when given, else (i + 1) % interleave_moe_layer_step
//       (default 1) == 0. Expert size is `intermediate_size`, the dense MLP's
//       is `intermediate_size_mlp`;
//   jamba: sparse iff i % expert_layer_period (default 2) ==
//       expert_layer_offset (default 1), offset in [0, period); expert and
//       dense MLP size are both `intermediate_size`.
// Shared experts (SharedExpertConfig):
//   deepseek_v2/v3, kimi_k2: n_shared_experts (default 0, >= 0) fused into
//       one SwiGLU of n_shared_experts * moe_intermediate_size, no gate;
//       routed_scaling_factor (default 1, > 0) reported;
//   qwen2_moe: shared_expert_intermediate_size (absent or 0 = none), with
//       the sigmoid shared_expert_gate;
//   llama4: one shared expert of intermediate_size, no gate; the router's
//       score scales the expert's input (RouterWeightUse::kScalesInput);
//   qwen3_moe, mixtral, gpt_oss, jamba: none; minimax_m2:
//       shared_intermediate_size must be absent or 0.
// A shared-expert key of another family (shared_expert_intermediate_size,
// n_shared_experts, shared_intermediate_size) set to a non-zero value that
// the family would ignore or contradict is an error naming it.
// Routed experts come from n_routed_experts, num_experts or num_local_experts;
// top-k from num_experts_per_tok or experts_per_token. When several of these
// keys are present they must agree. The expert FFN size is
// moe_intermediate_size where present, else intermediate_size. rms_norm_eps
// defaults to the family's Hugging Face default (1e-6 DeepSeek/Qwen/MiniMax,
// 1e-5 Mixtral/gpt-oss/Llama-4) when absent.
// Quantization (top level, also for llama4): `quantization_config` absent or
// null = bf16; else an object whose quant_method is
//   "fp8": fmt "e4m3" or "float8_e4m3fn" (default "e4m3"), weight_block_size
//       [128, 128] (default), activation_scheme "dynamic" (default);
//   "mxfp4": no block key (32 along K by the format); gpt_oss only.
// modules_to_not_convert (default []) is a list of strings; an entry whose
// last dotted part is "experts" or an expert projection (gate_proj, up_proj,
// down_proj, w1, w2, w3, gate_up_proj) keeps the routed experts in bf16.
// swiglu_limit (gpt_oss; default 7.0, > 0) is read for gpt_oss only.
//
// Errors (kInvalidArgument, the message names the key):
//   the config is not an object; model_type missing or not a supported
//   family (the message also names the keys moe-ep would need that the
//   config lacks, e.g. the routed-expert count or a sparse-layer rule);
//   a required key (hidden_size, num_hidden_layers, experts, top-k, expert FFN
//   size) missing, of the wrong JSON type, or not positive; top-k > experts;
//   a sparse-rule key out of range (mlp_only_layers / moe_layers entry outside
//   [0, num_layers), first_k_dense_replace outside [0, num_layers],
//   moe_layer_freq / decoder_sparse_step / interleave_moe_layer_step < 1);
//   no sparse layer at all; a dense layer but no dense MLP size;
//   quantization_config not an object, quant_method missing or unknown
//   (naming 'quantization_config.quant_method' and the supported methods),
//   an fp8 fmt, weight_block_size or activation_scheme moe-ep does not
//   compute (named), modules_to_not_convert not a list of strings, mxfp4 on
//   a family other than gpt_oss.
//
// Pure and thread-safe. Source: DESIGN §9; ../shared/data/models/README.md.
// Example: DeepSeek-V3 -> H 7168, 61 layers (0..2 dense), 256 experts, top-8,
// expert I 2048, dense I 18432.
absl::StatusOr<ModelDescription> ParseModelConfig(const nlohmann::json& config, std::string name);

// Reads and parses the file at `path`; the name is the file's stem
// ("DeepSeek-V3.json" -> "DeepSeek-V3").
// Errors: kNotFound (no such file), kInvalidArgument (unreadable, not JSON —
// with the parser's position — or any ParseModelConfig error), each naming
// the path.
absl::StatusOr<ModelDescription> LoadModelConfig(const std::string& path);

// Built-in presets written from published configs, for runs without a
// config file: "deepseek-v3", "gpt-oss-20b", "mixtral-8x7b", "qwen3-30b-a3b",
// plus "tiny-moe" (synthetic: H 128, 4 layers with layer 0 dense, 8 experts,
// top-2, expert I 256) for CPU demos and CI.
// Errors: kNotFound naming the name and the known presets.
absl::StatusOr<ModelDescription> BuiltinModel(const std::string& name);
// The preset names, sorted.
std::vector<std::string> BuiltinModelNames();

}  // namespace moe_ep::core
