// `moe-ep run --experts checkpoint` (issue 35): a config's quantization_config
// picks the routed experts' format (fp8 128 x 128 block-scaled, gpt-oss
// mxfp4), the local Gloo workers compute it from seeded quantized weights,
// and the output passes against the reference computing the same quantized
// arithmetic; the memory figures are the format's bytes. And Llama-4's
// routed experts compute e(w * x) on the workers and in the reference
// (issue 35 item 5).

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "client/run_job.h"
#include "core/quantized_weights.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {
namespace run_job_quantized_test {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

#define REQUIRE_WORKER()                                                                \
  if (access((std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker").c_str(), X_OK)) \
  GTEST_SKIP() << "moe-ep-worker is not built"

std::string WriteConfig(const std::string& name, const nlohmann::json& config) {
  std::string path =
      (std::filesystem::temp_directory_path() / (name + "-" + std::to_string(getpid()) + ".json"))
          .string();
  std::ofstream(path) << config.dump();
  return path;
}

absl::StatusOr<RunJobResult> RunSmall(const std::string& model, const std::string& experts,
                                      std::ostringstream& out) {
  RunJobOptions o;
  o.model = model;
  o.num_layers = 2;
  o.tokens_per_rank = 16;
  o.experts = experts;
  o.workers.num_workers = 3;  // 8 experts: 3, 3, 2
  o.workers.backend = "gloo";
  o.workers.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  o.rpc_timeout = absl::Seconds(120);
  return RunJob(o, out);
}

TEST(RunJobQuantized, Fp8ExpertsPassAgainstTheFp8Reference) {
  REQUIRE_WORKER();
  // DeepSeek-V3's keys at a small size (H 256, I 256: 2 x 2 scale blocks).
  const std::string path = WriteConfig("fp8-moe", {{"model_type", "deepseek_v3"},
                                                   {"hidden_size", 256},
                                                   {"num_hidden_layers", 3},
                                                   {"first_k_dense_replace", 1},
                                                   {"n_routed_experts", 8},
                                                   {"num_experts_per_tok", 2},
                                                   {"moe_intermediate_size", 256},
                                                   {"intermediate_size", 512},
                                                   {"quantization_config",
                                                    {{"quant_method", "fp8"},
                                                     {"fmt", "e4m3"},
                                                     {"activation_scheme", "dynamic"},
                                                     {"weight_block_size", {128, 128}}}}});
  std::ostringstream out;
  absl::StatusOr<RunJobResult> r = RunSmall(path, "checkpoint", out);
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << out.str();
  EXPECT_TRUE(r->AllPass()) << out.str();
  EXPECT_THAT(out.str(), HasSubstr("weights: fp8 (e4m3, 128 x 128 blocks, dynamic activations)"));
  EXPECT_THAT(out.str(), HasSubstr("routed experts run as fp8-block128"));
  const int64_t expert =
      core::quant::ExpertWeightBytes(core::quant::ExpertWeightFormat::kFp8Block128, 256, 256);
  EXPECT_EQ(expert, 3 * 256 * 256 + 3 * 4 * 4);
  EXPECT_EQ(r->layer_expert_bytes, 8 * expert);
  // Rank 0 holds experts 0..2 in each of the 2 layers, in fp8 bytes.
  EXPECT_EQ(r->expert_bytes_per_rank[0], 2 * 3 * expert);

  // The same config with --experts swiglu stays bf16 (the path of today).
  std::ostringstream bf16_out;
  absl::StatusOr<RunJobResult> b = RunSmall(path, "swiglu", bf16_out);
  ASSERT_TRUE(b.ok()) << b.status() << "\n" << bf16_out.str();
  EXPECT_TRUE(b->AllPass()) << bf16_out.str();
  EXPECT_EQ(b->expert_bytes_per_rank[0], 2 * 3 * 3 * 256 * 256 * 2);
  std::filesystem::remove(path);
}

TEST(RunJobQuantized, GptOssMxfp4ExpertsPass) {
  REQUIRE_WORKER();
  const std::string path = WriteConfig(
      "mxfp4-moe",
      {{"model_type", "gpt_oss"},
       {"hidden_size", 128},
       {"num_hidden_layers", 2},
       {"num_local_experts", 8},
       {"experts_per_token", 2},
       {"intermediate_size", 96},
       {"swiglu_limit", 7.0},
       {"quantization_config",
        {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"model.layers.*.mlp.router"}}}}});
  std::ostringstream out;
  absl::StatusOr<RunJobResult> r = RunSmall(path, "checkpoint", out);
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << out.str();
  EXPECT_TRUE(r->AllPass()) << out.str();
  EXPECT_THAT(out.str(), HasSubstr("weights: mxfp4 (1 x 32 blocks)"));
  EXPECT_THAT(out.str(), HasSubstr("routed experts run as mxfp4"));
  EXPECT_EQ(r->layer_expert_bytes,
            8 * core::quant::ExpertWeightBytes(core::quant::ExpertWeightFormat::kMxfp4, 128, 96));
  std::filesystem::remove(path);
}

TEST(RunJobQuantized, Llama4ScalesTheExpertInput) {
  REQUIRE_WORKER();
  const std::string path = WriteConfig("llama4-moe", {{"model_type", "llama4"},
                                                      {"text_config",
                                                       {{"hidden_size", 128},
                                                        {"num_hidden_layers", 2},
                                                        {"num_local_experts", 8},
                                                        {"num_experts_per_tok", 1},
                                                        {"intermediate_size", 64},
                                                        {"intermediate_size_mlp", 128},
                                                        {"interleave_moe_layer_step", 1}}}});
  std::ostringstream out;
  absl::StatusOr<RunJobResult> r = RunSmall(path, "swiglu", out);
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << out.str();
  EXPECT_TRUE(r->AllPass()) << out.str();
  EXPECT_THAT(out.str(), HasSubstr("compute e(w * x)"));
  EXPECT_THAT(out.str(), Not(HasSubstr("compute w * e(x)")));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace run_job_quantized_test
}  // namespace moe_ep::client
