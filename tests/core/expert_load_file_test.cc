#include "core/expert_load_file.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moe_ep::core {
namespace expert_load_file_test {
namespace {

using ::testing::HasSubstr;

std::string TracesDir() {
  const char* env = std::getenv("MOE_EP_DATA_DIR");
  std::string data = (env != nullptr && *env != '\0') ? env : MOE_EP_DATA_DIR;
  return data + "/traces";
}

TEST(ReadExpertLoadFile, SglangDeepSeekV3Decode) {
  const std::string path = TracesDir() + "/sglang_ep_statistics_deepseek/decode_in1000out1000.json";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << "trace not found at " << path;
  auto rows = ReadExpertLoadFile(path);
  ASSERT_TRUE(rows.ok()) << rows.status();
  ASSERT_EQ(rows->size(), 61u);                               // DeepSeek-V3 layers
  for (const auto& row : *rows) ASSERT_EQ(row.size(), 256u);  // routed experts
  // Layers 0-2 are dense: no routed load; layer 3 is the first MoE layer.
  for (int l = 0; l < 3; ++l) {
    EXPECT_EQ(std::accumulate((*rows)[l].begin(), (*rows)[l].end(), 0.0), 0.0) << "layer " << l;
  }
  EXPECT_GT(std::accumulate((*rows)[3].begin(), (*rows)[3].end(), 0.0), 0.0);
}

TEST(ReadExpertLoadFile, RejectsMissingAndMalformedFiles) {
  auto missing = ReadExpertLoadFile("/nonexistent/load.json");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("/nonexistent/load.json"));

  const auto dir = std::filesystem::path(::testing::TempDir()) / "expert_load_file_test";
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  };
  auto not_json = ReadExpertLoadFile(write("not_json.json", "{logical"));
  EXPECT_EQ(not_json.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(not_json.status().message(), HasSubstr("not JSON"));
  auto no_key = ReadExpertLoadFile(write("no_key.json", R"({"counts": [[1]]})"));
  EXPECT_EQ(no_key.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(no_key.status().message(), HasSubstr("logical_count"));
  auto ragged = ReadExpertLoadFile(write("ragged.json", R"({"logical_count": [[1, 2], [3]]})"));
  EXPECT_EQ(ragged.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(ragged.status().message(), HasSubstr("logical_count[1]: expected an array of 2"));
  auto negative =
      ReadExpertLoadFile(write("negative.json", R"({"logical_count": [[1, 2], [3, -4]]})"));
  EXPECT_EQ(negative.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(negative.status().message(), HasSubstr("logical_count[1][1]"));
  auto ok = ReadExpertLoadFile(write("ok.json", R"({"logical_count": [[1.5, 2], [3, 0]]})"));
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ((*ok)[0][0], 1.5);
  EXPECT_EQ((*ok)[1][1], 0.0);
}

}  // namespace
}  // namespace expert_load_file_test
}  // namespace moe_ep::core
