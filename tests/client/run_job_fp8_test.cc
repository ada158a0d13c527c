// `moe-ep run --dispatch-dtype fp8_e4m3` (issue 15 item 4): the workers
// dispatch e4m3 rows with one fp32 scale per 128 values, and the output is
// checked against the reference whose routed experts read the same
// rounding (core::DispatchedHidden), end to end on local Gloo workers.

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
namespace {

using ::testing::HasSubstr;

#define REQUIRE_WORKER()                                                                \
  if (access((std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker").c_str(), X_OK)) \
  GTEST_SKIP() << "moe-ep-worker is not built"

std::string WriteConfig(const nlohmann::json& config) {
  std::string path =
      (std::filesystem::temp_directory_path() / ("fp8-moe-" + std::to_string(getpid()) + ".json"))
          .string();
  std::ofstream(path) << config.dump();
  return path;
}

absl::StatusOr<RunJobResult> RunSmall(const std::string& model, const std::string& experts,
                                      core::DispatchDType dtype, std::ostringstream& out) {
  RunJobOptions o;
  o.model = model;
  o.num_layers = 2;
  o.tokens_per_rank = 24;
  o.experts = experts;
  o.dispatch_dtype = dtype;
  o.workers.num_workers = 3;  // one rank has zero tokens each step
  o.workers.backend = "gloo";
  o.workers.worker_binary = std::string(MOE_EP_BINARY_DIR) + "/server/moe-ep-worker";
  o.rpc_timeout = absl::Seconds(60);
  return RunJob(o, out);
}

TEST(RunJobFp8, PassesAgainstTheSameRoundingAndSendsFewerBytes) {
  REQUIRE_WORKER();
  const std::string path = WriteConfig({{"model_type", "qwen3_moe"},
                                        {"hidden_size", 256},
                                        {"num_hidden_layers", 2},
                                        {"num_experts", 8},
                                        {"num_experts_per_tok", 2},
                                        {"moe_intermediate_size", 64},
                                        {"intermediate_size", 256}});
  for (const std::string experts : {"swiglu", "identity"}) {
    std::ostringstream fp8_out;
    auto fp8 = RunSmall(path, experts, core::DispatchDType::kFP8E4M3, fp8_out);
    ASSERT_TRUE(fp8.ok()) << fp8.status() << "\n" << fp8_out.str();
    EXPECT_TRUE(fp8->AllPass()) << fp8_out.str();
    // DESIGN §5: H + H/32 + 8K = 256 + 8 + 16 = 280 bytes a token.
    EXPECT_THAT(fp8_out.str(), HasSubstr("280 B/token dispatch"));
    EXPECT_THAT(RenderRunSummary(*fp8), HasSubstr("dispatch fp8_e4m3"));
    EXPECT_EQ(RunSummaryJson(*fp8)["dispatch_dtype"], "fp8_e4m3");
    std::ostringstream bf16_out;
    auto bf16 = RunSmall(path, experts, core::DispatchDType::kBF16, bf16_out);
    ASSERT_TRUE(bf16.ok()) << bf16.status() << "\n" << bf16_out.str();
    EXPECT_THAT(bf16_out.str(), HasSubstr("528 B/token dispatch"));  // 2H + 8K
    // The same seeded run moves the same tokens; fp8 rows are smaller.
    ASSERT_EQ(fp8->layers.size(), bf16->layers.size());
    for (size_t l = 0; l < fp8->layers.size(); ++l) {
      EXPECT_EQ(fp8->layers[l].tokens, bf16->layers[l].tokens);
      EXPECT_LT(fp8->layers[l].bytes_sent, bf16->layers[l].bytes_sent);
    }
  }
  std::filesystem::remove(path);
}

TEST(RunJobFp8, OnlyBf16AndFp8AreAccepted) {
  RunJobOptions o;
  o.dispatch_dtype = core::DispatchDType::kNVFP4;
  absl::Status s = ValidateRunJobOptions(o);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(std::string(s.message()),
              HasSubstr("--dispatch-dtype: expected bf16 or fp8_e4m3, got nvfp4"));
  o.dispatch_dtype = core::DispatchDType::kFP8E4M3;
  EXPECT_TRUE(ValidateRunJobOptions(o).ok());
}

}  // namespace
}  // namespace moe_ep::client
