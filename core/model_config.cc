#include "core/model_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <optional>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/quantized_weights.h"
#include "core/status_macros.h"

namespace moe_ep::core {

int ModelDescription::NumSparseLayers() const {
  return static_cast<int>(std::count(sparse_layers.begin(), sparse_layers.end(), true));
}

int64_t ModelDescription::ExpertWeightBytes() const {
  return quant::ExpertWeightBytes(quantization.expert_format, hidden_size, moe_intermediate_size);
}

std::vector<int> ModelDescription::SparseLayerIndices() const {
  std::vector<int> indices;
  for (size_t i = 0; i < sparse_layers.size(); ++i) {
    if (sparse_layers[i]) indices.push_back(static_cast<int>(i));
  }
  return indices;
}

namespace {

using nlohmann::json;

enum class Family { kDeepSeek, kQwenMoe, kAllSparse, kLlama4, kJamba };

struct FamilyInfo {
  Family family;
  double default_rms_norm_eps;  // the Hugging Face config class default
};

const std::map<std::string, FamilyInfo>& Families() {
  static const auto* families = new std::map<std::string, FamilyInfo>{
      {"deepseek_v2", {Family::kDeepSeek, 1e-6}}, {"deepseek_v3", {Family::kDeepSeek, 1e-6}},
      {"kimi_k2", {Family::kDeepSeek, 1e-6}},     {"qwen2_moe", {Family::kQwenMoe, 1e-6}},
      {"qwen3_moe", {Family::kQwenMoe, 1e-6}},    {"mixtral", {Family::kAllSparse, 1e-5}},
      {"gpt_oss", {Family::kAllSparse, 1e-5}},    {"minimax_m2", {Family::kAllSparse, 1e-6}},
      {"llama4", {Family::kLlama4, 1e-5}},        {"llama4_text", {Family::kLlama4, 1e-5}},
      {"jamba", {Family::kJamba, 1e-6}},
  };
  return *families;
}

std::string SupportedFamilies() {
  std::vector<std::string> names;
  for (const auto& [name, info] : Families()) names.push_back(name);
  return absl::StrJoin(names, ", ");
}

// Key lookups. `where` prefixes key names in messages ("text_config.").
class ConfigReader {
 public:
  ConfigReader(const json& object, std::string where) : object_(object), where_(std::move(where)) {}

  bool Has(const std::string& key) const {
    return object_.contains(key) && !object_.at(key).is_null();
  }

  std::string Key(const std::string& key) const { return where_ + key; }

  // An integer in [min, max]; absent (or null) -> nullopt.
  absl::StatusOr<std::optional<int64_t>> OptionalInt(const std::string& key, int64_t min,
                                                     int64_t max) const {
    if (!Has(key)) return std::optional<int64_t>();
    const json& value = object_.at(key);
    if (!value.is_number_integer()) {
      return absl::InvalidArgumentError(absl::StrCat("model config key '", Key(key),
                                                     "' must be an integer, got ",
                                                     value.type_name(), " ", value.dump()));
    }
    int64_t v = 0;
    if (value.is_number_unsigned()) {
      uint64_t u = value.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
        return absl::InvalidArgumentError(
            absl::StrCat("model config key '", Key(key), "' is out of range: ", value.dump()));
      }
      v = static_cast<int64_t>(u);
    } else {
      v = value.get<int64_t>();
    }
    if (v < min || v > max) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model config key '", Key(key), "' must be in [", min, ", ", max, "], got ", v));
    }
    return std::optional<int64_t>(v);
  }

  absl::StatusOr<int64_t> RequiredInt(const std::string& key, int64_t min, int64_t max) const {
    ASSIGN_OR_RETURN(std::optional<int64_t> v, OptionalInt(key, min, max));
    if (!v.has_value()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model config is missing required key '", Key(key), "'"));
    }
    return *v;
  }

  absl::StatusOr<int64_t> IntOr(const std::string& key, int64_t fallback, int64_t min,
                                int64_t max) const {
    ASSIGN_OR_RETURN(std::optional<int64_t> v, OptionalInt(key, min, max));
    return v.value_or(fallback);
  }

  // The first present key of `keys`; all present ones must agree.
  absl::StatusOr<int64_t> OneOfInt(const std::vector<std::string>& keys, int64_t min,
                                   int64_t max) const {
    std::optional<int64_t> found;
    std::string found_key;
    for (const std::string& key : keys) {
      ASSIGN_OR_RETURN(std::optional<int64_t> v, OptionalInt(key, min, max));
      if (!v.has_value()) continue;
      if (found.has_value() && *found != *v) {
        return absl::InvalidArgumentError(absl::StrCat("model config keys '", Key(found_key), "' (",
                                                       *found, ") and '", Key(key), "' (", *v,
                                                       ") disagree"));
      }
      if (!found.has_value()) {
        found = v;
        found_key = key;
      }
    }
    if (!found.has_value()) {
      std::vector<std::string> names;
      names.reserve(keys.size());
      for (const std::string& key : keys) names.push_back("'" + Key(key) + "'");
      return absl::InvalidArgumentError(absl::StrCat(
          "model config is missing required key: one of ", absl::StrJoin(names, ", ")));
    }
    return *found;
  }

  // A list of layer indices, each in [0, num_layers); absent -> empty.
  absl::StatusOr<std::vector<int>> LayerList(const std::string& key, int num_layers) const {
    std::vector<int> layers;
    if (!Has(key)) return layers;
    const json& value = object_.at(key);
    if (!value.is_array()) {
      return absl::InvalidArgumentError(absl::StrCat("model config key '", Key(key),
                                                     "' must be a list of layer indices, got ",
                                                     value.type_name()));
    }
    for (size_t i = 0; i < value.size(); ++i) {
      const json& entry = value[i];
      if (!entry.is_number_integer() || entry.get<int64_t>() < 0 ||
          entry.get<int64_t>() >= num_layers) {
        return absl::InvalidArgumentError(absl::StrCat("model config key '", Key(key), "' entry ",
                                                       i, " must be a layer index in [0, ",
                                                       num_layers, "), got ", entry.dump()));
      }
      layers.push_back(static_cast<int>(entry.get<int64_t>()));
    }
    return layers;
  }

  absl::StatusOr<double> DoubleOr(const std::string& key, double fallback) const {
    if (!Has(key)) return fallback;
    const json& value = object_.at(key);
    if (!value.is_number()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model config key '", Key(key), "' must be a number, got ", value.type_name()));
    }
    double v = value.get<double>();
    if (!(v > 0.0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("model config key '", Key(key), "' must be positive, got ", v));
    }
    return v;
  }

 private:
  const json& object_;
  std::string where_;
};

constexpr int64_t kIntMax = std::numeric_limits<int>::max();

// For a config of an unknown family: the keys moe-ep would need that it
// lacks, so the message says what is missing rather than only the type.
std::string UnreadableFamilyHint(const json& config) {
  const auto has_any = [&](const std::vector<std::string>& keys) {
    return std::any_of(keys.begin(), keys.end(), [&](const std::string& k) {
      return config.contains(k) && !config.at(k).is_null();
    });
  };
  const auto quoted = [](const std::vector<std::string>& keys) {
    std::vector<std::string> q;
    q.reserve(keys.size());
    for (const std::string& k : keys) q.push_back("'" + k + "'");
    return absl::StrJoin(q, " or ");
  };
  const std::vector<std::vector<std::string>> needed = {
      {"hidden_size"},
      {"num_hidden_layers"},
      {"n_routed_experts", "num_experts", "num_local_experts"},
      {"num_experts_per_tok", "experts_per_token"},
      {"moe_intermediate_size", "intermediate_size"}};
  std::vector<std::string> missing;
  for (const auto& keys : needed) {
    if (!has_any(keys)) missing.push_back(quoted(keys));
  }
  const std::string rule =
      "a sparse-layer rule it knows ('first_k_dense_replace'/'moe_layer_freq', "
      "'decoder_sparse_step'/'mlp_only_layers', 'interleave_moe_layer_step'/'moe_layers', "
      "'expert_layer_period'/'expert_layer_offset')";
  if (missing.empty()) {
    return absl::StrCat("its keys look readable but moe-ep needs ", rule,
                        " and the family's shared-expert keys to be known for this model_type");
  }
  return absl::StrCat("moe-ep would need top-level key(s) ", absl::StrJoin(missing, ", "),
                      " (missing here) and ", rule);
}
constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// A shared-expert key this family does not read must be absent, null or 0:
// a non-zero value means the config describes something moe-ep would drop.
absl::Status RequireUnsetForFamily(const ConfigReader& r, const std::string& key,
                                   const std::string& model_type) {
  ASSIGN_OR_RETURN(std::optional<int64_t> v, r.OptionalInt(key, 0, kInt64Max));
  if (v.has_value() && *v != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config key '", r.Key(key), "' is ", *v, ", but ", model_type,
                     " has no shared expert of that kind; a ", model_type,
                     " config with it is inconsistent (remove the key or fix model_type)"));
  }
  return absl::OkStatus();
}

// Shared experts, routed scaling and the router-weight use (see the header).
absl::Status ParseSharedExperts(const ConfigReader& r, Family family, const std::string& model_type,
                                ModelDescription* model) {
  SharedExpertConfig& shared = model->shared_expert;
  switch (family) {
    case Family::kDeepSeek: {
      ASSIGN_OR_RETURN(int64_t n, r.IntOr("n_shared_experts", 0, 0, kIntMax));
      if (n > 0) {
        shared.count = static_cast<int>(n);
        shared.intermediate_size = n * model->moe_intermediate_size;
        shared.source_key = r.Key("n_shared_experts");
      }
      ASSIGN_OR_RETURN(model->routed_scaling_factor, r.DoubleOr("routed_scaling_factor", 1.0));
      RETURN_IF_ERROR(RequireUnsetForFamily(r, "shared_expert_intermediate_size", model_type));
      break;
    }
    case Family::kQwenMoe: {
      if (model_type == "qwen2_moe") {
        // Absent = none (published qwen2_moe configs always set it).
        ASSIGN_OR_RETURN(int64_t size, r.IntOr("shared_expert_intermediate_size", 0, 0, kInt64Max));
        if (size > 0) {
          shared.count = 1;
          shared.intermediate_size = size;
          shared.sigmoid_gate = true;
          shared.source_key = r.Key("shared_expert_intermediate_size");
        }
      } else {
        RETURN_IF_ERROR(RequireUnsetForFamily(r, "shared_expert_intermediate_size", model_type));
      }
      RETURN_IF_ERROR(RequireUnsetForFamily(r, "n_shared_experts", model_type));
      break;
    }
    case Family::kLlama4:
      // Llama4TextMoe: one shared SwiGLU of the routed expert's size in every
      // MoE layer; the sigmoid router score multiplies the expert's input.
      shared.count = 1;
      shared.intermediate_size = model->moe_intermediate_size;
      shared.source_key = r.Key("intermediate_size");
      model->router_weight_use = RouterWeightUse::kScalesInput;
      RETURN_IF_ERROR(RequireUnsetForFamily(r, "n_shared_experts", model_type));
      break;
    case Family::kAllSparse:
    case Family::kJamba:
      RETURN_IF_ERROR(RequireUnsetForFamily(r, "n_shared_experts", model_type));
      RETURN_IF_ERROR(RequireUnsetForFamily(r, "shared_expert_intermediate_size", model_type));
      RETURN_IF_ERROR(RequireUnsetForFamily(r, "shared_intermediate_size", model_type));
      break;
  }
  if (family != Family::kDeepSeek && r.Has("routed_scaling_factor")) {
    ASSIGN_OR_RETURN(double s, r.DoubleOr("routed_scaling_factor", 1.0));
    if (s != 1.0) {
      return absl::InvalidArgumentError(
          absl::StrCat("model config key '", r.Key("routed_scaling_factor"), "' is ", s, ", but ",
                       model_type, " does not scale its routed experts"));
    }
  }
  return absl::OkStatus();
}

// Whether a modules_to_not_convert entry names the routed experts (its last
// dotted part, wildcards aside, is "experts" or an expert projection).
bool NamesRoutedExperts(const std::string& pattern) {
  std::string last =
      pattern.substr(pattern.rfind('.') == std::string::npos ? 0 : pattern.rfind('.') + 1);
  last.erase(std::remove(last.begin(), last.end(), '*'), last.end());
  static const char* const kExpertParts[] = {"experts", "gate_proj", "up_proj", "down_proj",
                                             "w1",      "w2",        "w3",      "gate_up_proj"};
  return std::any_of(std::begin(kExpertParts), std::end(kExpertParts),
                     [&](const char* part) { return last == part; });
}

// quantization_config (see the header).
absl::Status ParseQuantization(const json& config, const std::string& model_type,
                               ModelDescription* model) {
  constexpr char kKey[] = "quantization_config";
  if (!config.contains(kKey) || config.at(kKey).is_null()) return absl::OkStatus();
  const json& q = config.at(kKey);
  if (!q.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config key '", kKey, "' must be an object, got ", q.type_name()));
  }
  const auto key = [&](const std::string& k) { return absl::StrCat(kKey, ".", k); };
  if (!q.contains("quant_method") || !q.at("quant_method").is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config key '", key("quant_method"),
                     "' is missing or not a string; supported: fp8, mxfp4"));
  }
  QuantizationConfig& out = model->quantization;
  out.method = q.at("quant_method").get<std::string>();
  const auto optional_string = [&](const std::string& k,
                                   const std::string& fallback) -> absl::StatusOr<std::string> {
    if (!q.contains(k) || q.at(k).is_null()) return fallback;
    if (!q.at(k).is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "model config key '", key(k), "' must be a string, got ", q.at(k).type_name()));
    }
    return q.at(k).get<std::string>();
  };
  if (q.contains("modules_to_not_convert") && !q.at("modules_to_not_convert").is_null()) {
    const json& list = q.at("modules_to_not_convert");
    if (!list.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model config key '", key("modules_to_not_convert"),
                       "' must be a list of strings, got ", list.type_name()));
    }
    for (size_t i = 0; i < list.size(); ++i) {
      if (!list[i].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat("model config key '", key("modules_to_not_convert"), "' entry ", i,
                         " must be a string, got ", list[i].type_name()));
      }
      out.modules_to_not_convert.push_back(list[i].get<std::string>());
    }
  }
  if (out.method == "fp8") {
    ASSIGN_OR_RETURN(out.fmt, optional_string("fmt", "e4m3"));
    if (out.fmt != "e4m3" && out.fmt != "float8_e4m3fn") {
      return absl::InvalidArgumentError(
          absl::StrCat("model config key '", key("fmt"), "' is '", out.fmt,
                       "'; moe-ep computes fp8 experts in e4m3 only ('e4m3' or 'float8_e4m3fn')"));
    }
    ASSIGN_OR_RETURN(out.activation_scheme, optional_string("activation_scheme", "dynamic"));
    if (out.activation_scheme != "dynamic") {
      return absl::InvalidArgumentError(absl::StrCat(
          "model config key '", key("activation_scheme"), "' is '", out.activation_scheme,
          "'; moe-ep quantizes activations dynamically (per token per 128 channels) only"));
    }
    out.weight_block_size = {quant::kFp8Block, quant::kFp8Block};
    if (q.contains("weight_block_size") && !q.at("weight_block_size").is_null()) {
      const json& b = q.at("weight_block_size");
      if (b != json::array({quant::kFp8Block, quant::kFp8Block})) {
        return absl::InvalidArgumentError(
            absl::StrCat("model config key '", key("weight_block_size"), "' is ", b.dump(),
                         "; moe-ep computes fp8 experts with [128, 128] scale blocks only"));
      }
    }
    out.expert_format = quant::ExpertWeightFormat::kFp8Block128;
  } else if (out.method == "mxfp4") {
    if (model_type != "gpt_oss") {
      return absl::InvalidArgumentError(absl::StrCat(
          "model config key '", key("quant_method"), "' is 'mxfp4' on model_type '", model_type,
          "'; moe-ep reads mxfp4 experts in gpt-oss's layout only (model_type gpt_oss)"));
    }
    out.weight_block_size = {1, quant::kMxfp4Block};
    out.expert_format = quant::ExpertWeightFormat::kMxfp4;
  } else {
    return absl::InvalidArgumentError(absl::StrCat(
        "model config key '", key("quant_method"), "' is '", out.method,
        "', not a quantization moe-ep computes (supported: fp8 with 128 x 128 e4m3 blocks, "
        "mxfp4; or no quantization_config for bf16)"));
  }
  if (std::any_of(out.modules_to_not_convert.begin(), out.modules_to_not_convert.end(),
                  NamesRoutedExperts)) {
    out.expert_format = quant::ExpertWeightFormat::kBf16;
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelDescription> ParseChecked(const json& config, std::string name) {
  if (!config.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config must be a JSON object, got ", config.type_name()));
  }
  if (!config.contains("model_type") || !config.at("model_type").is_string()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config key 'model_type' is missing or not a string; supported: ",
                     SupportedFamilies()));
  }
  const std::string model_type = config.at("model_type").get<std::string>();
  auto family_it = Families().find(model_type);
  if (family_it == Families().end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config key 'model_type' is '", model_type,
                     "', not a supported MoE family (supported: ", SupportedFamilies(), "); ",
                     UnreadableFamilyHint(config)));
  }
  const FamilyInfo info = family_it->second;

  // Llama-4 multimodal configs keep the language model under text_config.
  const json* text = &config;
  std::string where;
  if (model_type == "llama4") {
    if (!config.contains("text_config") || !config.at("text_config").is_object()) {
      return absl::InvalidArgumentError(
          "model config key 'text_config' is missing or not an object (required for llama4)");
    }
    text = &config.at("text_config");
    where = "text_config.";
  }
  const ConfigReader r(*text, where);

  ModelDescription model;
  model.name = std::move(name);
  model.model_type = model_type;
  ASSIGN_OR_RETURN(model.hidden_size, r.RequiredInt("hidden_size", 1, kInt64Max));
  ASSIGN_OR_RETURN(int64_t num_layers, r.RequiredInt("num_hidden_layers", 1, kIntMax));
  model.num_layers = static_cast<int>(num_layers);
  ASSIGN_OR_RETURN(
      int64_t num_experts,
      r.OneOfInt({"n_routed_experts", "num_experts", "num_local_experts"}, 1, kIntMax));
  model.num_experts = static_cast<int>(num_experts);
  ASSIGN_OR_RETURN(int64_t top_k,
                   r.OneOfInt({"num_experts_per_tok", "experts_per_token"}, 1, kIntMax));
  model.top_k = static_cast<int>(top_k);
  if (model.top_k > model.num_experts) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config top-k (", r.Key("num_experts_per_tok"), ") ", model.top_k,
                     " exceeds the number of routed experts ", model.num_experts));
  }
  ASSIGN_OR_RETURN(model.rms_norm_eps, r.DoubleOr("rms_norm_eps", info.default_rms_norm_eps));

  // Expert and dense FFN sizes.
  if (info.family == Family::kLlama4) {
    ASSIGN_OR_RETURN(model.moe_intermediate_size, r.RequiredInt("intermediate_size", 1, kInt64Max));
    ASSIGN_OR_RETURN(model.intermediate_size, r.IntOr("intermediate_size_mlp", 0, 1, kInt64Max));
  } else if (info.family == Family::kJamba) {
    // Jamba's dense and expert MLPs are both intermediate_size wide.
    ASSIGN_OR_RETURN(model.moe_intermediate_size, r.RequiredInt("intermediate_size", 1, kInt64Max));
    model.intermediate_size = model.moe_intermediate_size;
  } else if (r.Has("moe_intermediate_size")) {
    ASSIGN_OR_RETURN(model.moe_intermediate_size,
                     r.RequiredInt("moe_intermediate_size", 1, kInt64Max));
    ASSIGN_OR_RETURN(model.intermediate_size, r.IntOr("intermediate_size", 0, 1, kInt64Max));
  } else {
    // Mixtral, gpt-oss, MiniMax: intermediate_size is the expert's; no dense MLP.
    ASSIGN_OR_RETURN(model.moe_intermediate_size, r.RequiredInt("intermediate_size", 1, kInt64Max));
  }

  // Sparse pattern.
  const int L = model.num_layers;
  model.sparse_layers.assign(L, false);
  std::string rule_keys;
  switch (info.family) {
    case Family::kDeepSeek: {
      ASSIGN_OR_RETURN(int64_t first_dense, r.IntOr("first_k_dense_replace", 0, 0, L));
      ASSIGN_OR_RETURN(int64_t freq, r.IntOr("moe_layer_freq", 1, 1, kIntMax));
      for (int i = 0; i < L; ++i) model.sparse_layers[i] = i >= first_dense && i % freq == 0;
      rule_keys = "'" + r.Key("first_k_dense_replace") + "', '" + r.Key("moe_layer_freq") + "'";
      break;
    }
    case Family::kQwenMoe: {
      ASSIGN_OR_RETURN(int64_t step, r.IntOr("decoder_sparse_step", 1, 1, kIntMax));
      ASSIGN_OR_RETURN(std::vector<int> mlp_only, r.LayerList("mlp_only_layers", L));
      for (int i = 0; i < L; ++i) model.sparse_layers[i] = (i + 1) % step == 0;
      for (int i : mlp_only) model.sparse_layers[i] = false;
      rule_keys = "'" + r.Key("decoder_sparse_step") + "', '" + r.Key("mlp_only_layers") + "'";
      break;
    }
    case Family::kAllSparse:
      model.sparse_layers.assign(L, true);
      break;
    case Family::kJamba: {
      ASSIGN_OR_RETURN(int64_t period, r.IntOr("expert_layer_period", 2, 1, kIntMax));
      ASSIGN_OR_RETURN(int64_t offset, r.IntOr("expert_layer_offset", 1, 0, period - 1));
      for (int i = 0; i < L; ++i) model.sparse_layers[i] = i % period == offset;
      rule_keys = "'" + r.Key("expert_layer_period") + "', '" + r.Key("expert_layer_offset") + "'";
      break;
    }
    case Family::kLlama4: {
      if (r.Has("moe_layers")) {
        ASSIGN_OR_RETURN(std::vector<int> moe_layers, r.LayerList("moe_layers", L));
        for (int i : moe_layers) model.sparse_layers[i] = true;
        rule_keys = "'" + r.Key("moe_layers") + "'";
      } else {
        ASSIGN_OR_RETURN(int64_t step, r.IntOr("interleave_moe_layer_step", 1, 1, kIntMax));
        for (int i = 0; i < L; ++i) model.sparse_layers[i] = (i + 1) % step == 0;
        rule_keys = "'" + r.Key("interleave_moe_layer_step") + "'";
      }
      break;
    }
  }
  const int num_sparse = model.NumSparseLayers();
  if (num_sparse == 0) {
    return absl::InvalidArgumentError(absl::StrCat("model config has no sparse (MoE) layer among ",
                                                   L, " layers; check ", rule_keys));
  }
  if (num_sparse < L && model.intermediate_size == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "model config has ", L - num_sparse, " dense layers but no dense MLP size '",
        r.Key(info.family == Family::kLlama4 ? "intermediate_size_mlp" : "intermediate_size"),
        "'"));
  }
  RETURN_IF_ERROR(ParseSharedExperts(r, info.family, model_type, &model));
  RETURN_IF_ERROR(ParseQuantization(config, model_type, &model));
  if (model_type == "gpt_oss") {
    ASSIGN_OR_RETURN(model.swiglu_limit,
                     r.DoubleOr("swiglu_limit", static_cast<double>(quant::kGptOssSwiGluLimit)));
  }
  return model;
}

}  // namespace

const char* RouterWeightUseName(RouterWeightUse use) {
  return use == RouterWeightUse::kScalesInput ? "input" : "output";
}

absl::StatusOr<ModelDescription> ParseModelConfig(const nlohmann::json& config, std::string name) {
  try {
    return ParseChecked(config, std::move(name));
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("model config is malformed: ", e.what()));
  }
}

absl::StatusOr<ModelDescription> LoadModelConfig(const std::string& path) {
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) {
    return absl::NotFoundError(absl::StrCat("model config file '", path, "' does not exist"));
  }
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(absl::StrCat("cannot open model config file '", path, "'"));
  }
  nlohmann::json config;
  try {
    config = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(
        absl::StrCat("model config file '", path, "' is not valid JSON: ", e.what()));
  }
  absl::StatusOr<ModelDescription> model =
      ParseModelConfig(config, std::filesystem::path(path).stem().string());
  if (!model.ok()) {
    return absl::Status(model.status().code(), absl::StrCat(path, ": ", model.status().message()));
  }
  return model;
}

namespace {

ModelDescription Preset(std::string name, std::string model_type, int64_t hidden, int layers,
                        int experts, int top_k, int64_t moe_intermediate, int64_t intermediate,
                        double eps, int first_dense_layers) {
  ModelDescription m;
  m.name = std::move(name);
  m.model_type = std::move(model_type);
  m.hidden_size = hidden;
  m.num_layers = layers;
  m.num_experts = experts;
  m.top_k = top_k;
  m.moe_intermediate_size = moe_intermediate;
  m.intermediate_size = intermediate;
  m.rms_norm_eps = eps;
  m.sparse_layers.assign(layers, true);
  for (int i = 0; i < first_dense_layers && i < layers; ++i) m.sparse_layers[i] = false;
  return m;
}

ModelDescription WithShared(ModelDescription m, int count, int64_t intermediate, bool gate,
                            double routed_scaling) {
  m.shared_expert.count = count;
  m.shared_expert.intermediate_size = intermediate;
  m.shared_expert.sigmoid_gate = gate;
  m.shared_expert.source_key = "n_shared_experts";
  m.routed_scaling_factor = routed_scaling;
  return m;
}

const std::map<std::string, ModelDescription>& Presets() {
  // Values from the published config.json of each model (Hugging Face).
  static const auto* presets = new std::map<std::string, ModelDescription>{
      {"qwen3-30b-a3b", Preset("qwen3-30b-a3b", "qwen3_moe", 2048, 48, 128, 8, 768, 6144, 1e-6, 0)},
      {"deepseek-v3",
       WithShared(Preset("deepseek-v3", "deepseek_v3", 7168, 61, 256, 8, 2048, 18432, 1e-6, 3), 1,
                  2048, false, 2.5)},
      {"mixtral-8x7b", Preset("mixtral-8x7b", "mixtral", 4096, 32, 8, 2, 14336, 0, 1e-5, 0)},
      {"gpt-oss-20b", Preset("gpt-oss-20b", "gpt_oss", 2880, 24, 32, 4, 2880, 0, 1e-5, 0)},
      // Synthetic, small enough for CPU demos and CI; layer 0 dense so plans
      // exercise both layer kinds.
      {"tiny-moe", Preset("tiny-moe", "deepseek_v3", 128, 4, 8, 2, 256, 512, 1e-6, 1)},
  };
  return *presets;
}

}  // namespace

absl::StatusOr<ModelDescription> BuiltinModel(const std::string& name) {
  auto it = Presets().find(name);
  if (it == Presets().end()) {
    return absl::NotFoundError(absl::StrCat(
        "no built-in model '", name, "'; known: ", absl::StrJoin(BuiltinModelNames(), ", ")));
  }
  return it->second;
}

std::vector<std::string> BuiltinModelNames() {
  std::vector<std::string> names;
  for (const auto& [name, model] : Presets()) names.push_back(name);
  return names;
}

}  // namespace moe_ep::core
