// `moe-ep run` with shared experts and routed scaling (issue 18): the
// workers' routed + shared output against the reference, end to end on
// embedded Gloo workers, with small configs written by the test.

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "client/run_job.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moe_ep::client {
namespace run_job_shared_expert_test {
namespace {

using ::testing::HasSubstr;

std::string WriteConfig(const std::string& name, const nlohmann::json& config) {
  std::string path =
      (std::filesystem::temp_directory_path() / (name + "-" + std::to_string(getpid()) + ".json"))
          .string();
  std::ofstream(path) << config.dump();
  return path;
}

absl::StatusOr<RunJobResult> RunSmall(const std::string& model, const std::string& experts,
                                      std::ostringstream& out) {
  const std::string worker = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  RunJobOptions o;
  o.model = model;
  o.num_layers = 2;
  o.tokens_per_rank = 20;
  o.experts = experts;
  o.workers.num_workers = 3;  // one rank has zero tokens each step
  o.workers.backend = "gloo";
  o.workers.worker_binary = worker;
  o.rpc_timeout = absl::Seconds(60);
  return RunJob(o, out);
}

#define REQUIRE_WORKER()                                                                \
  if (access((std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker").c_str(), X_OK)) \
  GTEST_SKIP() << "moe-ep-worker is not built"

// Qwen2-MoE style: a gated shared expert of I 192 next to 8 routed experts.
TEST(RunJobShared, QwenGatedSharedExpertMatchesReference) {
  REQUIRE_WORKER();
  const std::string path = WriteConfig("qwen-shared", {{"model_type", "qwen2_moe"},
                                                       {"hidden_size", 128},
                                                       {"num_hidden_layers", 2},
                                                       {"num_experts", 8},
                                                       {"num_experts_per_tok", 2},
                                                       {"moe_intermediate_size", 64},
                                                       {"shared_expert_intermediate_size", 192},
                                                       {"intermediate_size", 256}});
  for (const std::string experts : {"swiglu", "identity"}) {
    std::ostringstream out;
    auto r = RunSmall(path, experts, out);
    ASSERT_TRUE(r.ok()) << r.status() << "\n" << out.str();
    EXPECT_TRUE(r->AllPass()) << out.str();
    EXPECT_EQ(r->shared_expert.intermediate_size, 192);
    EXPECT_THAT(out.str(), HasSubstr("shared experts: 1 (shared_expert_intermediate_size), "
                                     "intermediate 192, gate sigmoid"));
    EXPECT_THAT(out.str(), HasSubstr("+ shared expert"));
    const nlohmann::json j = RunSummaryJson(*r);
    EXPECT_EQ(j["shared_expert"]["intermediate_size"], 192);
    EXPECT_EQ(j["shared_expert"]["gate"], "sigmoid");
    if (experts == "swiglu") {
      // Each worker holds its routed experts plus the shared replica
      // (3 * 192 * 128 * 2 bytes + the gate's 256) per layer.
      for (int64_t b : r->expert_bytes_per_rank) EXPECT_GE(b, 2 * (3 * 192 * 128 * 2 + 256));
    }
  }
  std::filesystem::remove(path);
}

// DeepSeek style: 2 shared experts fused (I 2 * 32), routed scaling 2.5
// folded into the weights the coordinator sends.
TEST(RunJobShared, DeepSeekSharedExpertsAndRoutedScaling) {
  REQUIRE_WORKER();
  const std::string path = WriteConfig("deepseek-shared", {{"model_type", "deepseek_v3"},
                                                           {"hidden_size", 128},
                                                           {"num_hidden_layers", 3},
                                                           {"n_routed_experts", 6},
                                                           {"num_experts_per_tok", 2},
                                                           {"moe_intermediate_size", 32},
                                                           {"intermediate_size", 256},
                                                           {"first_k_dense_replace", 1},
                                                           {"n_shared_experts", 2},
                                                           {"routed_scaling_factor", 2.5}});
  std::ostringstream out;
  auto r = RunSmall(path, "swiglu", out);
  ASSERT_TRUE(r.ok()) << r.status() << "\n" << out.str();
  EXPECT_TRUE(r->AllPass()) << out.str();
  EXPECT_EQ(r->shared_expert.intermediate_size, 64);
  EXPECT_DOUBLE_EQ(r->routed_scaling_factor, 2.5);
  EXPECT_THAT(out.str(), HasSubstr("routed scaling 2.5 (folded into the top-k weights)"));
  EXPECT_DOUBLE_EQ(RunSummaryJson(*r)["routed_scaling_factor"].get<double>(), 2.5);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace run_job_shared_expert_test
}  // namespace moe_ep::client
