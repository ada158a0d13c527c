// Shared experts, routed scaling and Jamba-style sparsity in model configs
// (issue 18; DESIGN §7, §9). Values checked against the published files in
// ../shared/data/models.

#include <cstdlib>
#include <filesystem>
#include <string>

#include "core/model_config.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace shared_expert_config_test {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string ModelsDir() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  std::string data = (env != nullptr && *env != '\0') ? env : MOE_EP_DATA_DIR;
  return data + "/models";
}

struct Expected {
  std::string file;
  int count;
  int64_t intermediate;
  bool gate;
  double scaling;
  RouterWeightUse use;
};

// Every family in the data folder, with its shared expert as published.
TEST(SharedExpertConfig, EveryFileInDataFolder) {
  if (!std::filesystem::is_directory(ModelsDir())) {
    GTEST_SKIP() << "model configs not found at " << ModelsDir();
  }
  constexpr auto kOut = RouterWeightUse::kScalesOutput;
  const std::vector<Expected> expected = {
      {"DeepSeek-V3.json", 1, 2048, false, 2.5, kOut},
      {"DeepSeek-R1.json", 1, 2048, false, 2.5, kOut},
      // 2 shared experts of 1408 fuse into one SwiGLU of 2816.
      {"DeepSeek-V2-Lite.json", 2, 2816, false, 1.0, kOut},
      {"Kimi-K2-Instruct.json", 1, 2048, false, 2.827, kOut},
      {"Qwen1.5-MoE-A2.7B.partial.json", 1, 5632, true, 1.0, kOut},
      {"Llama-4-Scout-17B-16E-Instruct.json", 1, 8192, false, 1.0, RouterWeightUse::kScalesInput},
      {"Qwen3-30B-A3B.json", 0, 0, false, 1.0, kOut},
      {"Qwen3-235B-A22B.json", 0, 0, false, 1.0, kOut},
      {"Mixtral-8x7B-v0.1.json", 0, 0, false, 1.0, kOut},
      {"Mixtral-8x22B-v0.1.json", 0, 0, false, 1.0, kOut},
      {"gpt-oss-20b.json", 0, 0, false, 1.0, kOut},
      {"gpt-oss-120b.json", 0, 0, false, 1.0, kOut},
      {"MiniMax-M2.5.json", 0, 0, false, 1.0, kOut},
  };
  int files = 0;
  for (const auto& entry : std::filesystem::directory_iterator(ModelsDir())) {
    if (entry.path().extension() == ".json") ++files;
  }
  EXPECT_EQ(files, static_cast<int>(expected.size())) << "a config without an expectation here";
  for (const Expected& e : expected) {
    absl::StatusOr<ModelDescription> m = LoadModelConfig(ModelsDir() + "/" + e.file);
    ASSERT_TRUE(m.ok()) << m.status();
    EXPECT_EQ(m->shared_expert.count, e.count) << e.file;
    EXPECT_EQ(m->shared_expert.intermediate_size, e.intermediate) << e.file;
    EXPECT_EQ(m->shared_expert.present(), e.intermediate > 0) << e.file;
    EXPECT_EQ(m->shared_expert.sigmoid_gate, e.gate) << e.file;
    EXPECT_DOUBLE_EQ(m->routed_scaling_factor, e.scaling) << e.file;
    EXPECT_EQ(m->router_weight_use, e.use) << e.file;
  }
}

TEST(SharedExpertConfig, SourceKeys) {
  if (!std::filesystem::is_directory(ModelsDir())) GTEST_SKIP() << "no data folder";
  absl::StatusOr<ModelDescription> v3 = LoadModelConfig(ModelsDir() + "/DeepSeek-V3.json");
  absl::StatusOr<ModelDescription> qwen =
      LoadModelConfig(ModelsDir() + "/Qwen1.5-MoE-A2.7B.partial.json");
  absl::StatusOr<ModelDescription> llama =
      LoadModelConfig(ModelsDir() + "/Llama-4-Scout-17B-16E-Instruct.json");
  ASSERT_TRUE(v3.ok() && qwen.ok() && llama.ok());
  EXPECT_EQ(v3->shared_expert.source_key, "n_shared_experts");
  EXPECT_EQ(qwen->shared_expert.source_key, "shared_expert_intermediate_size");
  EXPECT_EQ(llama->shared_expert.source_key, "text_config.intermediate_size");
}

TEST(SharedExpertConfig, DeepSeekV3PresetMatchesFile) {
  absl::StatusOr<ModelDescription> preset = BuiltinModel("deepseek-v3");
  ASSERT_TRUE(preset.ok());
  EXPECT_EQ(preset->shared_expert.intermediate_size, 2048);
  EXPECT_DOUBLE_EQ(preset->routed_scaling_factor, 2.5);
}

nlohmann::json Jamba(int layers, int period, int offset) {
  nlohmann::json c = {{"model_type", "jamba"},         {"hidden_size", 64},
                      {"num_hidden_layers", layers},   {"num_experts", 16},
                      {"num_experts_per_tok", 2},      {"intermediate_size", 96},
                      {"expert_layer_period", period}, {"expert_layer_offset", offset}};
  return c;
}

// The fixture of issue 18: 32 layers, period 2, offset 1 -> 1, 3, ..., 31.
TEST(SharedExpertConfig, JambaPeriodTwoOffsetOne) {
  absl::StatusOr<ModelDescription> m = ParseModelConfig(Jamba(32, 2, 1), "jamba-fixture");
  ASSERT_TRUE(m.ok()) << m.status();
  std::vector<int> odd;
  for (int i = 1; i < 32; i += 2) odd.push_back(i);
  EXPECT_EQ(m->SparseLayerIndices(), odd);
  EXPECT_EQ(m->NumSparseLayers(), 16);
  EXPECT_EQ(m->moe_intermediate_size, 96);
  EXPECT_EQ(m->intermediate_size, 96);  // the dense layers' MLP
  EXPECT_FALSE(m->shared_expert.present());
}

TEST(SharedExpertConfig, JambaOtherPeriodsAndDefaults) {
  absl::StatusOr<ModelDescription> m = ParseModelConfig(Jamba(8, 4, 2), "t");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(m->SparseLayerIndices(), ElementsAre(2, 6));
  nlohmann::json defaults = Jamba(6, 2, 1);
  defaults.erase("expert_layer_period");
  defaults.erase("expert_layer_offset");
  m = ParseModelConfig(defaults, "t");  // Hugging Face defaults: period 2, offset 1
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_THAT(m->SparseLayerIndices(), ElementsAre(1, 3, 5));
}

void ExpectInvalid(const nlohmann::json& config, const std::vector<std::string>& fragments) {
  absl::StatusOr<ModelDescription> m = ParseModelConfig(config, "t");
  ASSERT_FALSE(m.ok()) << config.dump();
  EXPECT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  for (const std::string& f : fragments) EXPECT_THAT(m.status().message(), HasSubstr(f));
}

TEST(SharedExpertConfig, JambaOffsetOutOfRangeNamesKey) {
  ExpectInvalid(Jamba(8, 2, 2), {"'expert_layer_offset'", "[0, 1]"});
  ExpectInvalid(Jamba(8, 0, 0), {"'expert_layer_period'"});
}

nlohmann::json DeepSeek() {
  return nlohmann::json::parse(R"({
    "model_type": "deepseek_v3", "hidden_size": 64, "num_hidden_layers": 4,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
    "intermediate_size": 128, "first_k_dense_replace": 1, "n_shared_experts": 3,
    "routed_scaling_factor": 2.0})");
}

TEST(SharedExpertConfig, DeepSeekFusesSharedExperts) {
  absl::StatusOr<ModelDescription> m = ParseModelConfig(DeepSeek(), "t");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->shared_expert.count, 3);
  EXPECT_EQ(m->shared_expert.intermediate_size, 96);  // 3 * 32
  nlohmann::json none = DeepSeek();
  none["n_shared_experts"] = nullptr;  // DeepSeek-V2 style null
  m = ParseModelConfig(none, "t");
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_FALSE(m->shared_expert.present());
}

TEST(SharedExpertConfig, InconsistentValuesNameTheKey) {
  nlohmann::json c = DeepSeek();
  c["n_shared_experts"] = -1;
  ExpectInvalid(c, {"'n_shared_experts'"});
  c = DeepSeek();
  c["n_shared_experts"] = "one";
  ExpectInvalid(c, {"'n_shared_experts'", "integer"});
  c = DeepSeek();
  c["routed_scaling_factor"] = 0;
  ExpectInvalid(c, {"'routed_scaling_factor'", "positive"});
  c = DeepSeek();
  c["shared_expert_intermediate_size"] = 64;  // a Qwen key in a DeepSeek config
  ExpectInvalid(c, {"'shared_expert_intermediate_size'", "deepseek_v3"});

  nlohmann::json qwen = nlohmann::json::parse(R"({
    "model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "intermediate_size": 128,
    "shared_expert_intermediate_size": 256})");
  ASSERT_TRUE(ParseModelConfig(qwen, "t").ok());
  nlohmann::json q = qwen;
  q["shared_expert_intermediate_size"] = -5;
  ExpectInvalid(q, {"'shared_expert_intermediate_size'"});
  q = qwen;
  q["n_shared_experts"] = 2;
  ExpectInvalid(q, {"'n_shared_experts'", "qwen2_moe"});
  q = qwen;
  q["model_type"] = "qwen3_moe";  // Qwen3-MoE has no shared expert
  ExpectInvalid(q, {"'shared_expert_intermediate_size'", "qwen3_moe"});
  q = qwen;
  q["routed_scaling_factor"] = 2.5;
  ExpectInvalid(q, {"'routed_scaling_factor'", "qwen2_moe"});

  nlohmann::json minimax = nlohmann::json::parse(R"({
    "model_type": "minimax_m2", "hidden_size": 64, "num_hidden_layers": 2,
    "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32,
    "shared_intermediate_size": 128})");
  ExpectInvalid(minimax, {"'shared_intermediate_size'", "minimax_m2"});
}

TEST(SharedExpertConfig, UnreadableFamilyNamesTheKeysItWouldNeed) {
  // DBRX keeps its experts under ffn_config: moe-ep would need the top-level keys.
  nlohmann::json dbrx = nlohmann::json::parse(R"({
    "model_type": "dbrx", "d_model": 6144, "n_layers": 40,
    "ffn_config": {"moe_num_experts": 16, "moe_top_k": 4, "ffn_hidden_size": 10752}})");
  ExpectInvalid(dbrx,
                {"'dbrx'", "'hidden_size'", "'num_hidden_layers'", "'n_routed_experts'",
                 "'num_experts_per_tok'", "'moe_intermediate_size'", "'expert_layer_period'"});
  // Readable keys but an unknown family: the rule and shared keys are named.
  nlohmann::json other = DeepSeek();
  other["model_type"] = "olmoe";
  ExpectInvalid(other, {"'olmoe'", "sparse-layer rule", "shared-expert keys"});
}

}  // namespace
}  // namespace shared_expert_config_test
}  // namespace moe_ep::core
